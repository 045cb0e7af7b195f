"""KV transfer paths side by side, between two processes, in one run: `make bench-transfer`.

    python -m bench.transfer_bench [--quick]

Payloads from 64 KiB to 256 MiB (`--quick`: to 16 MiB) plus the real per-layer KV sizes of 1k- and 4k-token SmolLM2
requests (fp32), each sent REPS times after a warm-up, timed until the receiver confirms it
holds the last byte:
  memcpy      numpy copy in one process (the limit)
  ucx_local   what the services use: ucxx, worker-address endpoint, no endpoint error
              handling, "thread" progress
  ucx_polling the same with "polling" progress: faster, but it spins a core in each process
              after the first transfer, so the services do not use it
  ucx_tcp     UCX_TLS=tcp,self with the services' TCP segment settings (the path to another host)
  socket      a plain TCP socket on loopback, sendall / recv_into
  nats        the naive baseline: the payload as 1 MiB NATS messages through nats-server
Then `exposed_transfer_fraction_1k`: a 1k-token prompt prefilled alone vs prefilled while its
KV streams layer by layer to another process exactly as the services do it (see
`exposed_fraction_1k`). Prints a table, writes bench/results/transfer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

KIB, MIB = 1 << 10, 1 << 20
LAYER_1K = 64 * 2 * 16 * 3 * 64 * 4    # 64 blocks x (K,V) x 16 tokens x 3 heads x 64 dims x fp32
LAYER_4K = 4 * LAYER_1K
NATS_CHUNK = 1 * MIB
RESULTS = Path(__file__).parent / "results" / "transfer.json"


def reps_for(size: int) -> int:
    return max(3, min(200, (512 * MIB) // size))


# -- receivers (child processes) -------------------------------------------------------------
def _ucx_receiver(sizes, addr_q, done_q, env, window, progress):
    os.environ.update(env)
    import ucxx

    async def run():
        ucxx.init(progress_mode=progress)
        addr_q.put(bytes(ucxx.get_worker_address()))
        tag = 0
        for size in sizes:
            bufs = [np.empty(size, dtype=np.uint8) for _ in range(window)]
            await ucxx.recv(bufs[0], tag=(tag := tag + 1))  # warm-up
            for first in range(0, reps_for(size), window):
                n = min(window, reps_for(size) - first)
                await asyncio.gather(*(ucxx.recv(bufs[i], tag=tag + 1 + i) for i in range(n)))
                tag += n
            done_q.put(size)
    asyncio.run(run())


def _socket_receiver(sizes, port_q, done_q):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            for size in sizes:
                buf = memoryview(np.empty(size, dtype=np.uint8))
                for _ in range(reps_for(size) + 1):
                    got = 0
                    while got < size:
                        got += conn.recv_into(buf[got:], size - got)
                done_q.put(size)


def _nats_receiver(sizes, url, ready_q, done_q):
    import nats

    async def run():
        nc = await nats.connect(url)
        state = {"size_i": 0, "got": 0, "reps": 0}
        buf = np.empty(max(sizes), dtype=np.uint8)
        finished = asyncio.Event()

        async def on_msg(msg):
            size = sizes[state["size_i"]]
            n = len(msg.data)
            buf[state["got"]:state["got"] + n] = np.frombuffer(msg.data, dtype=np.uint8)
            state["got"] += n
            if state["got"] >= size:
                state["got"] = 0
                state["reps"] += 1
                if state["reps"] == reps_for(size) + 1:
                    done_q.put(size)
                    state["reps"] = 0
                    state["size_i"] += 1
                    if state["size_i"] == len(sizes):
                        finished.set()

        await nc.subscribe("bench.kv", cb=on_msg)
        await nc.flush()
        ready_q.put(True)
        await finished.wait()
        await nc.close()
    asyncio.run(run())


# -- senders ----------------------------------------------------------------------------------
def _timed(send_one, size: int, done_q) -> float:
    """GB/s: one warm-up send, then REPS sends timed until the receiver confirms."""
    send_one(0)
    start = time.perf_counter()
    for i in range(reps_for(size)):
        send_one(i + 1)
    assert done_q.get(timeout=600) == size
    return size * reps_for(size) / (time.perf_counter() - start) / 1e9


def bench_memcpy(sizes):
    out = {}
    for size in sizes:
        a, b = np.ones(size, dtype=np.uint8), np.empty(size, dtype=np.uint8)
        np.copyto(b, a)
        start = time.perf_counter()
        for _ in range(reps_for(size)):
            np.copyto(b, a)
        out[size] = size * reps_for(size) / (time.perf_counter() - start) / 1e9
    return out


def bench_ucx(sizes, env: dict[str, str], window: int = 1, progress: str = "thread"):
    """Sender and receiver each in a fresh process, so UCX_TLS applies to both; `window`
    messages in flight at a time; ucxx `progress` mode ("thread": the services' default)."""
    ctx = mp.get_context("spawn")
    addr_q, done_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_ucx_receiver, args=(sizes, addr_q, done_q, env, window, progress)),
             ctx.Process(target=_ucx_sender, args=(sizes, addr_q, done_q, result_q, env, window, progress))]
    for p in procs:
        p.start()
    out = result_q.get(timeout=900)
    for p in procs:
        p.join(30)
    return out


