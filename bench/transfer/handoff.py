"""The exposed part of a real KV handoff, streamed layer by layer as the services do it
(part of `make bench-transfer`): engine layer hook → KVSender → NATS notices + payloads
through the prefill side's shared-memory segment (the services' way on one host) or over UCX
(their way between hosts) → KVReceiver in another process, verified, written into its pool,
committed."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def nats_server(config: str = ""):
    """A nats-server of its own for the duration (`config`: lines of its configuration file)."""
    from pdserve.local.servers import binary, free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        conf = Path(d) / "nats.conf"
        conf.write_text(config)
        server = subprocess.Popen([binary("nats-server"), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port),
                                   "-sd", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            yield f"nats://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait()


def _engine():
    import torch

    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import Engine
    from pdserve.shared.engine.loader import load

    torch.set_num_threads(1)  # as `make run` gives each of two workers on this host
    return Engine(load("smollm2"), EngineConfig(num_blocks=256, enable_prefix_cache=False))


def _decode_side(url, cmd_q, reply_q):
    """The decode worker's half of a handoff in its own process: reserve, then receive every
    layer as its notice arrives, verify its blocks, write them into the pool, commit."""
    from pdserve.shared import subjects
    from pdserve.shared.bus import Bus
    from pdserve.shared.kv import TAG_SPAN, create_transport
    from pdserve.shared.kv.receiver import KVInbox, KVReceiver
    from pdserve.shared.kv.same_host import SameHost
    from pdserve.shared.kv.segment import Segments
    from pdserve.shared.messages import KVAck

    engine = _engine()

    async def run():
        bus, transport = await Bus.connect(url, "bench-decode"), SameHost(create_transport("ucx"), segments=Segments())
        inbox = KVInbox(bus, "bench-d")
        await inbox.start()
        await bus.nc.flush()
        reply_q.put((transport.address, engine.fingerprint, transport.host))
        loop = asyncio.get_running_loop()
        while (cmd := await loop.run_in_executor(None, cmd_q.get)) is not None:
            rid, prompt = cmd
            res = engine.reserve(rid, prompt, _params())
            kv_tag = (len(inbox.receivers) + 1) * TAG_SPAN
            inbox.add(KVReceiver.for_engine(engine, res, kv_tag, transport, bus, "bench-p", secret=SECRET))
            cpu0, wall0 = time.process_time(), time.time()
            reply_q.put((res.first_block, kv_tag))
            first = await asyncio.wait_for(inbox.receivers[rid].wait(), 120)
            engine.commit_import(rid, first)
            landed = time.time()
            # CPU of this whole process (event loop, ucxx threads) while it waited for and took the KV
            cpu = (time.process_time() - cpu0) / (landed - wall0)
            await bus.publish(subjects.prefill_kv_ack("bench-p"), KVAck(request_id=rid, ok=True, kv_tag=kv_tag),
                              secret=SECRET)
            engine.abort(rid)
            reply_q.put((landed, cpu))
        await bus.close()
    asyncio.run(run())


def _params():
    from pdserve.shared.engine.sequence import SamplingParams

    return SamplingParams(max_tokens=2, temperature=0)


SECRET = "be" * 16  # the placement's secret both sides are told (pdserve/shared/macs.py)
ROUNDS = 9  # the rounds' spread here is about +-0.1 of the prefill: the median of 5 moved by 0.05 from run to run


def exposed_fraction(tokens: int = 1024, same_host: bool = True, rounds: int = ROUNDS) -> dict:
    """A `tokens`-token prompt, prefilled alone vs prefilled while streaming its KV the services' way
    (engine layer hook → KVSender → NATS notices + payloads through the segment, or over UCX
    when not `same_host` → KVReceiver in another process, verified and written into its pool,
    committed), interleaved `rounds` times.
    exposed = (prefill start → KV committed on the decode side) − prefill alone, over prefill alone,
    per round (each streamed prefill against the one alone just before it: the machine's speed
    drifts by more than the transfer costs), median over the rounds."""
    from pdserve.shared.bus import Bus
    from pdserve.shared.engine_host import EngineHost
    from pdserve.shared.kv import create_transport
    from pdserve.shared.kv.same_host import SameHost
    from pdserve.shared.kv.segment import Segment
    from pdserve.shared.kv.sender import KVSender, SenderSettings, WorkerHooks
    from pdserve.shared.messages import PrefillJob, Sampling

    engine = _engine()
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 40000, tokens)]
    with nats_server() as url:
        ctx = mp.get_context("spawn")
        cmd_q, reply_q = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_decode_side, args=(url, cmd_q, reply_q))
        proc.start()
        address, fingerprint, decode_host = reply_q.get(timeout=120)

        def prefill(rid, ids, sink=None):
            engine.add_request(rid, ids, _params(), prefill_only=True)
            if sink is not None:
                engine.stream_kv(rid, 0, sink)
            while not (outs := engine.step()):
                pass
            return outs[0].new_token_ids[0]

        async def run():
            host = EngineHost(engine)
            bus = await Bus.connect(url, "bench-prefill")
            transport = SameHost(create_transport("ucx"), Segment(256 << 20, "bench-p") if same_host else None)
            sender = KVSender(SenderSettings("bench-p", engine.fingerprint), transport, bus,
                              WorkerHooks(lambda *a: host.call(engine.kv_blocks, *a)))
            await sender.start()
            loop = asyncio.get_running_loop()
            alone, streamed, after = [], [], []
            for i in range(rounds + 1):  # round 0 warms up both paths (short prompt)
                ids = prompt if i else prompt[:64]
                t0 = time.perf_counter()
                await host.call(prefill, f"alone-{i}", ids)
                alone_s = time.perf_counter() - t0
                await host.call(engine.free, f"alone-{i}")
                rid = f"kv-{i}"
                cmd_q.put((rid, ids))
                first_block, kv_tag = await loop.run_in_executor(None, reply_q.get, True, 60)
                job = PrefillJob(request_id=rid, prompt_token_ids=ids, sampling=Sampling(), decode_worker="bench-d",
                                 decode_address=address, decode_fingerprint=fingerprint, first_block=first_block,
                                 kv_tag=kv_tag, decode_host=decode_host, secret=SECRET)
                w0, t0 = time.time(), time.perf_counter()
                sink = await sender.open(job)
                first = await host.call(prefill, rid, ids, sink)
                done_prefill = time.time()
                finishing = asyncio.create_task(sender.finish(rid, first, 60))
                landed, cpu = await loop.run_in_executor(None, reply_q.get, True, 120)
                assert (await finishing).ok
                await host.call(engine.free, rid)
                if i:
                    alone.append(alone_s)
                    streamed.append(landed - w0)
                    after.append(landed - done_prefill)
                    cpus.append(cpu)
            cmd_q.put(None)
            await bus.close()
            host.close()
            return alone, streamed, after

        cpus: list[float] = []
        alone, streamed, after = asyncio.run(run())
        proc.join(30)
    per_round = [(s - a) / a for a, s in zip(alone, streamed)]
    return {"prefill_s": statistics.median(alone), "prefill_and_handoff_s": statistics.median(streamed),
            "kv_ready_after_prefill_s": statistics.median(after), "decode_side_cpu_cores": statistics.median(cpus),
            "path": "segment" if same_host else "ucx", "rounds": rounds,
            "layers": engine.model_config.num_layers, "prompt_tokens": tokens,
            "exposed_per_round": per_round, "exposed_transfer_fraction": statistics.median(per_round)}
