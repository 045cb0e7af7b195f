"""Prefix-aware placement on the live stack: prompts that share a long system prompt go to
the prefill worker that already holds it, and reuse its KV. On the fake model (tests/stack/conftest.py):
its prefix cache and KV are the real engine's; what is tested is where requests go and what they
reuse, with a step time per pass where a worker must stay busy for a while."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from conftest import FAKE, MODEL, fake_env

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.state import request_key, worker_key

pytestmark = pytest.mark.slow
SYSTEM = "You are the archive assistant of the river town of Alder. " + " ".join(
    f"Record {i}: the {c} mill ground {i * 13} sacks in week {i}." for i, c in
    enumerate(["north", "south", "east", "west", "old", "new"] * 5))


def _wait_until_busy(stack: Stack, worker_id: str, timeout_s: float = 60) -> None:
    """Until the registry shows work on that worker (queued prompt tokens, or sequences), and
    the router's 0.2 s view of the registry has caught up."""
    store = redis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = json.loads(store.get(worker_key(worker_id)) or "{}")
        if info.get("queued_tokens") or info.get("running") or info.get("waiting"):
            time.sleep(0.3)
            return
        time.sleep(0.05)
    raise AssertionError(f"{worker_id} never showed the work sent to it")


def _ask(url: str, messages, max_tokens=4) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={   # busy for exactly max_tokens steps
        "model": MODEL, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "messages": messages})
    assert r.status_code == 200, r.text
    return r


