"""The services on the GPU (the last step of `make gpu-check`): one prefill and one decode worker
with PD_DEVICE=cuda and PD_DTYPE=bfloat16, behind the router and the gateway (the local stack),
every prompt prefilled in the prefill pool and decoded after the KV handoff.

- each request's greedy tokens against the in-process engine's on the same device and dtype
  (the same kernels: equal but for bf16 turning a near tie another way in a batch of another shape);
- the decode worker's received KV bytes (the handoff happened);
- time to first token and the decode rate per streamed request.

    python scripts/gpu_services.py               on a CUDA machine (gpu_check.py calls services())
    python scripts/gpu_services.py --device cpu  the same steps here, fp32 (what a test runs)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sequence import SamplingParams

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.",
             "Summarize this log. " + " ".join(f"Valve {i} read {i * 13 % 97} bar." for i in range(60))]
NEW = 24


def drain(engine: Engine) -> list[int]:
    """Every token the engine's steps give until it has no work."""
    out = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


def expected(device: str, dtype: torch.dtype, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """The in-process engine's greedy tokens, one request at a time."""
    engine = Engine(load("smollm2", dtype=dtype, device=device), EngineConfig(num_blocks=1024, dtype=dtype,
                                                                             device=device))
    out = {}
    for q, ids in prompts.items():
        engine.add_request(q, ids, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
        out[q] = drain(engine)
    return out


def _streamed(stack: Stack, question: str) -> tuple[float, float]:
    """(seconds to the first token, tokens per second after it) of one streamed request."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 64, "ignore_eos": True, "stream": True}
    start, first, chunks = time.perf_counter(), 0.0, 0
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                chunks += 1
                first = first or time.perf_counter()
    return first - start, (chunks - 1) / max(time.perf_counter() - first, 1e-9)


def services(device: str, check: Callable[..., None]) -> dict:
    """Runs the stack on `device`; reports each check through check(name, ok, detail)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = load("smollm2").tokenizer
    assert tok is not None
    prompts = {q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS}
    want = expected(device, dtype, prompts)
    env = {"PD_DEVICE": device, "PD_DTYPE": str(dtype).removeprefix("torch."), "PD_PLACEMENT": "remote",
           "PD_WEIGHTS": "fp32"}  # (as the in-process engine's: on a CPU `auto` is the GGUF's own blocks)
    with tempfile.TemporaryDirectory() as logs:
        cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=1024, log_dir=Path(logs), env=env)
        with Stack(cfg) as stack:
            equal = total = 0
            for q in QUESTIONS:
                r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
                    "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": q}],
                    "temperature": 0, "max_tokens": NEW, "ignore_eos": True, "return_token_ids": True})
                check(f"services on {device}: a request answered", r.status_code == 200, r.text[:200])
                got = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else []
                equal += sum(a == b for a, b in zip(got, want[q]))
                total += NEW
            exact = device != "cuda"  # fp32 here: every token; bf16: near ties may turn
            check(f"services on {device}: tokens equal the in-process engine's", equal == total if exact
                  else equal >= 0.75 * total, f"{equal}/{total}")
            received = stack.metric_total("decode-0", "pd_kv_received_bytes_total")
            check(f"services on {device}: the decode worker received the prompts' KV", received > 0,
                  f"{received:.0f} bytes")
            streams = [_streamed(stack, q) for q in QUESTIONS]
    summary = {"tokens_equal": equal, "tokens": total, "kv_received_bytes": received,
               "ttft_s": [round(s[0], 4) for s in streams], "decode_tokens_per_s": [round(s[1], 1) for s in streams]}
    for k, v in summary.items():
        print(f"      {k:24} {v}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    failures: list[str] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}")
        if not ok:
            failures.append(name)

    print(json.dumps(services(parser.parse_args().device, check)))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
