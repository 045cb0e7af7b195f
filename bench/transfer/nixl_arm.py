"""NIXL (UCX backend, host memory) as a KV transfer arm, two processes on one host.

    /work/venv-nixl/bin/python bench/transfer/nixl_arm.py --sizes 65536,1048576 [--reps-cap N] [--op READ|WRITE]
        [--no-prog-thread | --prog-delay-us US] [--err-mode peer|none] [--idle-s 5] [--timeout 300]

Needs a venv with nixl-cu12 (it bundles its own UCX; keep it out of the project's venv, which has
ucxx's). Two spawned processes each make a NIXL agent with the UCX backend and register one numpy
buffer (DRAM_SEG) of the largest size: "prefill" holds the KV, "decode" is where it goes. Agent
metadata and buffer addresses travel over multiprocessing queues (no etcd, no listener thread).

--op READ (default, what vLLM's NixlConnector does): decode, the initiator, reads prefill's buffer
with a notification; decode knows the KV is there when its transfer completes (check_xfer_state),
prefill, the target (which may then free its blocks), from the notification. --op WRITE: prefill
writes into decode's buffer; decode, now the target, learns from the notification.

Per size: one warm-up transfer, then reps = max(3, min(200, 512 MiB // size)) (at most --reps-cap),
one in flight at a time (each a make_prepped_xfer request, posted, polled to DONE, released), timed
from the first post until the target has seen the last notification and said so over a queue, as
bench/transfer/ times its arms. Then each process idles --idle-s seconds: its CPU time over
that (NIXL's progress thread). The decode buffer is checked against prefill's at the end.
Prints one JSON line: {"gbps": {size: GB/s}, "nixl_version", "ucx_tls_used", ...}.

NIXL's defaults: a progress thread (--no-prog-thread: polling a transfer or the notifications
progresses UCX instead) whose poll() timeout the Python API sets to 0, so it spins (--prog-delay-us
sets it), and UCX endpoints with peer-failure handling (--err-mode). UCX_* variables in the
environment reach NIXL's UCX, e.g. UCX_MM_ERROR_HANDLING=y UCX_CMA_MEMORY_INVALIDATE=y (what
pdserve/shared/kv/ucx.py sets): the transports UCX picked are in "ucx_tls_used".
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.metadata
import json
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import tempfile
import time

import numpy as np

MIB = 1 << 20


def reps_for(size: int, cap: int | None) -> int:
    reps = max(3, min(200, (512 * MIB) // size))
    return min(reps, cap) if cap else reps


def _agent(role: str, args, md_q, done_q, out_q) -> None:
    """One side: prefill (source buffer) or decode (destination buffer)."""
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the script
    signal.alarm(int(args.timeout))  # and by its deadline whatever happens
    os.dup2(2, 1)  # stdout is the script's JSON line: NIXL's logger writes to stdout
    try:
        out_q.put((role, _run(role, args, md_q, done_q)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        out_q.put((role, f"{type(e).__name__}: {e}"))


def _run(role: str, args, md_q, done_q) -> dict:
    from nixl_cu12 import _bindings, nixl_agent, nixl_agent_config

    agent = nixl_agent(role, nixl_agent_config(enable_prog_thread=args.prog_thread, backends=[]))
    if args.prog_delay_us is not None:  # the Python API hard-codes pthrDelay=0: poll() with no timeout
        conf = _bindings.nixlAgentConfig()
        conf.useProgThread, conf.pthrDelay = args.prog_thread, args.prog_delay_us
        conf.syncMode = _bindings.NIXL_THREAD_SYNC_NONE  # as nixl_agent sets it without a listener thread
        agent.agent = _bindings.nixlAgent(role, conf)
    agent.create_backend("UCX", {"ucx_error_handling_mode": args.err_mode})
    size_max = max(args.sizes)
    if role == "prefill":
        buf = (np.arange(size_max) % 251).astype(np.uint8)
    else:
        buf = np.zeros(size_max, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, role)], "DRAM")
    initiator = "decode" if args.op == "READ" else "prefill"
    if role != initiator:  # the target: hands out what the initiator needs, counts notifications
        md_q.put((agent.get_agent_metadata(), buf.ctypes.data))
        for size in args.sizes:
            seen, want = 0, reps_for(size, args.reps_cap) + 1
            while seen < want:
                seen += len(agent.get_new_notifs().get(initiator, []))
                if seen < want:
                    time.sleep(20e-6)
            done_q.put(size)
        result: dict[str, object] = {}
    else:
        remote_md, remote_addr = md_q.get(timeout=60)
        peer = agent.add_remote_agent(remote_md)
        agent.make_connection(peer)
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(buf.ctypes.data, s, 0) for s in args.sizes], "DRAM")
        remote = agent.prep_xfer_dlist(peer, [(remote_addr, s, 0) for s in args.sizes], "DRAM")

        def once(i: int, tag: bytes) -> None:
            handle = agent.make_prepped_xfer(args.op, local, [i], remote, [i], tag)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"transfer {tag!r}: {state}")

        gbps = {}
        for i, size in enumerate(args.sizes):
            reps = reps_for(size, args.reps_cap)
            once(i, f"{size}:warmup".encode())
            start = time.perf_counter()
            for r in range(reps):
                once(i, f"{size}:{r}".encode())
            if done_q.get(timeout=args.timeout) != size:
                raise RuntimeError("target out of step")
            gbps[str(size)] = size * reps / (time.perf_counter() - start) / 1e9
        result = {"gbps": gbps}
    if role == "decode":
        result["verified"] = bool(np.array_equal(buf, (np.arange(size_max) % 251).astype(np.uint8)))
    time.sleep(1)
    cpu = time.process_time()
    time.sleep(args.idle_s)
    result["idle_cpu_cores"] = (time.process_time() - cpu) / args.idle_s if args.idle_s else None
    agent.deregister_memory(reg)
    return {**result, "ucx_version": _ucx_version()}


def _ucx_version() -> str:
    import nixl_cu12

    lib = glob.glob(os.path.join(os.path.dirname(nixl_cu12.__file__), "..", "nixl_cu12.libs", "libucp-*.so*"))
    ucp = ctypes.CDLL(lib[0])
    ucp.ucp_get_version_string.restype = ctypes.c_char_p
    return ucp.ucp_get_version_string().decode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[64 << 10, MIB, 6 * MIB, 64 * MIB])
    ap.add_argument("--reps-cap", type=int, default=None)
    ap.add_argument("--op", choices=["READ", "WRITE"], default="READ")
    ap.add_argument("--no-prog-thread", dest="prog_thread", action="store_false",
                    help="no NIXL progress thread: polling the transfer / notifications progresses UCX")
    ap.add_argument("--prog-delay-us", type=int, default=None,
                    help="progress thread's poll() timeout (NIXL's Python API: 0, the thread spins)")
    ap.add_argument("--err-mode", choices=["peer", "none"], default="peer",
                    help="UCX backend's ucx_error_handling_mode (NIXL's default: peer)")
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="cap on the whole run, seconds")
    args = ap.parse_args()
    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryDirectory() as tmp:
        # UCX's info log names the transports each endpoint uses (and keeps UCX off stdout)
        os.environ.setdefault("UCX_LOG_LEVEL", "info")
        os.environ["UCX_LOG_FILE"] = os.path.join(tmp, "ucx.%p.log")
        ctx = mp.get_context("spawn")
        md_q, done_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=_agent, args=(role, args, md_q, done_q, out_q), name=role)
                 for role in ("prefill", "decode")]
        ok = False
        try:
            for p in procs:
                p.start()
            results: dict[str, dict] = {}
            while len(results) < 2:
                try:
                    role, res = out_q.get(timeout=1)
                except queue.Empty:
                    if dead := [f"{p.name} exit {p.exitcode}" for p in procs if p.exitcode not in (None, 0)]:
                        raise RuntimeError(f"agent process died: {dead}") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no result within {args.timeout:.0f} s") from None
                    continue
                if isinstance(res, str):
                    raise RuntimeError(f"{role}: {res}")
                results[role] = res
            ok = True
        finally:
            for p in procs:  # after a failure: killed at once
                p.join(5 if ok else 0)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        logs = "".join(open(f).read() for f in glob.glob(os.path.join(tmp, "ucx.*.log")))
    for line in logs.splitlines():
        if " WARN " in line or " ERROR " in line:
            print(line, file=sys.stderr)
    # e.g. "decode intra-node cfg#1 rma_am(tcp/lo) amo_am(tcp/lo) am(tcp/lo cma/memory) ka(tcp/lo)"
    tls = sorted({" ".join(m.split()) for m in re.findall(r"UCX +INFO +(\S+ (?:intra|inter)-node cfg#\d+ .*)", logs)})
    initiator = "decode" if args.op == "READ" else "prefill"
    print(json.dumps({"gbps": results[initiator]["gbps"], "nixl_version": importlib.metadata.version("nixl-cu12"),
                      "ucx_version": results["decode"]["ucx_version"], "ucx_tls_used": tls, "op": args.op,
                      "prog_thread": args.prog_thread, "prog_delay_us": args.prog_delay_us,
                      "err_mode": args.err_mode, "verified": results["decode"]["verified"],
                      "idle_cpu_cores": {r: results[r]["idle_cpu_cores"] for r in results}}))


if __name__ == "__main__":
    main()
