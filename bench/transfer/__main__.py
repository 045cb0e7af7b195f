"""KV transfer paths side by side, between two processes, in one run: `make bench-transfer`.

    python -m bench.transfer [--quick]

Payloads from 64 KiB to 256 MiB (`--quick`: to 16 MiB) plus the real per-layer KV sizes of 1k- and 4k-token SmolLM2
requests (fp32), each sent REPS times after a warm-up, timed until the receiver confirms it
holds the last byte. The UCX arms send as the services do: up to STREAMED messages under way
at a time (the sender sends each batch of layers as soon as it is computed), each received
into a staging buffer from pdserve/shared/kv/staging.py:
  memcpy        numpy copy in one process (the limit)
  segment       what the services use on one host (pdserve/shared/kv/segment.py): the payload in the
                sender's shared-memory segment, a NATS notice naming where, the receiver's
                copy into staging (bench/transfer/segment.py); up to STREAMED copies at a time
  segment_one_by_one  the same, one copy at a time
  ucx_services  what the services use between hosts (pdserve/shared/kv/ucx.py's transport, its defaults): endpoints
                with UCX peer-failure handling, shared memory allowed to carry it (sysv for
                small messages, cma zero-copy reads for payloads), "thread" progress
  ucx_services_one_by_one  the same, one message at a time (each waits for the one before:
                what a message costs beyond its bytes)
  ucx_services_fresh_buffers  the same, each message received into a fresh buffer (the
                receiver before pdserve/shared/kv/staging.py: page faults inside the transfer)
  ucx_peer_tcp  the services' path before: peer-failure handling without those settings, so
                TCP on loopback even on one host
  ucx_services_polling  ucx_services with "polling" progress (spins a core in each process
                after the first transfer, so the services do not use it)
  ucx_local     no endpoint error handling (PD_UCX_ERROR_HANDLING=false): shared memory, but
                a sender killed mid-transfer can crash the receiver
  ucx_tcp       UCX_TLS=tcp,self with error handling and the services' TCP segment settings
                (the path to another host)
  nixl          NIXL (nixl-cu12, its UCX backend, host memory, its defaults: peer-failure
                handling, a progress thread): the decode side READs the prefill side's
                registered buffer and notifies it, as vLLM's NIXL connector does; one
                transfer at a time (bench/transfer/nixl_arm.py)
  nixl_shm      the same with the services' shared-memory settings (SHM_DEFAULTS of
                pdserve/shared/kv/ucx.py) in its UCX's environment
  socket        a plain TCP socket on loopback, sendall / recv_into
  ucx_tcp_veth, socket_veth  ucx_tcp and socket between two network namespaces joined by a
                veth pair (MTU 1500; bench/netns.py): two hosts, as far as TCP can tell
  mooncake_tcp  Mooncake's transfer engine (mooncake-transfer-engine-non-cuda, TCP: the wheel
                has no shared-memory transport), transfer_sync_write (bench/transfer/mooncake_arm.py)
  nats        the naive baseline: the payload as 1 MiB NATS messages through nats-server
NIXL and Mooncake run in virtualenvs of their own (bench/transfer/peers.py, scripts/peer_venvs.sh).
Each arm prints as it finishes; one that fails or runs past ARM_TIMEOUT_S is reported failed
(`failed_arms`), its processes killed, and the others are still measured. Then the CPU the
services' transport takes while no KV moves (`ucx_idle_cpu_cores`: its progress thread), and
`exposed_transfer_fraction_1k` / `_2k`: a 1k- / 2k-token prompt (2k: about the longest the
model takes) prefilled alone vs prefilled while its
KV streams layer by layer to another process exactly as the services do it on one host
(through the segment; `_1k_ucx`: over UCX, as between hosts; see bench/transfer/handoff.py),
and the quality cost of optional int8 KV (bench/transfer/kv_int8_quality.py).
Prints a table, writes bench/results/transfer.json.
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
import time
from pathlib import Path

import numpy as np

from bench import netns
from bench.children import call, children, in_process, outcome
from bench.transfer.common import ARM_TIMEOUT_S, MIB, NATS_SLOW_CONSUMER, STREAMED, reps_for
from bench.transfer.peers import PEER_RUNS, bench_peer
from pdserve.shared.kv.ucx import SHM_DEFAULTS

KIB = 1 << 10
LAYER_1K = 64 * 2 * 16 * 3 * 64 * 4    # 64 blocks x (K,V) x 16 tokens x 3 heads x 64 dims x fp32
LAYER_4K = 4 * LAYER_1K
NATS_CHUNK = 1 * MIB
RESULTS = Path(__file__).parents[1] / "results" / "transfer.json"
HOST = "PD_BENCH_NETNS"  # a child's network namespace, in its environment


# -- receivers (child processes) -------------------------------------------------------------
def _ucx_receiver(sizes, addr_q, done_q, env, window, progress, error_handling, fresh):
    _enter(env)
    from pdserve.shared.kv import create_transport
    from pdserve.shared.kv.staging import Staging, size_class

    async def run():
        transport = create_transport("ucx", progress, ucx_error_handling=error_handling)
        addr_q.put(transport.address)
        staging, tag = Staging(keep_bytes=window * sum(map(size_class, sizes))), 0  # all kept: warm

        async def receive(size: int, tag: int) -> None:  # as the services' receiver does it
            buf = np.empty(size, dtype=np.uint8) if fresh else staging.take(size)
            await transport.recv(tag, buf)
            staging.give(buf)

        for size in sizes:
            await streamed(window, (receive(size, tag + 1 + i) for i in range(window)))  # warm-up
            tag += window
            await streamed(window, (receive(size, tag + 1 + i) for i in range(reps_for(size))))
            tag += reps_for(size)
            done_q.put(size)
    asyncio.run(run())


def _enter(env: dict[str, str]) -> None:
    """A child's environment, and the network namespace it runs in (HOST, when on a veth pair:
    UCX then uses that namespace's end of the pair, named as the namespace)."""
    os.environ.update(env)
    if HOST in env:
        netns.enter(env[HOST])
        os.environ["UCX_NET_DEVICES"] = env[HOST]


