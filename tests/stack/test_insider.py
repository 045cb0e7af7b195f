"""The insider suite: an attacker holds one service instance's own credentials (what a
compromised pod holds: its NATS user, its Redis user) on the live stack, 2 prefill + 2
decode workers. Each attack is refused, or does nothing to anyone else's request:

    forge a client's output         any worker publishes chunks on pd.tokens.<id>: unsigned,
                                    they never reach the client (pdserve/shared/macs.py)
    make the job stream store       STREAM.UPDATE with pd.tokens.> added: refused, the stream is
    every output                    the operator's (pdserve/shared/streams.py)
    read prompts not placed for     a decode worker subscribes to another's admits: refused
    steal another's jobs            a prefill worker pulls from another's consumer: refused
    fail another's handoff          a forged KVEnd / KVAck: dropped and counted
    terminate others' requests      a Cancel on every worker's cancel subject: dropped and counted;
                                    the supervisor's cancel subjects: refused (the routers' alone)
    write the worker registry       another's entry: refused (each instance's Redis user writes its
                                    own entry alone); its own, malformed or naming another
                                    worker: skipped and counted, and the fleet serves on

Request ids are the server's (uuid4): an attacker would have to learn one. These attacks are
given every id as it is routed (the operator's connection reads the router's subject for them),
so what refuses them is the MACs and the grants, not the ids' secrecy.

What a compromised instance can still do is in docs/ARCHITECTURE.md ("Security model").

On the fake model (tests/stack/conftest.py) at 50 ms a pass, so that a request lasts about as
long as on the real one (the attacks' window): what is tested is the grants and the MACs, each
answer compared with the same request's answer unattacked.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import nats
import nats.errors
import pytest
from conftest import FAKE, MODEL, fake_env
from nats.js.api import StreamConfig

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared import subjects
from pdserve.shared.messages import Cancel, KVAck, KVEnd, RouteRequest, TokenChunk, WorkerInfo
from pdserve.shared.state import State
from pdserve.shared.urls import nats_inbox

pytestmark = pytest.mark.slow
PROMPT = "Explain in one sentence why the sky is blue. " * 12   # a prefill long enough to attack its handoff
INSIDER = "insider"   # the attacker's connection name: its refusals in NATS's log are its own


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(StackConfig.on_free_ports(prefill=2, decode=2, kv_blocks=512, model=FAKE, env=fake_env(0.05),
                                        log_dir=tmp_path_factory.mktemp("insider-logs"))).start()
    yield s
    s.stop()
    refused = [line for line in s.refused() if INSIDER not in line]
    assert not refused, refused   # the services themselves were refused nothing


class Insider:
    """A connection with instance `name`'s own credentials; keeps the server's refusals."""

    def __init__(self, stack: Stack, name: str):
        self.url, self.refusals = stack.nats_url_of(name), []

    async def __aenter__(self) -> nats.NATS:
        async def on_error(e: Exception) -> None:
            self.refusals.append(str(e).lower())

        self.nc = await nats.connect(self.url, name=INSIDER, error_cb=on_error, inbox_prefix=nats_inbox(self.url),
                                     allow_reconnect=False)
        return self.nc

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()


def ask(stack: Stack, stream: bool = False, max_tokens: int = 12) -> httpx.Response:
    body = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": PROMPT}]}
    return httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=120)


def under_attack(stack: Stack, attack) -> httpx.Response:
    """A request asked while `attack(stop, rids)` runs in a thread of its own (its own event
    loop), `rids` the ids of the requests routed since it started, as they are; an attack that
    failed to run fails the test."""
    stop, failed = threading.Event(), []

    async def spied() -> None:
        rids: list[str] = []
        spy = await nats.connect(stack.nats_url)

        async def routed(msg) -> None:
            rids.append(RouteRequest.decode(msg.data).request_id)

        try:
            await spy.subscribe(subjects.ROUTE, cb=routed)
            await spy.flush()
            await attack(stop, rids)
        finally:
            await spy.close()

    def run() -> None:
        try:
            asyncio.run(spied())
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        time.sleep(0.3)   # (its connections up before the request)
        return ask(stack, stream=True)
    finally:
        stop.set()
        thread.join(30)
        assert not failed, failed


def fallbacks(stack: Stack, worker: str) -> float:
    """Prompts `worker` prefilled itself after a handoff failed (pd_decode_prefills{why="fallback"})."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(stack.metrics_url(worker), timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pd_decode_prefills_total" and s.labels.get("why") == "fallback")


def content(response: httpx.Response) -> str:
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


