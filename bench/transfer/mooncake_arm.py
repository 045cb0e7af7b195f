"""Mooncake's transfer engine as a KV transfer arm, between two processes on one host.

    /work/venv-mooncake/bin/python bench/transfer/mooncake_arm.py --sizes 65536,1048576,6291456,67108864

Runs in its own virtualenv (mooncake-transfer-engine-non-cuda), not the project's. A receiver and a sender process
each hold a `mooncake.engine.TransferEngine` (metadata: P2PHANDSHAKE, no etcd; host memory: a numpy buffer per
process, registered with `register_memory`). The receiver hands its session id ("127.0.0.1:<rpc port>") and buffer
address to the sender through a queue; the sender then moves one payload of each size from its region into the
receiver's with `transfer_sync_write` (one transfer in flight at a time; it returns once the data is written): a
warm-up, then `reps_for(size)` timed writes, timed until the receiver has confirmed through a queue that it holds
the last write's bytes (a marker only the last write carries). GB/s = size * reps / seconds / 1e9, as in
bench/transfer/. Then the CPU each process takes over --idle-s seconds with no transfer (engine threads).
Prints one JSON line: {"gbps": {"<size>": ...}, "protocol": ..., "version": ..., "idle_cpu_cores": {...}}.

With no RDMA device the classic engine in this wheel installs its TCP transport whatever `protocol` says (it only
picks the allocator); the wheel has no shared-memory transport (TENT, with "shm", is not compiled in).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import queue
import signal
import time
import traceback

import numpy as np

MIB = 1 << 20
HOST = "127.0.0.1"
TIMEOUT_S = 300  # the whole run; children are killed past it


def reps_for(size: int) -> int:
    return max(3, min(200, (512 * MIB) // size))


def _engine(protocol: str, buf: np.ndarray):
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent, whatever kills it
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", protocol, "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("register_memory failed")
    return engine


def _idle_cpu(seconds: float) -> float:
    time.sleep(1)
    start = time.process_time()
    time.sleep(seconds)
    return (time.process_time() - start) / seconds


def _guarded(fn, out_q, *args):
    try:
        fn(out_q, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        out_q.put(("error", traceback.format_exc()))


def _receiver(out_q, protocol, max_size, info_q, cmd_q, ack_q):
    buf = np.full(max_size, 0, dtype=np.uint8)  # touched: no page faults inside the timed writes
    engine = _engine(protocol, buf)
    info_q.put((f"{HOST}:{engine.get_rpc_port()}", buf.ctypes.data))
    while (cmd := cmd_q.get())[0] == "check":
        _, size, fill, marker = cmd
        ack_q.put(bool(buf[0] == buf[size - 1] == marker and buf[size // 2] == fill))
    out_q.put(("receiver_idle_cpu", _idle_cpu(cmd[1])))


def _sender(out_q, protocol, sizes, idle_s, info_q, cmd_q, ack_q):
    src = np.full(max(sizes), 0, dtype=np.uint8)
    engine = _engine(protocol, src)
    session, dst = info_q.get(timeout=60)
    gbps = {}
    for i, size in enumerate(sizes):
        fill, marker = 1 + i % 100, 101 + i % 100
        src[:size] = fill

        def write(size=size):
            if (ret := engine.transfer_sync_write(session, src.ctypes.data, dst, size)) != 0:
                raise RuntimeError(f"transfer_sync_write({size}) returned {ret}")

        write()  # warm-up
        start = time.perf_counter()
        for rep in range(reps_for(size)):
            if rep == reps_for(size) - 1:
                src[0] = src[size - 1] = marker
            write()
        cmd_q.put(("check", size, fill, marker))
        if not ack_q.get(timeout=60):
            raise RuntimeError(f"receiver does not hold the last write of {size} bytes")
        gbps[str(size)] = size * reps_for(size) / (time.perf_counter() - start) / 1e9
    cmd_q.put(("idle", idle_s))
    out_q.put(("gbps", gbps))
    out_q.put(("sender_idle_cpu", _idle_cpu(idle_s)))


def run(sizes: list[int], protocol: str = "tcp", idle_s: float = 5.0) -> dict:
    ctx = mp.get_context("spawn")
    out_q, info_q, cmd_q, ack_q = (ctx.Queue() for _ in range(4))
    procs = [ctx.Process(target=_guarded, args=(_receiver, out_q, protocol, max(sizes), info_q, cmd_q, ack_q)),
             ctx.Process(target=_guarded, args=(_sender, out_q, protocol, sizes, idle_s, info_q, cmd_q, ack_q))]
    deadline = time.monotonic() + TIMEOUT_S
    got: dict[str, object] = {}
    ok = False
    try:
        for p in procs:
            p.start()
        while len(got) < 3:
            try:
                kind, value = out_q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no result within {TIMEOUT_S} s (have {sorted(got)})") from None
            if kind == "error":
                raise RuntimeError(f"child failed:\n{value}")
            got[kind] = value
        ok = True
    finally:  # on error or timeout the children are killed at once; otherwise they get 10 s to exit
        for p in procs:
            p.join(timeout=10 if ok else 0)
            if p.is_alive():
                p.kill()
                p.join()
    from importlib.metadata import packages_distributions, version

    dist = packages_distributions().get("mooncake", ["mooncake-transfer-engine"])[0]
    return {"gbps": got["gbps"], "protocol": protocol, "version": f"{dist} {version(dist)}",
            "idle_cpu_cores": {"sender": got["sender_idle_cpu"], "receiver": got["receiver_idle_cpu"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="65536,1048576,6291456,67108864", help="payload bytes, comma-separated")
    ap.add_argument("--protocol", default="tcp", help="TransferEngine.initialize protocol (default tcp)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window after the transfers")
    args = ap.parse_args()
    print(json.dumps(run([int(s) for s in args.sizes.split(",")], args.protocol, args.idle_s)), flush=True)


if __name__ == "__main__":
    main()