async def _ucx_send(sizes, address, done_q, window, progress):
    import ucxx

    ucxx.init(progress_mode=progress)
    ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(address),
                                                        endpoint_error_handling=False)
    out, tag = {}, 0
    loop = asyncio.get_running_loop()
    for size in sizes:
        buf = np.ones(size, dtype=np.uint8)
        tag += 1
        await ep.send(buf, tag=tag, force_tag=True)  # warm-up
        start = time.perf_counter()
        for first in range(0, reps_for(size), window):
            n = min(window, reps_for(size) - first)
            await asyncio.gather(*(ep.send(buf, tag=tag + 1 + i, force_tag=True) for i in range(n)))
            tag += n
        assert await loop.run_in_executor(None, done_q.get, True, 600) == size
        out[size] = size * reps_for(size) / (time.perf_counter() - start) / 1e9
    await ep.close()
    return out


def _ucx_sender(sizes, addr_q, done_q, result_q, env, window, progress):
    os.environ.update(env)
    result_q.put(asyncio.run(_ucx_send(sizes, addr_q.get(timeout=60), done_q, window, progress)))


def bench_socket(sizes):
    ctx = mp.get_context("spawn")
    port_q, done_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_socket_receiver, args=(sizes, port_q, done_q))
    proc.start()
    out = {}
    with socket.create_connection(("127.0.0.1", port_q.get(timeout=60))) as s:
        for size in sizes:
            buf = np.ones(size, dtype=np.uint8)
            out[size] = _timed(lambda _i: s.sendall(buf), size, done_q)
    proc.join(30)
    return out


def bench_nats(sizes):
    with _nats_server() as url:
        ctx = mp.get_context("spawn")
        ready_q, done_q = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_nats_receiver, args=(sizes, url, ready_q, done_q))
        proc.start()
        ready_q.get(timeout=60)
        out = asyncio.run(_nats_send(sizes, url, done_q))
        proc.join(30)
        return out


async def _nats_send(sizes, url, done_q):
    import nats

    nc = await nats.connect(url, pending_size=64 * MIB)
    loop = asyncio.get_running_loop()
    out = {}
    for size in sizes:
        payload = np.ones(size, dtype=np.uint8).tobytes()

        async def send_one():
            for off in range(0, size, NATS_CHUNK):
                await nc.publish("bench.kv", payload[off:off + NATS_CHUNK])
            await nc.flush()

        await send_one()
        start = time.perf_counter()
        for _ in range(reps_for(size)):
            await send_one()
        assert await loop.run_in_executor(None, done_q.get, True, 600) == size
        out[size] = size * reps_for(size) / (time.perf_counter() - start) / 1e9
    await nc.close()
    return out


# -- the exposed part of a real handoff ------------------------------------------------------
@contextlib.contextmanager
def _nats_server():
    from deploy.local.stack import _binary, free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        server = subprocess.Popen([_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), "-sd", d],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            yield f"nats://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait()


def _engine():
    import torch

    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.engine.loader import load

    torch.set_num_threads(1)  # as `make run` gives each of two workers on this host
    return Engine(load("smollm2"), EngineConfig(num_blocks=256, enable_prefix_cache=False))


