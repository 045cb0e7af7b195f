"""Cross-host path on one machine: prefill and decode sides in two network namespaces joined
by a veth pair; the KV moves over UCX TCP across the veth (shared memory is switched off, as it
would be absent between hosts). Needs root and `ip netns`; skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import run_all, tokens

from pdserve.local.servers import binary

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
A_IP, B_IP = "10.231.77.1", "10.231.77.2"


def _ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def netns_pair():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) on this machine")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    a, b, va, vb = f"pdA{tag}", f"pdB{tag}", f"pva{tag}", f"pvb{tag}"
    made = _ip("netns", "add", a)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    try:
        steps = [("netns", "add", b), ("link", "add", va, "type", "veth", "peer", "name", vb),
                 ("link", "set", va, "netns", a), ("link", "set", vb, "netns", b)]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot join namespaces with a veth pair: ip {' '.join(step)}: {r.stderr.strip()}")
        for ns, dev, addr in ((a, va, A_IP), (b, vb, B_IP)):
            for step in (("addr", "add", f"{addr}/24", "dev", dev), ("link", "set", dev, "up"),
                         ("link", "set", "lo", "up")):
                r = _ip(*step, ns=ns)
                assert r.returncode == 0, r.stderr
        yield a, b, va, vb
    finally:
        _ip("netns", "del", a)
        _ip("netns", "del", b)


def _rx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"],
                         capture_output=True, text=True)
    return int(out.stdout)


def test_kv_crosses_a_veth_pair_over_ucx_tcp(netns_pair, tiny, tmp_path):
    from netns_peer import CONFIG, PARAMS, PROMPT

    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import Engine

    a, b, va, vb = netns_pair
    nats = subprocess.Popen(["ip", "netns", "exec", a, binary("nats-server"), "-a", A_IP, "-p", "4222"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, "UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n",
           "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    peer = [sys.executable, str(ROOT / "tests" / "netns_peer.py")]
    url = f"nats://{A_IP}:4222"
    procs = []
    try:
        time.sleep(0.5)
        rx_before = _rx_bytes(b, vb)
        procs.append(subprocess.Popen(["ip", "netns", "exec", b, *peer, "decode", url, str(tmp_path)],
                                      env={**env, "UCX_NET_DEVICES": vb}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen(["ip", "netns", "exec", a, *peer, "prefill", url, str(tmp_path)],
                                      env={**env, "UCX_NET_DEVICES": va}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
        for p in procs:
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0, out.decode()[-3000:]
        rx_after = _rx_bytes(b, vb)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        nats.terminate()
        nats.wait()
    result = json.loads((tmp_path / "result.json").read_text())
    sent = json.loads((tmp_path / "prefill.json").read_text())
    ref = Engine(tiny, EngineConfig(**CONFIG))
    ref.add_request("r", PROMPT, PARAMS)
    assert result["tokens"] == tokens(run_all(ref)["r"])
    assert sent["ok"] and result["bad_blocks"] == 0
    layers, block_nbytes = tiny.config.num_layers, ref.runner.kv[0][0].nbytes
    assert result["bytes"] == sent["bytes"] == 38 * layers * block_nbytes     # 600 tokens: 38 blocks
    # it crossed the veth: the NATS notices are ~50 KB, the KV 467 KB; shared memory would move
    # it without touching the interface
    assert rx_after - rx_before >= result["bytes"]
