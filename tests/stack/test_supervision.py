"""The routers' supervisor on the live stack: a decode worker that heartbeats but whose step
never returns has its stream moved to another worker; a gateway that dies has its requests
cancelled on the workers. One stack for both (2 decode workers, stall_s 2 s), on the fake model
(tests/stack/conftest.py) at 60 ms a pass (a 400-token answer lasts ~25 s, as on the real one):
what is tested is the supervisor's failover and cancellation, the stream compared with the
in-process fake engine's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest
import redis
from conftest import FAKE, MODEL, fake_env
from helpers import generate

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.state import log_key, request_key, worker_key

pytestmark = pytest.mark.slow
HANG_AFTER = 24   # engine steps of decode-0: it hangs after ~25 tokens


@pytest.fixture(scope="module")
def stack(tmp_path_factory, otlp):
    cfg = StackConfig.on_free_ports(prefill=1, decode=2, kv_blocks=512, log_dir=tmp_path_factory.mktemp("logs"),
                                    model=FAKE, env=fake_env(0.06, PD_HEARTBEAT_S="0.3", PD_FAILOVER_CHECK_S="0.3",
                                                             PD_STALL_S="2", OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url),
                                    worker_env={"decode-0": {"PD_FAULT_ENGINE_HANG_AFTER_STEPS": str(HANG_AFTER)}})
    with Stack(cfg) as s:
        yield s


def _blocks(store, worker: str) -> tuple[int, int, int]:
    info = json.loads(store.get(worker_key(worker)) or "{}")
    return info.get("free_blocks", -1), info.get("total_blocks", 0), info.get("running", -1)


def test_a_hung_decode_step_is_moved_by_the_supervisor_and_the_stream_stays_exact(stack, fake, otlp):
    """decode-0's step hangs after 24 tokens while it heartbeats on: the supervisor sees the
    request's decoding deadline pass and tells the gateway, which moves it to decode-1: the
    prefill worker computes prompt + 25 tokens (the prompt from its cache) and hands the KV
    over. The stream equals the in-process engine's; the timeline and the trace tell the story
    (failover event, a second route in remote mode whose decode.generate receives the KV)."""
    messages = [{"role": "user", "content": "Write a short story about a fox and a crow."}]
    tok = fake.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages))
    expected = generate(fake, {"q": prompt}, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))["q"]
    store = redis.Redis.from_url(stack.redis_url)
    store.set("pd:session:hang", "decode-0")   # the conversation's worker: the request goes there
    ids, gaps, last = [], [], None
    with httpx.Client(base_url=stack.url, timeout=120) as http, http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 40, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "session_id": "hang"}) as r:
        rid, trace_id = r.headers["x-request-id"], r.headers["x-trace-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                new = json.loads(line[6:])["choices"][0].get("token_ids") or []
                if new and last is not None:
                    gaps.append(time.monotonic() - last)
                last = time.monotonic() if new else last
                ids += new
    timeline = subprocess.run([sys.executable, "-m", "pdserve.shared.tools.timeline", rid,
                               "--redis-url", stack.redis_url],
                              capture_output=True, text=True, timeout=30).stdout
    events = [line.split()[2] for line in timeline.splitlines()[1:]]
    hung, survivor = "decode-0", "decode-1"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _blocks(store, survivor)[0] != _blocks(store, survivor)[1]:
        time.sleep(0.1)
    stack.procs[hung].send_signal(signal.SIGKILL)   # its drain would wait on the hung step forever
    assert ids == expected, (len(ids), len(expected))
    assert events[:2] == ["received", "routed"] and "stalled" in events
    assert events[-6:] == ["failover#1", "routed#1", "prefilling#1", "transferring#1", "decoding#1",
                           "finished#1"], timeline
    assert "why=stalled in decoding lost=decode-0" in timeline and "decode=decode-1" in timeline
    free, total, running = _blocks(store, survivor)
    assert free == total and running == 0
    spans = otlp.wait_for(trace_id, {"gateway.request", "router.route", "decode.generate", "prefill.compute"})
    by_id = {s.span_id: s for s in spans}
    root = next(s for s in spans if s.name == "gateway.request")
    failover = [attrs for name, attrs in root.events if name == "failover"]
    assert failover and failover[0]["why"] == "stalled in decoding" and failover[0]["attempt"] == 1, root.events
    routes = sorted((s for s in spans if s.name == "router.route"), key=lambda s: s.attributes["attempt"])
    assert [(r.attributes["attempt"], r.attributes["mode"]) for r in routes] == [(0, "remote"), (1, "remote")]
    assert routes[1].attributes["decode_worker"] == "decode-1"
    resumed = [s for s in spans if s.name == "decode.generate" and by_id[s.parent_id] is routes[1]]
    assert len(resumed) == 1 and resumed[0].service == "pdserve-decode"
    assert [s for s in spans if s.name == "kv.receive" and s.parent_id == resumed[0].span_id]  # the KV came over
    assert resumed[0].attributes["output_tokens"] == 40
    stall = max(gaps)
    assert 2 <= stall < 10, stall   # stall_s, a supervisor round, the re-prefill (the token timeout is 120 s)
    print(f"hung step on {hung}: stream moved to {survivor}, longest gap {stall:.1f} s\n{timeline}")


def test_a_lost_gateways_requests_are_cancelled_on_the_workers(stack):
    """kill -9 of the gateway while it streams a 400-token answer: its lease lapses, the
    supervisor cancels the request, and the decode worker's blocks come back long before the
    answer would have ended (~25 s)."""
    store = redis.Redis.from_url(stack.redis_url)
    store.set("pd:session:orphan", "decode-1")   # not decode-0, whose step hangs
    client = httpx.Client(base_url=stack.url, timeout=120)
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                        "max_tokens": 400, "ignore_eos": True, "stream": True,
                                                        "session_id": "orphan"}) as r:
        rid = r.headers["x-request-id"]
        for n, _line in enumerate(r.iter_lines()):
            if n >= 10:   # (killed before the loop ends: leaving it would close the connection first)
                stack.procs["gateway"].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                break
    record = {k.decode(): v.decode() for k, v in store.hgetall(request_key(rid)).items()}
    worker = record.get("decode")
    assert worker == "decode-1", record
    freed_s = None
    while time.monotonic() - killed < 15:
        free, total, running = _blocks(store, worker)
        if free == total and running == 0:
            freed_s = time.monotonic() - killed
            break
        time.sleep(0.1)
    events = [json.loads(e) for e in store.lrange(log_key(rid), 0, -1)]
    assert freed_s is not None and freed_s < 10, freed_s
    failed = [e for e in events if e["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["by"] == "router" and "lost" in failed[0]["reason"], events
    print(f"gateway killed: request cancelled and blocks back {freed_s:.1f} s later")