def _decode_side(url, cmd_q, reply_q):
    """The decode worker's half of a handoff in its own process: reserve, then receive every
    layer as its notice arrives, verify its blocks, write them into the pool, commit."""
    from shared import subjects
    from shared.bus import Bus
    from shared.kv import TAG_SPAN, make
    from shared.kv.receiver import KVInbox, KVReceiver
    from shared.messages import KVAck

    engine = _engine()

    async def run():
        bus, transport = await Bus.connect(url, "bench-decode"), make("ucx")
        inbox = KVInbox(bus, "bench-d")
        await inbox.start()
        await bus.nc.flush()
        reply_q.put((transport.address, engine.fingerprint))
        loop = asyncio.get_running_loop()
        while (cmd := await loop.run_in_executor(None, cmd_q.get)) is not None:
            rid, prompt = cmd
            res = engine.reserve(rid, prompt, _params())
            kv_tag = (len(inbox.receivers) + 1) * TAG_SPAN
            inbox.add(KVReceiver.for_engine(engine, res, kv_tag, transport, bus))
            cpu0, wall0 = time.process_time(), time.time()
            reply_q.put((res.first_block, kv_tag))
            first = await asyncio.wait_for(inbox.receivers[rid].wait(), 120)
            engine.commit_import(rid, first)
            landed = time.time()
            # CPU of this whole process (event loop, ucxx threads) while it waited for and took the KV
            cpu = (time.process_time() - cpu0) / (landed - wall0)
            await bus.publish(subjects.kv_ack(rid), KVAck(request_id=rid, ok=True))
            engine.abort(rid)
            reply_q.put((landed, cpu))
        await bus.close()
    asyncio.run(run())


def _params():
    from shared.engine.sequence import SamplingParams

    return SamplingParams(max_tokens=2, temperature=0)


def exposed_fraction_1k(rounds: int = 3) -> dict:
    """A 1k-token prompt, prefilled alone vs prefilled while streaming its KV the services' way
    (engine layer hook → KVSender → NATS notices + UCX payloads → KVReceiver in another
    process, verified and written into its pool, committed), interleaved `rounds` times.
    exposed = (prefill start → KV committed on the decode side) − prefill alone, over prefill alone."""
    from shared.engine_host import EngineHost
    from shared.bus import Bus
    from shared.kv import make
    from shared.kv.sender import KVSender
    from shared.messages import PrefillJob, Sampling

    engine = _engine()
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 40000, 1024)]
    with _nats_server() as url:
        ctx = mp.get_context("spawn")
        cmd_q, reply_q = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_decode_side, args=(url, cmd_q, reply_q))
        proc.start()
        address, fingerprint = reply_q.get(timeout=120)

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
            sender = KVSender(make("ucx"), bus, engine.fingerprint,
                              lambda *a: host.call(engine.kv_blocks, *a))
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
                                 kv_tag=kv_tag)
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
    prefill_s, handoff_s = statistics.median(alone), statistics.median(streamed)
    return {"prefill_s": prefill_s, "prefill_and_handoff_s": handoff_s, "kv_ready_after_prefill_s":
            statistics.median(after), "decode_side_cpu_cores": statistics.median(cpus), "rounds": rounds,
            "layers": engine.model_config.num_layers,
            "exposed_transfer_fraction_1k": (handoff_s - prefill_s) / prefill_s}


