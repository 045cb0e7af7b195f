"""Where a request's control-plane time goes: py-spy samples every service process of the local
stack (1 prefill + 1 decode worker) while short streamed requests go through one at a time,
and adds up, per service, the CPU each request costs and the functions it goes to.

    python -m bench.path_profile [--requests 200] [--rate 500]   (writes bench/results/path_profile.json)

A sample is one stack of one thread that is on the CPU (py-spy leaves idle threads out), so
samples / rate is CPU seconds. Each sample is charged to the first frame from the top of the
stack (the running function's side) that is this project's code (services/, shared/), named
`file:function`, or, when the stack holds none but a service's entry, to the library its event
loop called into (`lib:nats`, `lib:redis`, `lib:uvicorn`; `loop`: the loop itself): so the
table says which of our functions (with what they call) and which libraries spend the time.
The same processes are first sampled idle (heartbeats, registry refreshes, a UCX progress
thread), and that rate is taken off: what is left is the requests' cost. A
worker's engine (pdserve/shared/engine/) is the model; the rest of a worker is the request's path.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.stack_overhead import stack_ttft
from pdserve.local.stack import Stack, StackConfig

SERVICES = ("gateway", "router", "prefill-0", "decode-0")
OURS = ("services/", "shared/")
ENTRY = {("<module>", "main.py"), ("main", "main.py"), ("run", "service.py")}  # a service's start and its loop
# the frames every stack of a loop passes through (its start, the loop, a thread's): skipped to
# find the library the loop called into
LOOP = ("<frozen", "asyncio/", "anyio/", "uvloop/", "threading.py", "uvicorn/main.py", "uvicorn/server.py",
        "uvicorn/_compat.py", "concurrent/futures/thread.py")
MODEL = "SmolLM2-135M-Instruct"
TOP = 8


def charge(stack: str) -> str:
    """The function a sample is charged to: the innermost frame of ours, else the library the
    event loop called into (`lib:<package>`; `lib:asyncio`: the loop itself)."""
    frames = [(name, where.rsplit(":", 1)[0]) for name, _, where in (f.partition(" (") for f in stack.split(";"))]
    for name, file in reversed(frames):  # py-spy's raw frame: "function (path/file.py:line)"
        if file.startswith(OURS) and (name, file.rsplit("/", 1)[-1]) not in ENTRY:
            return f"{file}:{name}"
    called = [file for name, file in frames if not (file.startswith(LOOP) or (name, file.rsplit("/", 1)[-1]) in ENTRY)]
    if called:
        return f"lib:{called[0].split('/')[0]}"
    return "loop"


def read(raw: Path) -> collections.Counter[str]:
    """Samples per charged function from py-spy's raw (collapsed stacks) output."""
    out: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out[charge(stack)] += int(count)
    return out


def record(stack: Stack, rate: int, folder: Path, work) -> tuple[dict[str, collections.Counter[str]], float]:
    """Samples per charged function of each service while `work()` runs, and its seconds."""
    spy = Path(sys.executable).parent / "py-spy"
    spies = {name: subprocess.Popen(
        [str(spy), "record", "--pid", str(stack.procs[name].pid), "--rate", str(rate), "--format", "raw",
         "--output", str(folder / f"{name}.txt"), "--nonblocking"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL) for name in SERVICES}
    time.sleep(2.0)  # (each attached: its first samples are in the idle share, taken off below)
    start = time.monotonic()
    work()
    elapsed = time.monotonic() - start + 2.0
    for proc in spies.values():
        proc.send_signal(2)  # SIGINT: py-spy writes its file and stops
    for proc in spies.values():
        proc.wait(timeout=60)
    return {name: read(folder / f"{name}.txt") for name in SERVICES}, elapsed


def table(busy: dict, busy_s: float, idle: dict, idle_s: float, requests: int, rate: int) -> dict:
    out = {}
    for name, counts in busy.items():
        scale = busy_s / idle_s
        extra = {fn: max(0.0, n - idle[name][fn] * scale) for fn, n in counts.items()}
        per_request = {fn: round(1e3 * n / rate / requests, 3) for fn, n in
                       sorted(extra.items(), key=lambda kv: -kv[1]) if n > 0}
        engine = sum(ms for fn, ms in per_request.items() if fn.startswith("pdserve/shared/engine/"))
        total = sum(per_request.values())
        out[name] = {"cpu_ms_per_request": round(total, 3), "engine_ms_per_request": round(engine, 3),
                     "path_ms_per_request": round(total - engine, 3),
                     "idle_cpu_ms_per_s": round(1e3 * sum(idle[name].values()) / rate / idle_s, 1),
                     "top": dict(list(per_request.items())[:TOP])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    ap.add_argument("--keep", help="a folder to keep py-spy's raw stacks in")
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds sampled with no request")
    args = ap.parse_args()
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, threads=1)
    ttfts: list[float] = []
    with Stack(cfg) as stack, tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            for _ in range(10):  # warm: compiled grammars, caches, connections
                stack_ttft(http, MODEL)
            idle, idle_s = record(stack, args.rate, folder, lambda: time.sleep(args.idle_s))
            busy, busy_s = record(stack, args.rate, folder, lambda: ttfts.extend(
                stack_ttft(http, MODEL) for _ in range(args.requests)))
    services = table(busy, busy_s, idle, idle_s, args.requests, args.rate)
    ttfts.sort()
    for name, row in services.items():
        print(f"\n{name}: {row['cpu_ms_per_request']:.2f} ms CPU per request "
              f"({row['path_ms_per_request']:.2f} path, {row['engine_ms_per_request']:.2f} engine; "
              f"idle {row['idle_cpu_ms_per_s']} ms/s)")
        for fn, ms in row["top"].items():
            print(f"  {ms:7.3f} ms  {fn}")
    summary = {f"{name.split('-')[0]}_path_cpu_ms": row["path_ms_per_request"] for name, row in services.items()}
    summary["ttft_p50_ms"] = round(1e3 * ttfts[len(ttfts) // 2], 2)
    out = Path(__file__).parent / "results" / "path_profile.json"
    out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
                               "requests": args.requests, "rate": args.rate, "idle_s": args.idle_s,
                               "busy_s": round(busy_s, 2), "services": services,
                               "summary": summary}, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
