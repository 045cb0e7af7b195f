"""The request path's hops with nothing in them: what a NATS request and its reply, and a job's
way through JetStream, cost on this machine between two idle processes that do no other work.
`make bench-stack` measures them in the same run as the stack's own hops (bench/stack_overhead.py),
on a nats-server of their own.

    python -m bench.hop_floor                      (prints the figures)
    python -m bench.hop_floor respond URL          (the answering process of a pair)
    python -m bench.hop_floor take URL MODE COUNT  (the consuming process: prints its latencies as JSON)

A message goes every GAP_S, so each finds its receiver idle, as bench-stack's requests, sent one
at a time, find the services. JetStream: the prefill job stream's own configuration
(`pdserve.shared.streams`); a job's pickup is from the publisher's call to the consumer holding
it, for the prefill worker's way of taking jobs (a pull of up to `max_jobs`) and two others.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time

import nats
import nats.errors
import uvloop

from pdserve.local.servers import binary, die_with_parent, free_port, wait_for_port
from pdserve.planner.metrics import percentiles
from pdserve.shared import streams, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.config import PrefillSettings

GAP_S = 0.02
COUNT = 200
SUBJECT = "pd.floor.echo"
PAYLOAD = b"x" * 1024   # about a prefill job's or a route request's size
MODES = {"pull_max_jobs": PrefillSettings.model_fields["max_jobs"].default, "pull_1": 1, "push": 0}


def p50_p99(xs: list[float]) -> dict[str, float]:
    """ms, as stack.json keeps them (pdserve.planner.metrics.percentiles, rounded)."""
    return {k: round(v, 3) for k, v in percentiles(xs, (50, 99)).items() if k != "mean"}


async def respond(url: str) -> None:
    nc = await nats.connect(url)

    async def answer(msg) -> None:
        await msg.respond(msg.data)
    await nc.subscribe(SUBJECT, cb=answer)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await nc.drain()


async def take(url: str, mode: str, count: int) -> None:
    nc = await nats.connect(url)
    js, got, done = nc.jetstream(), [], asyncio.Event()

    def seen(msg) -> None:
        got.append((time.time_ns() - int(msg.headers["sent_ns"])) / 1e6)
        if len(got) >= count:
            done.set()
    subject = subjects.prefill_jobs(f"floor-{mode.replace('_', '-')}")
    if mode == "push":
        async def on(msg) -> None:
            seen(msg)
            await msg.ack()
        await js.subscribe(subject, durable=f"floor-{mode}", cb=on, manual_ack=True)
        print("ready", flush=True)
        await done.wait()
    else:
        pull = await js.pull_subscribe(subject, durable=f"floor-{mode}")
        print("ready", flush=True)
        while not done.is_set():
            try:
                msgs = await pull.fetch(MODES[mode], timeout=0.5)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            for msg in msgs:
                seen(msg)
                await msg.ack()
    print(json.dumps(got), flush=True)
    await nc.drain()


def _child(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "bench.hop_floor", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", f"{args[0]} did not start"
    return proc


async def _request_reply(url: str, count: int) -> list[float]:
    nc = await nats.connect(url)
    out = []
    for _ in range(count + 5):
        await asyncio.sleep(GAP_S)
        start = time.perf_counter()
        await nc.request(SUBJECT, PAYLOAD, timeout=2.0)
        out.append(1e3 * (time.perf_counter() - start))
    await nc.drain()
    return out[5:]   # (the first: connections warming)


async def _publish(url: str, mode: str, count: int) -> None:
    bus = await Bus.connect(url, "floor")
    subject = subjects.prefill_jobs(f"floor-{mode.replace('_', '-')}")
    for _ in range(count):
        await asyncio.sleep(GAP_S)
        await bus.js.publish(subject, PAYLOAD, headers={"sent_ns": str(time.time_ns())})
    await bus.close()


def measure(count: int = COUNT) -> dict:
    """{"nats_request_reply": p50 / p99 ms, "jetstream_pickup": {mode: p50 / p99 ms}} on a nats-server
    started for it."""
    port = free_port()
    with tempfile.TemporaryDirectory() as store:
        server = subprocess.Popen([binary("nats-server"), "-js", "-sd", store, "-a", "127.0.0.1", "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
        try:
            wait_for_port(port)
            url = f"nats://127.0.0.1:{port}"
            uvloop.run(_ensure(url))
            responder = _child("respond", url)
            rtt = uvloop.run(_request_reply(url, count))
            responder.communicate("", timeout=10)
            pickup = {}
            for mode in MODES:
                taker = _child("take", url, mode, str(count))
                uvloop.run(_publish(url, mode, count))
                out, _ = taker.communicate(timeout=60)
                pickup[mode] = p50_p99(json.loads(out))
        finally:
            server.terminate()
            server.wait(timeout=10)
    return {"nats_request_reply": p50_p99(rtt), "jetstream_pickup": pickup, "gap_s": GAP_S, "count": count}


async def _ensure(url: str) -> None:
    """The streams, as the operator makes them (JetStream up: it answers)."""
    bus = await Bus.connect(url, "floor")
    await streams.ensure(bus.js)
    await bus.close()


def main() -> None:
    if sys.argv[1:2] == ["respond"]:
        uvloop.run(respond(sys.argv[2]))
    elif sys.argv[1:2] == ["take"]:
        uvloop.run(take(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    else:
        print(json.dumps(measure(), indent=1))


if __name__ == "__main__":
    main()
