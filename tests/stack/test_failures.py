"""Failures on the live stack: a prefill worker killed mid-job costs its lease, not the KV
deadline, and not the request: its job moves to another prefill worker. They run the fake model
(tests/stack/conftest.py): the path is what they test, not the model's numbers; each answer
equals the in-process engine's on the same model."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import FAKE, MODEL, fake_env
from helpers import generate

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.state import log_key, request_key, route_key, worker_key
from pdserve.shared.state.keys import batch_key
from pdserve.shared.urls import sync_redis


def logged(store, request_id: str) -> list[dict]:
    """The request's events, each once: its log is written at least once (a batch of events whose
    write is tried again can land twice: the same event, to its timestamp)."""
    events = [json.loads(e) for e in store.lrange(log_key(request_id), 0, -1)]
    return [e for i, e in enumerate(events) if e not in events[:i]]


DOCUMENT = " ".join(f"Entry {i}: the {c} gate was opened {i * 7} times in season {i % 4}." for i, c in
                    enumerate(["red", "blue", "green", "grey", "white", "black"] * 12))


def test_a_prefill_worker_killed_mid_prompt_costs_its_lease_not_the_request(fake, tmp_path):
    """kill -9 of the prefill worker computing a long prompt: the decode worker sees its lease
    lapse (~3 heartbeats, not the 30 s KV deadline) and a router puts the job on the other
    prefill worker's queue; kill -9 of that one too (on a second request): with no prefill
    worker left the decode worker prefills it itself. Both answers equal the in-process
    engine's, and no KV block stays taken."""
    # two documents (the second is not in a prefix cache when asked)
    asks = [[{"role": "user", "content": f"Report {n}. " + DOCUMENT + " Which gate was opened most?"}] for n in "AB"]
    tok = fake.tokenizer
    prompts = {i: tok.encode(tok.apply_chat_template(m)) for i, m in enumerate(asks)}
    expected = generate(fake, prompts, SamplingParams(max_tokens=8, temperature=0))
    slow = {"PD_FAKE_STEP_S": "1"}   # a prompt of 2 chunks takes the prefill worker 2 s: caught computing it
    cfg = StackConfig.on_free_ports(prefill=2, decode=1, kv_blocks=512, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(PD_HEARTBEAT_S="0.3", PD_KV_TIMEOUT_S="30", PD_PLACEMENT="remote"),
                                    worker_env={"prefill-0": slow, "prefill-1": slow})
    with Stack(cfg) as stack, ThreadPoolExecutor(1) as pool:
        store = sync_redis(stack.redis_url)

        def kill_the_one_computing_it(messages) -> tuple[httpx.Response, float, str]:
            reply = pool.submit(httpx.post, stack.url + "/v1/chat/completions", timeout=120, json={
                "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 8, "return_token_ids": True})
            deadline, victim = time.monotonic() + 60, None
            while time.monotonic() < deadline and victim is None:   # until a prefill worker holds the prompt
                victim = next((w for w in ("prefill-0", "prefill-1") if stack.procs[w].poll() is None and json.loads(
                    store.get(worker_key(w)) or "{}").get("queued_tokens")), None)
                time.sleep(0.05)
            assert victim, "no prefill worker took the prompt"
            stack.procs[victim].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            return reply.result(), time.monotonic() - killed, victim

        moved, moved_s, first = kill_the_one_computing_it(asks[0])
        moved_events = logged(store, moved.headers["x-request-id"])
        local, local_s, second = kill_the_one_computing_it(asks[1])
        record = {k.decode(): v.decode() for k, v in store.hgetall(request_key(local.headers["x-request-id"])).items()}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            decode = json.loads(store.get(worker_key("decode-0")))
            if decode["free_blocks"] == decode["total_blocks"]:
                break
            time.sleep(0.2)
    for i, r in enumerate((moved, local)):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected[i]
    routed = [e for e in moved_events if e["event"] == "routed"]
    assert [e["prefill"] for e in routed] == [first, second] and "requeued" in routed[1]["reason"], routed
    assert [e["by"] for e in moved_events if e["event"] == "prefilling"][-1] == second, moved_events
    assert not [e for e in moved_events if e["event"] == "prefill_local"], moved_events  # no recompute on decode
    # no prefill worker left: prefilled on the decode worker, on the lease (either sign may come
    # first: the lease lapsing, or the KV connection reset), never on the KV deadline
    assert "t_prefill_local" in record and record.get("reason") and "deadline" not in record["reason"], record
    assert moved_s < 20 and local_s < 20, (moved_s, local_s)  # the deadline alone would take 30 s
    assert decode["free_blocks"] == decode["total_blocks"], decode
    print(f"prefill worker killed: request done {moved_s:.1f} s later on the other prefill worker, "
          f"{local_s:.1f} s later on the decode worker with none left ({len(prompts[0])}-token prompts)")


def test_a_failing_kv_path_opens_its_breaker_and_requests_go_colocated(tmp_path):
    """Every KV payload arrives corrupt (fault injection, every attempt): each handoff fails
    after its re-sends and the decode worker prefills locally. After 3 such failures the
    routers' breaker for prefill-0 → decode-0 opens and the next requests are prefilled on the
    decode worker from the start — no more doomed transfers; every answer still arrives."""
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, log_dir=tmp_path, model=FAKE, env=fake_env(
        PD_KV_FAULT_CORRUPT_RATE="1.0", PD_KV_FAULT_CORRUPT_SENDS="99", PD_BREAKER_FAILURES="3",
        PD_BREAKER_COOLDOWN_S="300"))
    modes, answers = [], []
    with Stack(cfg) as stack:
        store = sync_redis(stack.redis_url)
        for i in range(6):
            r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
                "model": MODEL, "temperature": 0, "max_tokens": 3,
                "messages": [{"role": "user", "content": f"Name a colour ({i})."}]})
            answers.append(r.status_code)
            record = store.hgetall(request_key(r.headers['x-request-id']))
            modes.append((record[b"mode"].decode(), record[b"reason"].decode()))
            time.sleep(0.2)   # the outcome reaches the router
    assert answers == [200] * 6
    assert [m for m, _ in modes] == ["remote"] * 3 + ["local"] * 3, modes
    assert "breaker open" in modes[3][1]