def test_shared_system_prompts_stay_on_the_worker_that_caches_them(otlp, tmp_path):
    """prefill-0 is busy with another long prompt when the first system-prompt request comes,
    so that one goes to prefill-1; every later one follows its cache there, though both
    workers are idle by then (a least-loaded or round-robin choice would not). Two router
    replicas share the requests: what they decide from lives in Redis. (The prefill workers at 1 s
    a pass: the other long prompt keeps prefill-0 busy for 2 s.)"""
    slow = {"PD_FAKE_STEP_S": "1.0"}
    cfg = StackConfig.on_free_ports(prefill=2, decode=1, routers=2, kv_blocks=1024, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url, PD_HEARTBEAT_S="0.3"),
                                    worker_env={"prefill-0": slow, "prefill-1": slow})
    traces = []
    other = [{"role": "user", "content": SYSTEM.replace("Alder", "Birch") + " Summarize."}]
    with Stack(cfg) as stack, ThreadPoolExecutor(1) as pool:
        busy = pool.submit(_ask, stack.url, other, 1)
        _wait_until_busy(stack, "prefill-0")
        for q in ["Which mill ground the most?", "What happened in week 3?", "Name the mills.",
                  "How many records are there?"]:
            r = _ask(stack.url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            traces.append((r.headers["x-trace-id"], r.json()["usage"]["prompt_tokens"]))
            busy.result()
            if len(traces) == 1:  # the replica that placed the first one leaves; the other decides alone
                first_router = otlp.attributes(traces[0][0], {"router.route"})["router.route"]["router"]
                stack.procs[first_router].terminate()
                stack.procs[first_router].wait(30)
    spans = [otlp.attributes(trace_id, {"router.route", "prefill.compute"}) for trace_id, _ in traces]
    workers = [s["router.route"]["prefill_worker"] for s in spans]
    assert workers == ["prefill-1"] * 4, workers
    assert {s["router.route"]["router"] for s in spans[1:]} == {"router", "router-1"} - {first_router}
    system_tokens = traces[0][1] - 20                        # all but the question's few tokens
    for s in spans[1:]:
        assert s["router.route"]["prefill_cached_tokens"] >= system_tokens // 16 * 16 - 16, s["router.route"]
        assert s["prefill.compute"]["cached_tokens"] == s["router.route"]["prefill_cached_tokens"]


def test_turns_of_a_conversation_follow_their_kv_across_a_router_restart(otlp, tmp_path):
    """decode-0 is busy when turn 1 comes, so it goes to decode-1; turns 2 and 3 go back there
    (both decode workers idle by then) and send only their new blocks — turn 3 through a
    router restarted in between, which kept nothing in memory. (100 ms a pass: the 48 tokens keep
    decode-0 busy for about 5 s.)"""
    cfg = StackConfig.on_free_ports(prefill=1, decode=2, kv_blocks=1024, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(0.1, OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url, PD_HEARTBEAT_S="0.3",
                                                 # (with cheapest, a turn its decode worker mostly holds is
                                                 # prefilled there)
                                                 PD_PLACEMENT="remote"))
    convo = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which mill ground the most?"}]
    results = []

    def turn(stack):
        r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, headers={"x-session-id": "conv-1"}, json={
            "model": MODEL, "temperature": 0, "max_tokens": 8, "messages": convo})
        assert r.status_code == 200, r.text
        convo.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        convo.append({"role": "user", "content": f"And after that ({len(convo)})?"})
        results.append((r.headers["x-trace-id"], r.json()["usage"]["prompt_tokens"]))

    with Stack(cfg) as stack, ThreadPoolExecutor(1) as pool:
        busy = pool.submit(_ask, stack.url, [{"role": "user", "content": "Count slowly from one to fifty."}], 48)
        _wait_until_busy(stack, "decode-0")
        turn(stack)
        busy.result()
        turn(stack)
        router = stack.procs["router"]
        router.terminate()
        router.wait(30)
        stack.service("router", "pdserve.services.router.main")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready = httpx.get(stack.metrics_url("gateway", "/ready")).json()
            if ready.get("ready") and ready["workers"].get("router") == 1:
                break
            time.sleep(0.3)
        time.sleep(1)   # the old router's registry entry is gone, the new one is in
        turn(stack)
    spans = [otlp.attributes(trace_id, {"router.route", "kv.transfer"}) for trace_id, _ in results]
    assert [s["router.route"]["decode_worker"] for s in spans] == ["decode-1"] * 3
    for (_, before), (_, now), s in zip(results, results[1:], spans[1:]):
        sent = s["kv.transfer"]
        assert sent["skipped_blocks"] >= before // 16 - 1                     # the last turn's KV stayed
        assert sent["bytes"] == (-(-now // 16) - sent["skipped_blocks"]) * 30 * 2 * 16 * 3 * 64 * 4


def test_a_request_over_the_ttft_objective_is_refused_with_429_and_retry_after(tmp_path):
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(PD_TTFT_SLO_S="0.001"))
    with Stack(cfg) as stack:
        r = httpx.post(stack.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "ttft_objective_exceeded"
    assert "exceeds the 0.001 s objective" in err["message"]


def test_a_short_prompt_behind_a_long_one_is_prefilled_on_the_decode_worker(tmp_path):
    """PD_PLACEMENT=cheapest (the default): while prefill-0 computes a long prompt in one pass, a
    short chat is placed on the decode worker (it would wait there behind far more than its own
    work) and has its answer before the long prompt's first token. (prefill-0 at 3 s a pass.)"""
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=1024, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(PD_HEARTBEAT_S="0.3", PD_PREFILL_CHUNK="2048",
                                                 PD_MAX_BATCHED_TOKENS="2048"),
                                    worker_env={"prefill-0": {"PD_FAKE_STEP_S": "3"}})
    long = [{"role": "user", "content": SYSTEM * 3 + " Summarise."}]
    with Stack(cfg) as stack, ThreadPoolExecutor(1) as pool:
        store = redis.Redis.from_url(stack.redis_url)
        first = pool.submit(_ask, stack.url, long, 2)
        _wait_until_busy(stack, "prefill-0")
        short = _ask(stack.url, [{"role": "user", "content": "Name a colour."}], 2)
        assert not first.done(), "the short prompt waited for the long one"
        record = {k.decode(): v.decode() for k, v in store.hgetall(request_key(short.headers['x-request-id'])).items()}
        assert record["mode"] == "local" and "remote" in record["reason"], record
        assert first.result().json()["usage"]["prompt_tokens"] > 1000
