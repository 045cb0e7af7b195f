"""The stack on separate hosts: four network namespaces, each with its own address on one
switch (bench/netns.py, bridged) — NATS, Redis, the router and the gateway on one, the prefill
worker on a second, a decode worker on each of two more. Workers on other hosts share no memory
(UCX over TCP on their host's link, as between machines). Greedy answers equal the in-process
engine's and the KV crossed the decode hosts' links; then one decode host's link goes down
mid-stream, every stream completes on the other, and when the link comes back the returning
worker ends what it held. Needs root and `ip netns`; skipped with the reason otherwise. On the
fake model (tests/stack/conftest.py) at 100 ms a pass (a stream lasts seconds: long enough to cut a
link mid-stream): what is tested is the KV's path between hosts and the failover, the streams
compared with the in-process fake engine's."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import FAKE, MODEL, fake_env
from helpers import generate
from prometheus_client.parser import text_string_to_metric_families

from bench import netns
from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.state import log_key, request_key, worker_key
from pdserve.shared.urls import sync_redis

pytestmark = pytest.mark.slow
HOSTS = ["hub", "prefill", "decode-a", "decode-b"]
WORKERS = {"prefill-0": "prefill", "decode-0": "decode-a", "decode-1": "decode-b"}
TOKENS = 40
TOPICS = ["volcanoes", "the moon", "honey bees", "glaciers", "lighthouses", "the printing press"]


@pytest.fixture
def hosts():
    made = netns.bridged(HOSTS)
    try:
        links = made.__enter__()
    except netns.NoNetns as e:
        pytest.skip(f"no separate hosts here: {e}")
    try:
        yield links
    finally:
        made.__exit__(None, None, None)


def chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} in a few sentences."}]


def stream(http: httpx.Client, i: int, on_token=None) -> tuple[str, list[int]]:
    """One greedy streamed chat: its request id and token ids (`on_token(request_id, n)` after each frame)."""
    ids: list[int] = []
    with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": chat(i), "temperature": 0, "max_tokens": TOKENS, "ignore_eos": True,
            "stream": True, "return_token_ids": True}) as r:
        assert r.status_code == 200, r.read()
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                frame = json.loads(line[6:])
                assert "error" not in frame, frame
                ids += frame["choices"][0].get("token_ids") or []
                if on_token:
                    on_token(rid, len(ids))
    return rid, ids


def kv_bytes_sent(stack: Stack) -> dict[str, float]:
    text = httpx.get(stack.metrics_url("prefill-0"), timeout=10).text
    return {s.labels["transport"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "pd_kv_transfer_bytes" for s in f.samples if s.name.endswith("_total")}


def test_streams_cross_hosts_and_survive_a_decode_host_cut_off(fake, hosts, tmp_path):
    tok = fake.tokenizer
    prompts = {i: tok.encode(tok.apply_chat_template(chat(i))) for i in range(len(TOPICS))}
    expected = generate(fake, prompts, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    placed, apart = netns.placement(hosts, WORKERS)  # no shared memory between hosts
    cfg = StackConfig.on_free_ports(prefill=1, decode=2, kv_blocks=512, log_dir=tmp_path, hosts=placed,
                                    worker_env=apart, model=FAKE,
                                    env=fake_env(0.1, PD_HEARTBEAT_S="0.5", PD_FAILOVER_CHECK_S="0.5"))
    decode_links = [hosts["decode-a"], hosts["decode-b"]]
    with Stack(cfg) as stack, httpx.Client(base_url=stack.url, timeout=180) as http, \
            ThreadPoolExecutor(len(TOPICS)) as pool:
        store = sync_redis(stack.redis_url)
        rx_before = sum(netns.rx_bytes(link) for link in decode_links)
        first = dict(pool.map(lambda i: (i, stream(http, i)[1]), range(len(TOPICS))))
        rx_after = sum(netns.rx_bytes(link) for link in decode_links)
        sent = kv_bytes_sent(stack)

        # a decode host cut off mid-stream: every stream completes on the other one
        progress: dict[str, int] = {}
        streams = [pool.submit(stream, http, i, progress.__setitem__) for i in range(len(TOPICS))]
        deadline = time.monotonic() + 120
        while len(progress) < len(TOPICS) or min(progress.values()) < 4:
            assert time.monotonic() < deadline, progress
            time.sleep(0.05)
        held = {rid: store.hget(request_key(rid), "decode").decode() for rid in progress}
        victim = max(("decode-0", "decode-1"), key=list(held.values()).count)
        netns.set_link(hosts[WORKERS[victim]], up=False)
        cut_at = time.monotonic()
        second = [f.result(timeout=180) for f in streams]
        moved_s = time.monotonic() - cut_at
        netns.set_link(hosts[WORKERS[victim]], up=True)
        deadline = time.monotonic() + 60   # back on the network: it ends what it held
        while time.monotonic() < deadline:
            entry = store.get(worker_key(victim))
            info = json.loads(entry) if entry else {}
            if info and info["free_blocks"] == info["total_blocks"] and not info["running"] + info["waiting"]:
                break
            time.sleep(0.3)
        alive = {n: p.poll() for n, p in stack.procs.items()}
        events = {rid: [json.loads(e) for e in store.lrange(log_key(rid), 0, -1)] for rid, _ in second}

    assert first == {i: expected[i] for i in prompts}
    assert sent.get("segment", 0) == 0 and sent["ucx"] > 0, sent
    assert rx_after - rx_before >= sent["ucx"], (rx_after - rx_before, sent)   # the KV crossed the links
    assert [ids for _, ids in second] == [expected[i] for i in prompts]
    cut_off = [rid for rid, worker in held.items() if worker == victim]
    assert cut_off
    for rid in cut_off:   # moved to the other decode host
        placements = [e for e in events[rid] if e["event"] == "routed"]
        assert placements[-1]["decode"] != victim and placements[-1]["attempt"] > 0, events[rid]
    assert all(code is None for code in alive.values()), alive
    assert info and info["free_blocks"] == info["total_blocks"] and info["running"] == 0, info
    print(f"{len(cut_off)} streams moved off {victim}'s host; all done {moved_s:.1f} s after the cut")