def test_a_prefill_job_the_queue_refuses_is_prefilled_on_the_decode_worker_at_once(tmp_path):
    """The decode worker queues the prefill job with its admit. When the stream refuses it
    (full here: one message at most, new ones discarded), the request is prefilled on the
    decode worker at once — not after the KV deadline (60 s here) — and still answered."""
    import asyncio

    import nats
    from nats.js.api import DiscardPolicy

    from pdserve.shared import subjects

    async def fill_queue(url: str) -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        config = (await js.stream_info(subjects.PREFILL_STREAM)).config
        config.max_msgs, config.discard = 1, DiscardPolicy.NEW
        await js.update_stream(config)
        await js.publish(subjects.prefill_jobs("nobody"), b"{}")  # never taken: the queue stays full
        await nc.close()

    # (the streams' keeper would set the stream's limits back within its 5 s: not within this test)
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(PD_KV_TIMEOUT_S="60", PD_KEEP_S="3600"))
    with Stack(cfg) as stack:
        asyncio.run(fill_queue(stack.nats_url))
        start = time.monotonic()
        r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "temperature": 0, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi."}]})
        took = time.monotonic() - start
        store, events = sync_redis(stack.redis_url), []
        for _ in range(50):  # events are written in the background
            events = [json.loads(e) for e in store.lrange(log_key(r.headers['x-request-id']), 0, -1)]
            if any(e["event"] == "prefill_local" for e in events):
                break
            time.sleep(0.1)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    local = [e for e in events if e["event"] == "prefill_local"]
    assert local and "not queued" in local[0]["reason"], events
    assert took < 20, took


