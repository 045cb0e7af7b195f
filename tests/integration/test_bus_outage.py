"""The bus is never fatal to a worker: a decode worker steps on while nats-server is down and
its client's buffer is full (each publish of a token chunk raises), keeps every chunk in its
chunk log, and once the server is back a gateway's replay gets them all."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import Callable

from opentelemetry import trace

from pdserve.local.servers import binary, ended, free_port, wait_for_port
from pdserve.services.decode.main import DecodeWorker
from pdserve.shared import bus as bus_module
from pdserve.shared import metrics, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.config import DecodeSettings
from pdserve.shared.kv import create_transport
from pdserve.shared.messages import AdmitRequest, Replay, ReplayReply, Sampling, TokenChunk
from pdserve.shared.state import State
from pdserve.shared.worker import build_engine

PENDING = 16 << 10   # a small buffer, full within the outage: ~60 chunks
SEQS, TOKENS = 8, 100


def nats_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([binary("nats-server"), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, proc=proc)
    return proc


async def until(ok: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def refused() -> float:
    return metrics.BUS_PUBLISH_ERRORS.labels("tokens")._value.get()


async def decode_through_an_outage(redis_url: str) -> None:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    server = nats_server(port)
    settings = DecodeSettings(model="fake:smollm2", nats_url=url, redis_url=redis_url, kv_blocks=256,
                              max_num_seqs=SEQS, metrics_port=0, fake_step_s=0.01, nats_pending_bytes=PENDING)
    engine = build_engine(settings)
    bus = await Bus.connect(url, "decode", pending_bytes=settings.nats_pending_bytes)
    gateway = await Bus.connect(url, "gateway")
    state = State.for_service(settings)
    worker = DecodeWorker(settings, engine, bus, state, create_transport("fake"), trace.get_tracer("test"))
    got: dict[str, dict[int, int]] = {f"r{i}": {} for i in range(SEQS)}   # what the gateway has: position -> token

    async def on_chunk(msg) -> None:
        chunk = TokenChunk.decode(msg.data)
        got[chunk.request_id].update(enumerate(chunk.token_ids, chunk.seq))
    try:
        await gateway.subscribe(subjects.tokens("*"), on_chunk)
        await bus.subscribe(subjects.decode_replay(worker.id), worker.on_replay)
        for rid in got:
            await worker.prefill_locally(AdmitRequest(
                request_id=rid, prompt_token_ids=list(range(5, 40)), mode="local", secret="5e" * 16,
                sampling=Sampling(max_tokens=TOKENS, temperature=0, ignore_eos=True)), "placed")
        stop = asyncio.Event()
        loop = asyncio.create_task(worker.host.run(worker.publish, stop))
        await until(lambda: all(got.values()))
        server.kill()   # NATS unreachable: the decode worker's publishes buffer, then raise
        server.wait()
        before = refused()
        await until(lambda: not engine.has_work() or loop.done())
        assert not loop.done(), loop.exception()   # the engine loop stepped on through the outage
        assert refused() > before   # the buffer filled: publishes raised, were counted
        assert len(got["r0"]) < TOKENS   # the gateway missed chunks
        for rid in got:   # ... which the chunk log has, every one
            kept = [TokenChunk.decode(s.data) for s in worker.chunks.since(rid, 0) or []]
            assert sum(len(c.token_ids) for c in kept) == TOKENS and kept[-1].finished, rid

        server = nats_server(port)
        await until(lambda: bus.nc.is_connected and gateway.nc.is_connected)
        for rid, have in got.items():   # a replay from the first position the gateway lacks
            missing = min(set(range(TOKENS)) - set(have), default=TOKENS)
            reply = await gateway.request(subjects.decode_replay(worker.id), Replay(request_id=rid, from_seq=missing),
                                          ReplayReply, timeout=5)
            assert reply.ok, reply
        await until(lambda: all(len(have) == TOKENS for have in got.values()))
        stop.set()
        await loop
    finally:
        worker.host.close()
        await gateway.close()
        await bus.close()
        await state.close()
        ended(server)


def test_a_decode_worker_steps_through_a_bus_outage_and_its_chunks_are_replayed(redis_url):
    asyncio.run(decode_through_an_outage(redis_url))


def test_publish_errors_are_counted_each_and_warned_once_a_period(caplog):
    """A closed connection: every tried publish returns False, is counted; one warning per period."""
    async def scenario() -> list[bool]:
        port = free_port()
        server = nats_server(port)
        try:
            now = [100.0]
            bus = await Bus.connect(f"nats://127.0.0.1:{port}", "worker")
            bus.clock = lambda: now[0]
            await bus.nc.close()
            chunk = TokenChunk(request_id="r", seq=0, token_ids=[1], text="")
            results = []
            for _ in range(5):
                results.append(await bus.tried("tokens", bus.publish(subjects.tokens("r"), chunk)))
            now[0] += bus_module.ERRORS_LOGGED_EVERY_S
            results.append(await bus.tried("tokens", bus.publish(subjects.tokens("r"), chunk)))
            return results
        finally:
            ended(server)

    before = refused()
    with caplog.at_level(logging.WARNING, logger="pdserve.shared.bus"):
        assert asyncio.run(scenario()) == [False] * 6
    assert refused() - before == 6
    warnings = [r for r in caplog.records if "not published" in r.getMessage()]
    assert len(warnings) == 2 and "5 publishes failed" in warnings[1].getMessage()
