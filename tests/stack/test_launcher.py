"""`make run`'s launcher (`pdserve serve`): up to ready, a working answer, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from conftest import MODEL
from helpers import generate

from bench.engine import tiny_archs
from pdserve.local.servers import free_port
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.engine.weights import choose

pytestmark = pytest.mark.slow
# this checkout's code (run from another directory, it would otherwise be the installed one's), children too;
# the settings' defaults, as `make run` has them
ENV = {**{k: v for k, v in os.environ.items() if k not in ("PD_WEIGHTS", "PD_GRAMMAR_PRELOAD")},
       "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def test_launcher_starts_everything_and_ctrl_c_stops_everything(smollm2_native, tmp_path):
    """With no settings, the workers compute with the GGUF's own blocks (PD_WEIGHTS=auto): the
    answer is the in-process native engine's greedy tokens."""
    native = smollm2_native
    assert choose("auto", True, "cpu", torch.float32) == "native" and native.tokenizer is not None
    ids = native.tokenizer.encode(native.tokenizer.apply_chat_template(PARIS))
    want = native.tokenizer.decode(generate(native, {"q": ids}, SamplingParams(max_tokens=16, temperature=0))["q"])
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.local.stack", "--port", str(port), "--nats-port",
                             str(free_port()), "--redis-port", str(free_port())], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        until_ready(proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        for part in ("nats-server", "valkey-server", "pdserve.services.router", "pdserve.services.gateway",
                     "pdserve.services.prefill", "pdserve.services.decode"):
            assert part in names, part
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": PARIS, "max_tokens": 16, "temperature": 0})
        assert r.json()["choices"][0]["message"]["content"] == want
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        time.sleep(0.5)
        assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        end_tree(proc)


def test_pdserve_serve_a_model_directory(tmp_path):
    """`pdserve serve --model DIR`: a tiny random checkpoint, colocated, answers under the directory's name."""
    model, port = tiny_archs.save("qwen2", tmp_path, tokenizer=True), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.cli", "serve", "--model", str(model),
                             "--colocated", "--threads", "1", "--kv-blocks", "128", "--port", str(port), "--nats-port",
                             str(free_port()), "--redis-port", str(free_port())], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        until_ready(proc)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "qwen2", "prompt": "The capital of France is", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        end_tree(proc)


def end_tree(proc: subprocess.Popen) -> None:
    """The launcher, if it still runs (a failed test), killed with every process under it."""
    if proc.poll() is None:
        tree = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        proc.wait()
        for child in tree:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)


def until_ready(proc: subprocess.Popen) -> None:
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready in") or "failed" in line:
            break
    assert any(line.startswith("ready in") for line in lines), "".join(lines)