def test_a_frozen_prefill_worker_loses_the_job_to_another_in_about_its_predicted_time(fake, tmp_path):
    """prefill-0's engine step hangs while it heartbeats on (its lease holds): the decode
    worker counts it frozen once the step has run past the prefill's predicted time and 3x
    the worker's longest recent step or full pass (256 tokens here; at least the 2 s floor)
    instead of the 30 s ceiling, then a router puts the job on prefill-1's queue. The answer
    equals the in-process engine's; nothing is prefilled on the decode worker."""
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    tok = fake.tokenizer
    expected = generate(fake, {"q": tok.encode(tok.apply_chat_template(messages))},
                        SamplingParams(max_tokens=8, temperature=0))["q"]
    cfg = StackConfig.on_free_ports(prefill=2, decode=1, kv_blocks=512, log_dir=tmp_path, model=FAKE,
                                    env={**fake_env(), "PD_HEARTBEAT_S": "0.3", "PD_KV_TIMEOUT_S": "30",
                                         "PD_KV_MIN_TIMEOUT_S": "2",
                                         "PD_MAX_BATCHED_TOKENS": "256", "PD_PREFILL_CHUNK": "256",
                                         # by soonest, the faster-measured worker takes the first request and,
                                         # its prefix cached, every later one: prefill-0 might never get one
                                         "PD_PREFILL_CHOICE": "round_robin",
                                         # (with cheapest a prompt behind the hung one's queue is prefilled locally)
                                         "PD_PLACEMENT": "remote"},
                                    worker_env={"prefill-0": {"PD_FAULT_ENGINE_HANG_AFTER_STEPS": "1"}})
    with Stack(cfg) as stack:
        store = sync_redis(stack.redis_url)
        for _ in range(4):   # the first step of prefill-0 runs; a later one hangs (whichever gets it)
            start = time.monotonic()
            r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
                "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 8, "return_token_ids": True})
            took = time.monotonic() - start
            events = logged(store, r.headers["x-request-id"])
            if any("requeued" in e.get("reason", "") for e in events):
                break
        stack.procs["prefill-0"].send_signal(signal.SIGKILL)   # its drain would wait on the hung step forever
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected, r.text
    routed = [e for e in events if e["event"] == "routed"]
    assert [e["prefill"] for e in routed] == ["prefill-0", "prefill-1"], routed
    assert "requeued from prefill-0 (late)" in routed[1]["reason"], routed
    assert not [e for e in events if e["event"] == "prefill_local"], events
    assert took < 20, took   # the 30 s ceiling alone would take longer
    print(f"frozen prefill worker: request done in {took:.1f} s, on prefill-1")


def _greedy_40(loaded, messages) -> list[int]:
    """The in-process engine's 40 greedy tokens for a chat (EOS ignored)."""
    tok = loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages))
    return generate(loaded, {"q": prompt}, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))["q"]


