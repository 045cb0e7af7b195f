"""The KV handoff through the real services (NATS notices; payloads over UCX, or through the
prefill worker's shared-memory segment as the services do on one host): integrity under
injected corruption, a restarted decode peer, cancel mid-transfer, and a session's second turn. On
the fake model (tests/stack/conftest.py): its KV has SmolLM2's shape and is read back by the next
pass, so a lost or wrong block changes the tokens, compared with the in-process fake engine's."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis
from conftest import FAKE, MODEL, fake_env
from helpers import generate

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.state import worker_key

pytestmark = pytest.mark.slow
LAYERS, BLOCK_NBYTES = 30, 2 * 16 * 3 * 64 * 4       # SmolLM2, fp32 KV, 16-token blocks
DOC = " ".join(f"Item {i}: the {c} box holds {i * 7} marbles." for i, c in
               enumerate(["red", "blue", "green", "white", "black", "brown"] * 6))
QUESTION = [{"role": "user", "content": DOC + "\nWhich box holds 35 marbles?"}]


def _stack(tmp_path, otlp, **env) -> Stack:
    """Every prompt through the handoff (PD_PLACEMENT=remote: with cheapest, a repeated prompt or a
    follow-up turn the decode worker holds would be prefilled there)."""
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url, PD_PREFILL_CHUNK="128",
                                                 PD_HEARTBEAT_S="0.3", PD_PLACEMENT="remote", **env))
    return Stack(cfg)


def _ask(stack: Stack, messages, max_tokens=8) -> httpx.Response:
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r


def _spans(otlp, response: httpx.Response) -> dict:
    return otlp.attributes(response.headers["x-trace-id"], {"kv.transfer", "kv.receive"})


def _expected(loaded, messages, max_tokens=8) -> list[int]:
    tok = loaded.tokenizer
    return generate(loaded, {"q": tok.encode(tok.apply_chat_template(messages))},
                    SamplingParams(max_tokens=max_tokens, temperature=0))["q"]


def _workers(stack: Stack) -> list[dict]:
    store = redis.Redis.from_url(stack.redis_url)
    infos = [json.loads(store.get(k) or "{}") for k in store.keys(worker_key("*"))]
    return [w for w in infos if w.get("role") in ("prefill", "decode")]


def _wait_all_blocks_free(stack: Stack, timeout_s: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = _workers(stack)
        if len(workers) == 2 and all(w["free_blocks"] == w["total_blocks"] for w in workers):
            break
        time.sleep(0.2)
    return workers


@pytest.fixture(scope="module")
def plain(otlp, tmp_path_factory):
    """KV over UCX (as between hosts): no same-host segments."""
    with _stack(tmp_path_factory.mktemp("transfer-plain"), otlp, PD_KV_SEGMENT_BYTES="0") as s:
        yield s


def test_a_second_turn_sends_only_its_new_blocks(plain, otlp, fake):
    turn1 = _ask(plain, QUESTION)
    answer = turn1.json()["choices"][0]["message"]["content"]
    turn2_msgs = QUESTION + [{"role": "assistant", "content": answer},
                             {"role": "user", "content": "And which box holds 70 marbles?"}]
    turn2 = _ask(plain, turn2_msgs)
    assert turn2.json()["choices"][0]["token_ids"] == _expected(fake, turn2_msgs)
    t1, t2 = _spans(otlp, turn1)["kv.transfer"], _spans(otlp, turn2)["kv.transfer"]
    blocks1 = -(-turn1.json()["usage"]["prompt_tokens"] // 16)
    blocks2 = -(-turn2.json()["usage"]["prompt_tokens"] // 16)
    assert t1["skipped_blocks"] == 0 and t1["bytes"] == blocks1 * LAYERS * BLOCK_NBYTES
    assert t1["transport"] == "ucx" and t1["segment_bytes"] == 0
    assert t2["skipped_blocks"] >= blocks1 - 1                # the first turn's prompt is on the decode side
    assert t2["bytes"] == (blocks2 - t2["skipped_blocks"]) * LAYERS * BLOCK_NBYTES
    assert t2["bytes"] < blocks2 * LAYERS * BLOCK_NBYTES / 3


def test_a_restarted_decode_peer_is_reached_through_a_new_endpoint(plain, otlp, fake):
    messages = [{"role": "user", "content": "Name a planet."}]
    expected = _expected(fake, messages)
    _ask(plain, messages)
    before = _spans(otlp, _ask(plain, messages))["kv.transfer"]
    assert before["new_endpoint"] is False and before["acked"] is True   # the endpoint from the request before
    old = next(w["ucx_address"] for w in _workers(plain) if w["role"] == "decode")
    proc = plain.procs["decode-0"]
    proc.terminate()
    proc.wait(30)
    plain.service("decode-0", "pdserve.services.decode.main")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = [w["ucx_address"] for w in _workers(plain) if w["role"] == "decode"]
        if new and new[0] != old:
            break
        time.sleep(0.3)
    assert new and new[0] != old
    r = _ask(plain, messages)
    after = _spans(otlp, r)
    assert r.json()["choices"][0]["token_ids"] == expected
    assert after["kv.transfer"]["new_endpoint"] is True and after["kv.transfer"]["acked"] is True
    assert after["kv.receive"]["ok"] is True                  # the KV came over, no local fallback


@pytest.fixture(scope="module")
def faulty(otlp, tmp_path_factory):
    """Every first send of a payload has one byte flipped, and every send is held 1.5 s; the
    payloads go through the prefill worker's segment (the default on one host)."""
    with _stack(tmp_path_factory.mktemp("transfer-faulty"), otlp, PD_KV_FAULT_CORRUPT_RATE="1",
                PD_KV_FAULT_CORRUPT_SENDS="1", PD_KV_FAULT_DELAY_S="1.5") as s:
        yield s