@pytest.mark.parametrize("insider", ["prefill-0", "decode-1"])
def test_no_worker_can_forge_or_end_a_clients_stream(stack, insider):
    """Chunks with the next seqs, `finished` with attacker text, on the request's subject as fast
    as the worker's credentials publish them: the client gets the model's answer, and the
    gateway counts the forgeries."""
    clean = content(ask(stack, stream=True))
    before = stack.metric_total("gateway", "pd_forged_chunks_total")

    async def forge(stop: threading.Event, rids: list[str]) -> None:
        async with Insider(stack, insider) as nc:
            while not stop.is_set():
                for rid, seq in ((rid, seq) for rid in list(rids) for seq in range(4)):
                    chunk = TokenChunk(request_id=rid, seq=seq, token_ids=[1], text=" PWNED", finished=seq == 3,
                                       finish_reason="stop", worker=insider)
                    await nc.publish(subjects.tokens(rid), chunk.encode())
                await asyncio.sleep(0.002)

    r = under_attack(stack, forge)
    assert r.status_code == 200 and "PWNED" not in r.text
    assert content(r) == clean
    assert stack.metric_total("gateway", "pd_forged_chunks_total") > before


def test_no_service_can_change_purge_or_delete_a_stream(stack):
    """The attack that made the job stream store every output (STREAM.UPDATE adding
    pd.tokens.>), and its variants, from each role: refused; the stream is as the operator made it."""
    async def scenario() -> tuple[list[str], list[str]]:
        failures = []
        for name in ("prefill-0", "decode-0", "router", "gateway"):
            async with Insider(stack, name) as nc:
                js = nc.jetstream(timeout=0.5)
                for attempt in (js.update_stream(StreamConfig(name=subjects.PREFILL_STREAM,
                                                              subjects=[subjects.PREFILL_JOBS, "pd.tokens.>"])),
                                js.purge_stream(subjects.PREFILL_STREAM), js.delete_stream(subjects.PREFILL_STREAM),
                                js.add_stream(StreamConfig(name="PD_OUTPUTS", subjects=["pd.tokens.>"]))):
                    try:
                        await attempt
                        failures.append(f"{name}: {attempt}")
                    except Exception:  # noqa: BLE001 - refused: a permissions violation, no answer
                        pass
        operator = await nats.connect(stack.nats_url)
        try:
            made = (await operator.jetstream().stream_info(subjects.PREFILL_STREAM)).config.subjects or []
            names = await operator.jetstream().streams_info()
        finally:
            await operator.close()
        return failures, [*made, *(s.config.name or "" for s in names)]

    failures, seen = asyncio.run(scenario())
    assert failures == []
    assert "pd.tokens.>" not in seen and "PD_OUTPUTS" not in seen and subjects.PREFILL_STREAM in seen


def test_a_worker_reads_no_prompt_and_takes_no_job_it_was_not_placed_for(stack):
    """decode-1 subscribes to decode-0's admits (and every decode worker's), prefill-1 pulls
    from prefill-0's consumer: refused, and nothing of the requests served meanwhile reaches them."""
    got: list[bytes] = []

    async def listen(stop: threading.Event, rids: list[str]) -> None:
        async with Insider(stack, "decode-1") as nc:
            async def keep(msg) -> None:
                got.append(msg.data)

            for subject in (subjects.decode_admit("decode-0"), "pd.decode.*.admit", subjects.decode_kv("decode-0"),
                            subjects.PREFILL_JOBS):
                await nc.subscribe(subject, cb=keep)
            while not stop.is_set():
                await asyncio.sleep(0.05)

    for _ in range(3):
        assert under_attack(stack, listen).status_code == 200
    assert got == []

    async def steal() -> list[str]:
        insider = Insider(stack, "prefill-1")
        async with insider as nc:
            try:
                pull = await nc.jetstream(timeout=2).pull_subscribe(subjects.prefill_jobs("prefill-0"),
                                                                    durable="prefill-0")
                await pull.fetch(1, timeout=1)
                return ["pulled"]
            except Exception:  # noqa: BLE001 - refused
                pass
            await nc.flush()
            await asyncio.sleep(0.2)
        return insider.refusals

    refusals = asyncio.run(steal())
    assert refusals and all("permissions violation" in r for r in refusals), refusals