async def streamed(window: int, steps) -> None:
    """Run the coroutines `steps` in order, at most `window` under way at a time."""
    running: set[asyncio.Task] = set()
    for step in steps:
        if len(running) >= window:
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failure fails the arm
        running.add(asyncio.create_task(step))
    for task in running:
        await task


def _socket_receiver(sizes, port_q, done_q, host):
    if host:
        netns.enter(host)
    with socket.socket() as srv:
        srv.bind((netns.B_IP if host else "127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            for size in sizes:
                buf = np.empty(size, dtype=np.uint8).data  # (a memoryview of it)
                for _ in range(reps_for(size) + 1):
                    got = 0
                    while got < size:
                        got += conn.recv_into(buf[got:], size - got)
                done_q.put(size)


def _nats_receiver(sizes, url, ready_q, done_q):
    import nats

    async def run():
        async def lost(e=None):  # e.g. dropped by the server as a slow consumer: the arm fails
            done_q.put(f"NATS receiver disconnected: {e or 'connection closed'}")
            finished.set()

        finished = asyncio.Event()
        nc = await nats.connect(url, allow_reconnect=False, error_cb=lost, disconnected_cb=lost)
        state = {"size_i": 0, "got": 0, "reps": 0}
        buf = np.empty(max(sizes), dtype=np.uint8)

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

        await nc.subscribe("bench.kv", cb=on_msg, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)
        await nc.flush()
        ready_q.put(True)
        await finished.wait()
        if nc.is_connected:
            await nc.close()
    asyncio.run(run())


# -- senders ----------------------------------------------------------------------------------
def _timed(send_one, size: int, done_q) -> float:
    """GB/s: one warm-up send, then REPS sends timed until the receiver confirms."""
    send_one(0)
    start = time.perf_counter()
    for i in range(reps_for(size)):
        send_one(i + 1)
    assert outcome(done_q.get(timeout=ARM_TIMEOUT_S)) == size
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


def bench_ucx(sizes, env: dict[str, str], window: int = STREAMED, progress: str = "thread",
              error_handling: bool = True, fresh: bool = False, hosts: tuple[str, str] | None = None):
    """Sender and receiver each in a fresh process with the services' transport
    (pdserve/shared/kv/ucx.py) and `env` on top of its defaults (read when UCX starts); up to `window`
    messages under way at a time; ucxx `progress` mode ("thread": the services' default); the
    receiver's buffers from the services' staging (pdserve/shared/kv/staging.py), or `fresh` ones;
    `hosts`: the sender's and the receiver's network namespaces (bench/netns.py)."""
    ctx = mp.get_context("spawn")
    addr_q, done_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    sender_env, receiver_env = ({**env, HOST: h} for h in hosts) if hosts else (env, env)
    rest = (window, progress, error_handling)
    with children(ctx.Process(target=_ucx_receiver, args=(sizes, addr_q, done_q, receiver_env, *rest, fresh)),
                  ctx.Process(target=call, args=(_ucx_sender, (sizes, addr_q, done_q, sender_env, *rest),
                                                 result_q))):
        return outcome(result_q.get(timeout=ARM_TIMEOUT_S))


async def _ucx_send(sizes, address, done_q, window, progress, error_handling):
    from pdserve.shared.kv import create_transport

    transport = create_transport("ucx", progress, ucx_error_handling=error_handling)
    out, tag = {}, 0
    loop = asyncio.get_running_loop()
    for size in sizes:
        bufs = [np.ones(size, dtype=np.uint8) for _ in range(window)]  # as many as under way (the KV of layers)
        send = lambda i, tag=tag, bufs=bufs: transport.send(address, tag + 1 + i, bufs[i % window])  # noqa: E731
        await streamed(window, map(send, range(window)))  # warm-up
        tag += window
        start = time.perf_counter()
        await streamed(window, map(send, range(window, window + reps_for(size))))
        tag += reps_for(size)
        assert await loop.run_in_executor(None, done_q.get, True, ARM_TIMEOUT_S) == size
        out[size] = size * reps_for(size) / (time.perf_counter() - start) / 1e9
    await transport.close()
    return out


def _ucx_sender(sizes, addr_q, done_q, env, window, progress, error_handling):
    _enter(env)
    return asyncio.run(_ucx_send(sizes, addr_q.get(timeout=60), done_q, window, progress, error_handling))


def _idle_cpu(seconds):
    """The services' transport, one message sent to itself, then idle: CPU of the process."""
    from pdserve.shared.kv import create_transport

    async def run():
        transport = create_transport("ucx")
        buf = np.ones(MIB, dtype=np.uint8)
        await asyncio.gather(transport.recv(1, np.empty_like(buf)), transport.send(transport.address, 1, buf))
        await asyncio.sleep(1)
        start = time.process_time()
        await asyncio.sleep(seconds)
        return (time.process_time() - start) / seconds
    return asyncio.run(run())


def idle_cpu(seconds: float = 5.0) -> float:
    """Fraction of a core a process with the services' UCX transport uses while no KV moves
    (its progress thread)."""
    return in_process(_idle_cpu, seconds, timeout_s=ARM_TIMEOUT_S)


def bench_socket(sizes, hosts: tuple[str, str] | None = None):
    """`hosts`: the sender's and the receiver's network namespaces (bench/netns.py)."""
    ctx = mp.get_context("spawn")
    port_q, done_q = ctx.Queue(), ctx.Queue()
    out = {}
    with children(ctx.Process(target=_socket_receiver, args=(sizes, port_q, done_q, hosts and hosts[1]))):
        port = port_q.get(timeout=60)
        with netns.inside(hosts[0]) if hosts else contextlib.nullcontext():
            s = socket.create_connection((netns.B_IP if hosts else "127.0.0.1", port))
        with s:
            for size in sizes:
                buf = np.ones(size, dtype=np.uint8)
                out[size] = _timed(lambda _i, buf=buf: s.sendall(buf), size, done_q)
    return out


def on_veth(bench, *args, **kwargs):
    """`bench` between two network namespaces joined by a veth pair (MTU 1500), as two hosts."""
    with netns.veth_pair() as hosts:
        return bench(*args, hosts=hosts, **kwargs)


def bench_nats(sizes):
    from bench.transfer.handoff import nats_server

    # nats-server drops a client it cannot write to within 64 MiB / 2 s (a slow consumer); a
    # Python receiver copying every message falls that far behind on large payloads
    with nats_server(NATS_SLOW_CONSUMER) as url:
        ctx = mp.get_context("spawn")
        ready_q, done_q = ctx.Queue(), ctx.Queue()
        with children(ctx.Process(target=_nats_receiver, args=(sizes, url, ready_q, done_q))):
            ready_q.get(timeout=60)
            return asyncio.run(_nats_send(sizes, url, done_q))


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
        assert outcome(await loop.run_in_executor(None, done_q.get, True, ARM_TIMEOUT_S)) == size
        out[size] = size * reps_for(size) / (time.perf_counter() - start) / 1e9
    await nc.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="up to 16 MiB only")
    args = ap.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    sizes = [64 * KIB, 256 * KIB, MIB, LAYER_1K, 4 * MIB, LAYER_4K, 16 * MIB, 64 * MIB, 256 * MIB]
    label = lambda s: {LAYER_1K: "1k-tok layer", LAYER_4K: "4k-tok layer"}.get(s, f"{s // KIB} KiB")  # noqa: E731
    if args.quick:
        sizes = [s for s in sizes if s <= 16 * MIB]
    from bench.transfer.handoff import exposed_fraction
    from bench.transfer.kv_int8_quality import int8_quality
    from bench.transfer.segment import bench_segment

    old_default = {"UCX_MM_ERROR_HANDLING": "n", "UCX_CMA_MEMORY_INVALIDATE": "n"}
    arms = {"memcpy": lambda: bench_memcpy(sizes),
            "segment": lambda: bench_segment(sizes),
            "segment_one_by_one": lambda: bench_segment(sizes, window=1),
            "ucx_services": lambda: bench_ucx(sizes, {}),
            "ucx_services_one_by_one": lambda: bench_ucx(sizes, {}, window=1),
            "ucx_services_fresh_buffers": lambda: bench_ucx(sizes, {}, fresh=True),
            "ucx_peer_tcp": lambda: bench_ucx(sizes, old_default),
            "ucx_services_polling": lambda: bench_ucx(sizes, {}, progress="polling"),
            "ucx_local": lambda: bench_ucx(sizes, {}, error_handling=False),
            "ucx_tcp": lambda: bench_ucx(sizes, {"UCX_TLS": "tcp,self"}),
            "nixl": lambda: bench_peer("nixl", sizes, timeout_s=ARM_TIMEOUT_S),
            "nixl_shm": lambda: bench_peer("nixl", sizes, env=SHM_DEFAULTS, timeout_s=ARM_TIMEOUT_S),
            "socket": lambda: bench_socket(sizes),
            "mooncake_tcp": lambda: bench_peer("mooncake", sizes, timeout_s=ARM_TIMEOUT_S),
            "ucx_tcp_veth": lambda: on_veth(bench_ucx, sizes, {"UCX_TLS": "tcp,self"}),
            "socket_veth": lambda: on_veth(bench_socket, sizes),
            "nats": lambda: bench_nats(sizes)}
    results, failed = {}, {}
    for name, run in arms.items():
        started = time.monotonic()
        try:
            results[name] = run()
        except Exception as e:  # noqa: BLE001 - reported; the other arms are still measured
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"{name:>20}: FAILED after {time.monotonic() - started:.0f} s: {failed[name]}", flush=True)
            continue
        print(f"{name:>20}: " + ", ".join(f"{label(k)} {v:.2f}" for k, v in results[name].items()) +
              f" GB/s ({time.monotonic() - started:.0f} s)", flush=True)
    def measured(name: str, fn, *args, **kwargs):  # a failure is reported, what was measured is still written
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"{name}: FAILED: {failed[name]}", flush=True)
            return None

    idle = measured("idle_cpu", idle_cpu)
    print(f"services' transport idle: {idle if idle is None else round(idle, 3)} of a core", flush=True)
    # the longest prompt SmolLM2 takes is 2,047 tokens: 2k stands for the long one
    exposed = measured("handoff_1k", in_process, exposed_fraction, 1024, timeout_s=2 * ARM_TIMEOUT_S)
    exposed_2k = measured("handoff_2k", in_process, exposed_fraction, 2000, timeout_s=2 * ARM_TIMEOUT_S)
    exposed_ucx = measured("handoff_1k_ucx", in_process, exposed_fraction, 1024, False,
                           timeout_s=2 * ARM_TIMEOUT_S)
    int8 = int8_quality()

    big = [s for s in sizes if s >= MIB]
    # memory speed: memcpy of payloads past the caches (a 4 MiB copy repeated runs from cache)
    memcpy = statistics.median(results["memcpy"][s] for s in sizes if s >= 16 * MIB)

    def median(name: str, over: str = "") -> float | None:  # over payloads >= 1 MiB, against memcpy or an arm
        if name not in results or (over and over not in results):
            return None
        return statistics.median(results[name][s] / (results[over][s] if over else memcpy) for s in big)

    summary = {"memcpy_gbps": memcpy,
               "segment_over_memcpy": median("segment"),
               "segment_gbps_1mib_plus": min(results["segment"][s] for s in big) if "segment" in results else None,
               "segment_one_by_one_over_memcpy": median("segment_one_by_one"),
               "segment_over_ucx_services": median("segment", over="ucx_services"),
               "ucx_services_over_memcpy": median("ucx_services"),
               "ucx_services_gbps_1mib_plus": min(results["ucx_services"][s] for s in big)
               if "ucx_services" in results else None,
               "ucx_services_one_by_one_over_memcpy": median("ucx_services_one_by_one"),
               "ucx_services_fresh_buffers_over_memcpy": median("ucx_services_fresh_buffers"),
               "streamed_messages": STREAMED,
               "ucx_peer_tcp_over_memcpy": median("ucx_peer_tcp"),
               "ucx_services_polling_over_memcpy": median("ucx_services_polling"),
               "ucx_local_over_memcpy": median("ucx_local"),
               "ucx_tcp_over_memcpy": median("ucx_tcp"), "socket_over_memcpy": median("socket"),
               "ucx_tcp_over_socket": median("ucx_tcp", over="socket"),
               "ucx_tcp_over_socket_veth": median("ucx_tcp_veth", over="socket_veth"),
               "nats_over_memcpy": median("nats"),
               "nixl_over_memcpy": median("nixl"), "nixl_shm_over_memcpy": median("nixl_shm"),
               "ucx_services_over_nixl": median("ucx_services", over="nixl"),
               "mooncake_tcp_over_socket": median("mooncake_tcp", over="socket"),
               "ucx_idle_cpu_cores": idle,
               "exposed_transfer_fraction_1k": exposed and exposed["exposed_transfer_fraction"],
               "exposed_transfer_fraction_2k": exposed_2k and exposed_2k["exposed_transfer_fraction"],
               "exposed_transfer_fraction_1k_ucx": exposed_ucx and exposed_ucx["exposed_transfer_fraction"],
               **{k: v for k, v in int8.items() if k.startswith("int8_")}, "failed_arms": failed}

    print(f"\nGB/s, two processes on one host ({os.cpu_count()} cores); ratios: median over payloads >= 1 MiB "
          "against memcpy of payloads >= 16 MiB")
    print(f"{'payload':>14} " + " ".join(f"{m:>10}" for m in results))
    for s in sizes:
        print(f"{label(s):>14} " + " ".join(f"{results[m][s]:10.2f}" for m in results))
    for h in filter(None, (exposed, exposed_2k, exposed_ucx)):
        print(f"\nhandoff of a {h['prompt_tokens']}-token prompt streamed layer by layer ({h['path']}, median of "
              f"{h['rounds']}): "
              f"prefill alone {h['prefill_s'] * 1e3:.0f} ms; prefill + handoff until the decode side committed the "
              f"verified KV {h['prefill_and_handoff_s'] * 1e3:.0f} ms; KV ready "
              f"{h['kv_ready_after_prefill_s'] * 1e3:.1f} ms after the prefill's last pass; decode process busy "
              f"{h['decode_side_cpu_cores']:.2f} cores meanwhile (receives are posted only for payloads on their way)")
    print(f"int8 KV on the wire ({len(int8['per_prompt'])} held conversations, 32 greedy tokens each): " +
          ", ".join(f"{n} {r['agreement']:.2f} (max logit diff {r['max_logit_diff']:.3f})"
                    for n, r in int8["per_prompt"].items()))
    for k, v in summary.items():
        print(f"{k:32} {v:8.3f}" if isinstance(v, float) else f"{k:32} {v}")
    print("targets: segment_over_memcpy (the services' path on one host) >= 0.5, ucx_tcp_over_socket >= 0.8, "
          "exposed_transfer_fraction_1k <= 0.05, ucx_idle_cpu_cores <= 0.05")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"summary": summary, "gbps": {m: {str(s): v for s, v in r.items()}
                                                                  for m, r in results.items()},
                                   "peers": PEER_RUNS,
                                   "handoff_1k": exposed, "handoff_2k": exposed_2k, "handoff_1k_ucx": exposed_ucx,
                                   "int8_quality": int8},
                                  indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