def test_every_corrupted_payload_is_caught_and_resent_and_the_output_is_unchanged(faulty, otlp, fake):
    r = _ask(faulty, QUESTION)
    assert r.json()["choices"][0]["token_ids"] == _expected(fake, QUESTION)
    spans = _spans(otlp, r)
    sent, got = spans["kv.transfer"], spans["kv.receive"]
    blocks = -(-r.json()["usage"]["prompt_tokens"] // 16)
    passes = -(-r.json()["usage"]["prompt_tokens"] // 128)
    assert got["ok"] is True and sent["acked"] is True
    # a pass's 30 layers (8 blocks each) go in one message (PD_KV_PIECE_BYTES): one per pass
    assert got["pieces"] == sent["pieces"] == 2 * passes               # each first send, and its re-send
    assert got["bad_blocks"] == got["resends"] == passes               # one flipped byte per first send
    assert sent["resent_blocks"] == passes                             # only the bad block (of one layer) goes again
    transfer = next(s for s in otlp.trace(r.headers["x-trace-id"]) if s.name == "kv.transfer")
    resends = [attrs for name, attrs in transfer.events if name == "resend"]
    assert len(resends) == passes and {a["blocks"] for a in resends} == {1}   # a span event per re-send
    assert got["bytes"] == sent["bytes"] == sent["segment_bytes"] == (blocks * LAYERS + passes) * BLOCK_NBYTES
    assert sent["transport"] == "segment"


def test_a_cancel_during_transfer_frees_both_sides(faulty, otlp):
    baseline = _wait_all_blocks_free(faulty)
    assert len(baseline) == 2
    with httpx.stream("POST", faulty.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": QUESTION, "max_tokens": 64, "stream": True}) as r:
        trace_id = r.headers["x-trace-id"]
        for line in r.iter_lines():
            if line.startswith("data: {") and any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                break   # the first token is out; its payloads are still held by the injected delay
    workers = _wait_all_blocks_free(faulty)
    assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
    transfer = otlp.attributes(trace_id, {"kv.transfer"})["kv.transfer"]
    assert transfer["acked"] is False and "cancel" in transfer["error"]