# -- the quality cost of int8 KV on the wire ------------------------------------------------
def int8_quality(new_tokens: int = 32) -> dict:
    """Each held conversation handed off twice — KV as it is, and through the int8 codec — then
    decoded greedily on the receiving engine: token agreement, and the largest logit difference
    over the steps where both runs had seen the same tokens."""
    from bench.held_prompts import CONVERSATIONS
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.engine.loader import load
    from shared.engine.sequence import SamplingParams
    from shared.kv import codec

    loaded = load("smollm2")
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    per_prompt = {}
    for name, messages in CONVERSATIONS.items():
        prompt = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(messages))
        runs = {}
        for encoding in ("native", "int8"):
            src, dst = (Engine(loaded, EngineConfig(num_blocks=256)) for _ in range(2))
            res = dst.reserve("r", prompt, params)
            src.add_request("r", prompt, params, prefill_only=True)
            while not (outs := src.step()):
                pass
            export = src.export_kv("r", res.first_block)
            pool = dst.runner.kv
            for layer in range(export.num_layers):
                rows = codec.encode(encoding, export.layer(layer))
                dst.write_kv(layer, list(res.block_ids), codec.decode(encoding, rows, tuple(pool.shape[2:]), pool.dtype))
            logits, run = [], dst.runner.run
            dst.runner.run = lambda sched, hook=None: logits.append(run(sched, hook)) or logits[-1]  # noqa: E731
            out = dst.commit_import("r", outs[0].new_token_ids[0])
            toks = list(out.new_token_ids)
            while dst.has_work():
                toks += [t for o in dst.step() for t in o.new_token_ids]
            runs[encoding] = (toks, [x[0] for x in logits])
        (t0, l0), (t1, l1) = runs["native"], runs["int8"]
        same = next((i for i, (a, b) in enumerate(zip(t0, t1)) if a != b), len(t0))
        # logits of step i come from tokens[:i+1]: comparable while those agree
        diffs = [float((a - b).abs().max()) for a, b in zip(l0[:same], l1[:same])]
        per_prompt[name] = {"prompt_tokens": len(prompt), "agreement": sum(a == b for a, b in zip(t0, t1)) / len(t0),
                            "first_difference": same if same < len(t0) else None,
                            "max_logit_diff": max(diffs), "max_abs_logit": float(max(x.abs().max() for x in l0))}
    shape, dtype = tuple(pool.shape[2:]), pool.dtype
    return {"per_prompt": per_prompt,
            "int8_greedy_token_agreement": statistics.mean(r["agreement"] for r in per_prompt.values()),
            "int8_max_logit_diff": max(r["max_logit_diff"] for r in per_prompt.values()),
            "int8_bytes_over_native": codec.block_nbytes("int8", shape, dtype) / codec.block_nbytes("native", shape, dtype)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="up to 16 MiB only")
    args = ap.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    sizes = [64 * KIB, 256 * KIB, MIB, LAYER_1K, 4 * MIB, LAYER_4K, 16 * MIB, 64 * MIB, 256 * MIB]
    if args.quick:
        sizes = [s for s in sizes if s <= 16 * MIB]
    from shared.kv.ucx import TCP_DEFAULTS

    results = {"memcpy": bench_memcpy(sizes), "ucx_local": bench_ucx(sizes, {}),
               "ucx_polling": bench_ucx(sizes, {}, progress="polling"),
               "ucx_tcp": bench_ucx(sizes, {"UCX_TLS": "tcp,self", **TCP_DEFAULTS}), "socket": bench_socket(sizes),
               "nats": bench_nats(sizes)}
    exposed = exposed_fraction_1k()
    int8 = int8_quality()

    big = [s for s in sizes if s >= MIB]
    # memory speed: memcpy of payloads past the caches (a 4 MiB copy repeated runs from cache)
    memcpy = statistics.median(results["memcpy"][s] for s in sizes if s >= 16 * MIB)
    ratio = lambda name: statistics.median(results[name][s] for s in big) / memcpy  # noqa: E731
    summary = {"memcpy_gbps": memcpy,
               "ucx_local_gbps_1mib_plus": min(results["ucx_local"][s] for s in big),
               "ucx_local_over_memcpy": ratio("ucx_local"), "ucx_polling_over_memcpy": ratio("ucx_polling"),
               "ucx_tcp_over_memcpy": ratio("ucx_tcp"),
               "socket_over_memcpy": ratio("socket"), "nats_over_memcpy": ratio("nats"),
               "exposed_transfer_fraction_1k": exposed["exposed_transfer_fraction_1k"],
               **{k: v for k, v in int8.items() if k.startswith("int8_")}}

    label = lambda s: {LAYER_1K: "1k-tok layer", LAYER_4K: "4k-tok layer"}.get(s, f"{s // KIB} KiB")  # noqa: E731
    print(f"\nGB/s, two processes on one host ({os.cpu_count()} cores); ratios: median over payloads >= 1 MiB "
          "against memcpy of payloads >= 16 MiB")
    print(f"{'payload':>14} " + " ".join(f"{m:>10}" for m in results))
    for s in sizes:
        print(f"{label(s):>14} " + " ".join(f"{results[m][s]:10.2f}" for m in results))
    print(f"\nhandoff of a 1k-token prompt streamed layer by layer (median of {exposed['rounds']}): prefill alone "
          f"{exposed['prefill_s'] * 1e3:.0f} ms; prefill + handoff until the decode side committed the verified KV "
          f"{exposed['prefill_and_handoff_s'] * 1e3:.0f} ms; KV ready {exposed['kv_ready_after_prefill_s'] * 1e3:.1f} ms "
          f"after the prefill's last pass; decode process busy {exposed['decode_side_cpu_cores']:.2f} cores meanwhile "
          "(receives are posted only for payloads on their way)")
    print(f"int8 KV on the wire ({len(int8['per_prompt'])} held conversations, 32 greedy tokens each): " +
          ", ".join(f"{n} {r['agreement']:.2f} (max logit diff {r['max_logit_diff']:.3f})"
                    for n, r in int8["per_prompt"].items()))
    for k, v in summary.items():
        print(f"{k:32} {v:8.3f}")
    print("targets: ucx_local_over_memcpy >= 0.8, ucx_tcp_over_memcpy >= 0.25, exposed_transfer_fraction_1k <= 0.05")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"summary": summary, "gbps": {m: {str(s): v for s, v in r.items()}
                                                                  for m, r in results.items()},
                                   "handoff_1k": exposed, "int8_quality": int8}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
