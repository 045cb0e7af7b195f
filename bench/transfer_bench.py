"""KV transfer paths side by side, between two processes, in one run: `make bench-transfer`.

    python -m bench.transfer_bench [--quick]

Payloads from 64 KiB to 256 MiB (`--quick`: to 16 MiB) plus the real per-layer KV sizes of 1k- and 4k-token SmolLM2
requests (fp32), each sent REPS times after a warm-up, timed until the receiver confirms it
holds the last byte:
  memcpy      numpy copy in one process (the limit)
  ucx_peer    what the services use: ucxx, worker-address endpoint with UCX peer-failure
              handling (so TCP, not shared memory, on one host), "thread" progress, the
              services' TCP segment settings
  ucx_local   the same without endpoint error handling (PD_UCX_ERROR_HANDLING=false): shared
              memory on one host, but a sender killed mid-transfer can crash the receiver
  ucx_polling the same with "polling" progress: faster, but it spins a core in each process
              after the first transfer, so the services do not use it
  ucx_tcp     UCX_TLS=tcp,self with the services' TCP segment settings (the path to another host)
  socket      a plain TCP socket on loopback, sendall / recv_into
  nats        the naive baseline: the payload as 1 MiB NATS messages through nats-server
Then `exposed_transfer_fraction_1k`: a 1k-token prompt prefilled alone vs prefilled while its
KV streams layer by layer to another process exactly as the services do it (see
bench/handoff_bench.py), and the quality cost of optional int8 KV (bench/kv_int8_quality.py).
Prints a table, writes bench/results/transfer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
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


def bench_ucx(sizes, env: dict[str, str], window: int = 1, progress: str = "thread", error_handling: bool = False):
    """Sender and receiver each in a fresh process, so UCX_TLS applies to both; `window`
    messages in flight at a time; ucxx `progress` mode ("thread": the services' default)."""
    ctx = mp.get_context("spawn")
    addr_q, done_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_ucx_receiver, args=(sizes, addr_q, done_q, env, window, progress)),
             ctx.Process(target=_ucx_sender, args=(sizes, addr_q, done_q, result_q, env, window, progress,
                                                   error_handling))]
    for p in procs:
        p.start()
    out = result_q.get(timeout=900)
    for p in procs:
        p.join(30)
    return out


async def _ucx_send(sizes, address, done_q, window, progress, error_handling):
    import ucxx

    ucxx.init(progress_mode=progress)
    ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(address),
                                                        endpoint_error_handling=error_handling)
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


def _ucx_sender(sizes, addr_q, done_q, result_q, env, window, progress, error_handling):
    os.environ.update(env)
    result_q.put(asyncio.run(_ucx_send(sizes, addr_q.get(timeout=60), done_q, window, progress, error_handling)))


def bench_socket(sizes):
    ctx = mp.get_context("spawn")
    port_q, done_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_socket_receiver, args=(sizes, port_q, done_q))
    proc.start()
    out = {}
    with socket.create_connection(("127.0.0.1", port_q.get(timeout=60))) as s:
        for size in sizes:
            buf = np.ones(size, dtype=np.uint8)
            out[size] = _timed(lambda _i, buf=buf: s.sendall(buf), size, done_q)
    proc.join(30)
    return out


def bench_nats(sizes):
    from bench.handoff_bench import nats_server

    with nats_server() as url:
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

        async def send_one(size=size, payload=payload):
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="up to 16 MiB only")
    args = ap.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    sizes = [64 * KIB, 256 * KIB, MIB, LAYER_1K, 4 * MIB, LAYER_4K, 16 * MIB, 64 * MIB, 256 * MIB]
    if args.quick:
        sizes = [s for s in sizes if s <= 16 * MIB]
    from bench.handoff_bench import exposed_fraction_1k
    from bench.kv_int8_quality import int8_quality
    from shared.kv.ucx import TCP_DEFAULTS

    results = {"memcpy": bench_memcpy(sizes), "ucx_peer": bench_ucx(sizes, TCP_DEFAULTS, error_handling=True),
               "ucx_local": bench_ucx(sizes, {}),
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
               "ucx_peer_over_memcpy": ratio("ucx_peer"), "ucx_local_over_memcpy": ratio("ucx_local"),
               "ucx_polling_over_memcpy": ratio("ucx_polling"),
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
          f"{exposed['prefill_and_handoff_s'] * 1e3:.0f} ms; "
          f"KV ready {exposed['kv_ready_after_prefill_s'] * 1e3:.1f} ms "
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