def _stream_40(messages) -> dict:
    return {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 40, "ignore_eos": True,
            "stream": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def two_decode(tmp_path_factory):
    """1 prefill + 2 decode workers, for the tests that kill or stop a decode worker: each
    takes it with both decode workers up (`_both_decode_workers_up`). On the fake model, 50 ms a
    pass (a stream of 40 tokens lasts about 2 s, as on the real one): what is tested is the
    failover and the drain, the streams compared with the in-process fake engine's."""
    cfg = StackConfig.on_free_ports(prefill=1, decode=2, kv_blocks=512, log_dir=tmp_path_factory.mktemp("two-decode"),
                                    model=FAKE, env=fake_env(0.05, PD_HEARTBEAT_S="0.3", PD_FAILOVER_CHECK_S="0.3"))
    with Stack(cfg) as stack:
        yield stack


def _both_decode_workers_up(stack: Stack) -> Stack:
    """The decode worker a test before killed or stopped started again (as it was started),
    serving, registered, and seen by the routers."""
    gone = [name for name in ("decode-0", "decode-1") if stack.procs[name].poll() is not None]
    for name in gone:
        stack.restart(name)
    for name in gone:
        ready, deadline = stack.metrics_url(name, "/ready"), time.monotonic() + 120
        while not _answers_200(ready):
            assert time.monotonic() < deadline, f"{name} not ready again; logs in {stack.log_dir}"
            time.sleep(0.1)
    if gone:
        stack.wait_ready(60)
    return stack


def _answers_200(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_a_decode_worker_killed_mid_stream_is_continued_on_another(fake, two_decode):
    """kill -9 of the decode worker serving a stream after 8 tokens: the gateway sees its lease
    lapse, the request is placed again with those 8 tokens like a new request — the prefill
    worker computes prompt + 8 and hands its KV to the other decode worker, which continues.
    The client's stream equals the in-process engine's greedy output token for token (none
    repeated, none missing), its text is whole, and every pool is whole afterwards."""
    messages = [{"role": "user", "content": "List the planets of the solar system with one fact each."}]
    expected = _greedy_40(fake, messages)
    stack = _both_decode_workers_up(two_decode)
    ids, text, victim, killed, resumed_at = [], "", None, None, None
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        store = sync_redis(stack.redis_url)
        with http.stream("POST", "/v1/chat/completions", json=_stream_40(messages)) as r:
            rid = r.headers["x-request-id"]
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                ids += choice.get("token_ids") or []
                text += choice["delta"].get("content") or ""
                if killed and resumed_at is None and choice.get("token_ids"):
                    resumed_at = time.monotonic()
                if len(ids) >= 8 and victim is None:
                    victim = store.hget(request_key(rid), "decode").decode()
                    stack.procs[victim].send_signal(signal.SIGKILL)
                    killed = time.monotonic()
        survivor = ({"decode-0", "decode-1"} - {victim}).pop()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:   # the registry shows the pools within a heartbeat or two
            info, prefill = (json.loads(store.get(worker_key(w))) for w in (survivor, "prefill-0"))
            if info["free_blocks"] == info["total_blocks"] and prefill["free_blocks"] == prefill["total_blocks"]:
                break
            time.sleep(0.1)
        events = [json.loads(e) for e in store.lrange(log_key(rid), 0, -1)]
    resumed = [e for e in events if e["event"] == "routed" and e["attempt"] == 1]
    assert resumed and resumed[0]["mode"] == "remote" and resumed[0]["prefill"] == "prefill-0", events
    assert not [e for e in events if e["event"] == "prefill_local"], events  # no recompute on a decode worker
    assert prefill["free_blocks"] == prefill["total_blocks"], prefill
    assert ids == expected, (len(ids), len(expected))
    assert text == fake.tokenizer.decode(expected)
    assert info["free_blocks"] == info["total_blocks"] and info["running"] == 0
    recovery_s = resumed_at - killed
    assert recovery_s < 10, recovery_s
    print(f"decode worker killed after 8 tokens: stream moving again {recovery_s:.1f} s later on {survivor}")


def test_sigterm_drains_a_decode_worker_its_streams_finish_there_new_ones_go_elsewhere(fake, two_decode):
    """SIGTERM to the decode worker serving a stream after 5 tokens: it stays registered as
    draining, takes no new request (the next one goes to the other worker), finishes the
    stream itself (no failover: no second placement), and exits once done, its pass record gone."""
    messages = [{"role": "user", "content": "Describe a lighthouse at night."}]
    expected = _greedy_40(fake, messages)
    stack = _both_decode_workers_up(two_decode)
    ids, victim, other = [], None, None
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        store = sync_redis(stack.redis_url)
        with http.stream("POST", "/v1/chat/completions", json=_stream_40(messages)) as r:
            rid = r.headers["x-request-id"]
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
                if len(ids) >= 5 and victim is None:
                    victim = store.hget(request_key(rid), "decode").decode()
                    stack.procs[victim].send_signal(signal.SIGTERM)
                    time.sleep(0.2)
                    draining = json.loads(store.get(worker_key(victim)))["draining"]
                    other = http.post("/v1/chat/completions", json={
                        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        exit_code = stack.procs[victim].wait(60)
        resumed = store.exists(route_key(f"{rid}#1"))
        recorded = store.exists(batch_key(victim))   # its last pass (pdserve/shared/quarantine.py)
        placed_other = store.hget(request_key(other.headers['x-request-id']), "decode").decode()
    assert draining is True
    assert ids == expected and not resumed
    assert other.status_code == 200 and placed_other != victim
    assert exit_code == 0 and not recorded   # drained in order: no crash to charge its requests