def test_a_forged_handoff_message_fails_no_one_and_is_counted(stack):
    """While requests hand their KV over, prefill-1 publishes KVEnd(not ok) for them to both
    decode workers and decode-1 publishes KVAck(not ok) to both prefill workers: none falls
    back to a local prefill, the answers are the model's, and the forgeries are counted."""
    clean = content(ask(stack, stream=True))

    async def forge(stop: threading.Event, rids: list[str]) -> None:
        async with Insider(stack, "prefill-1") as p, Insider(stack, "decode-1") as d:
            while not stop.is_set():
                for rid in list(rids):
                    for w in ("decode-0", "decode-1"):
                        await p.publish(subjects.decode_kv_end(w), KVEnd(
                            request_id=rid, ok=False, error="forged", prefill_worker="prefill-0").encode())
                    for w in ("prefill-0", "prefill-1"):
                        await d.publish(subjects.prefill_kv_ack(w), KVAck(request_id=rid, ok=False,
                                                                          error="forged").encode())
                await asyncio.sleep(0.002)

    before = {w: fallbacks(stack, w) for w in ("decode-0", "decode-1")}
    forged = sum(stack.metric_total(w, "pd_forged_messages_total") for w in ("decode-0", "decode-1"))
    for _ in range(3):
        r = under_attack(stack, forge)
        assert r.status_code == 200 and content(r) == clean
    assert {w: fallbacks(stack, w) for w in before} == before   # no handoff failed over to a local prefill
    assert sum(stack.metric_total(w, "pd_forged_messages_total") for w in before) > forged


@pytest.mark.parametrize("insider", ["gateway", "prefill-1"])
def test_no_gateway_or_worker_can_cancel_a_request_it_does_not_hold(stack, insider):
    """A cancel of the request, on every worker's cancel subject, as fast as the credentials
    publish it (and on the supervisor's subjects: refused): the request ends with the model's
    answer and the workers count the forgeries."""
    clean = content(ask(stack, stream=True))
    workers = ("decode-0", "decode-1", "prefill-0", "prefill-1")
    forged = sum(stack.metric_total(w, "pd_forged_messages_total") for w in workers)

    async def cancel(stop: threading.Event, rids: list[str]) -> None:
        async with Insider(stack, insider) as nc:
            while not stop.is_set():
                for msg in [Cancel(request_id=rid).encode() for rid in rids]:
                    for w in ("decode-0", "decode-1"):
                        await nc.publish(subjects.decode_cancel(w), msg)
                        await nc.publish(subjects.decode_supervisor_cancel(w), msg)
                    for w in ("prefill-0", "prefill-1"):
                        if insider == "gateway":
                            await nc.publish(subjects.prefill_cancel(w), msg)
                await asyncio.sleep(0.002)

    r = under_attack(stack, cancel)
    assert r.status_code == 200 and content(r) == clean
    assert sum(stack.metric_total(w, "pd_forged_messages_total") for w in workers) > forged


def test_an_instance_writes_only_its_own_registry_entry_and_a_bad_one_takes_nothing_down(stack):
    """With decode-1's own Redis user: another's entry (decode-0's, a new one, a router's)
    written, renewed, deleted or heartbeated: refused, NOPERM. Its own entry, made malformed,
    `v: 2`, or naming decode-0 with every block free, over and over: the routers skip it (and
    count it), /ready stays up and requests are served (decode-1 alone is out meanwhile)."""
    entry = "pd:{registry}:worker:"

    async def write() -> list[str]:
        state, refused = State.connect(stack.redis_url_of("decode-1")), []
        try:
            for attempt in (lambda: state.registry._beat("decode-0", b"{}", 30),
                            lambda: state.registry.deregister("decode-0"),
                            lambda: state.registry._beat("decode-x", b"{}", 30),
                            lambda: state.registry.store.r.set(entry + "router", b"{}"),
                            lambda: state.registry.store.r.pexpire(entry + "decode-0", 1)):
                try:
                    refused.append(f"done: {await attempt()}")
                except Exception as e:  # noqa: BLE001 - refused: NOPERM
                    refused.append(str(e))
            own = [b"{not json", WorkerInfo(worker_id="decode-1", role="decode").encode().replace(b'"v":1', b'"v":2'),
                   WorkerInfo(worker_id="decode-0", role="decode", model=MODEL, total_blocks=10**9,
                              free_blocks=10**9).encode()]
            for _ in range(20):   # (faster than decode-1's own heartbeats put it right)
                for bad in own:
                    await state.registry._beat("decode-1", bad, 30)
                    await asyncio.sleep(0.03)
        finally:
            await state.close()
        return refused

    before = stack.metric_total("router", "pd_bad_registry_entries_total")
    refused = asyncio.run(write())
    assert len(refused) == 5 and all("permission" in r.lower() for r in refused), refused
    time.sleep(1.5)   # (a registry read or two)
    ready = httpx.get(stack.metrics_url("gateway", "/ready"), timeout=10)
    assert ready.status_code == 200
    assert ask(stack).status_code == 200
    assert stack.metric_total("router", "pd_bad_registry_entries_total") >= before + 3
