"""Placements asked as the gateway asks them, open loop: `make bench-scale`'s load.

Each request is a RouteRequest on `pd.router.route` through `Bus.request`, the gateway's call
(pdserve/services/gateway/relay.py), sent at its Poisson arrival time whether or not earlier ones
have been answered; its reply time is the gateway-observed placement time. Afterwards each
answered placement is joined with the router's `router.route` span (request_id attribute).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import nats.errors

from bench.scale.check import Placement
from bench.scale.plan import MODEL, Probe
from bench.scale.report import percentiles
from pdserve.planner.arrivals import arrival_times
from pdserve.shared import subjects
from pdserve.shared.bus import Bus
from pdserve.shared.messages import RouteReply, RouteRequest, Sampling
from pdserve.shared.tools.otlp_sink import OtlpReceiver, Span

ROUTE_TIMEOUT_S = 10.0   # the gateway's default route_timeout_s
MAX_TOKENS = 256


@dataclass
class Sent:
    request_id: str
    probe: Probe
    lag_s: float                 # sent this late after its arrival time (the driver falling behind)
    latency_s: float             # request -> reply, as the gateway sees it
    done_at: float               # perf_counter when answered (or gave up)
    reply: RouteReply | None     # None: no answer within ROUTE_TIMEOUT_S


async def ask(bus: Bus, req: RouteRequest, probe: Probe, due: float) -> Sent:
    sent = time.perf_counter()
    try:
        reply = await bus.request(subjects.ROUTE, req, RouteReply, timeout=ROUTE_TIMEOUT_S)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        reply = None
    done = time.perf_counter()
    return Sent(req.request_id, probe, sent - due, done - sent, done, reply)


async def drive(bus: Bus, probes: list[Probe], rate: float, seconds: float, tag: str,
                seed: int = 0) -> tuple[list[Sent], float]:
    """Placements at the times of a Poisson process of `rate` over `seconds`, the trace's
    prompts in order (cycled); (what each got, the perf_counter of the first send)."""
    times = [t for t in arrival_times(int(1.5 * rate * seconds) + 10, rate, seed=seed) if t < seconds]
    sampling = Sampling(max_tokens=MAX_TOKENS)
    work = [(RouteRequest(request_id=f"{tag}-{i}", prompt_token_ids=probes[i % len(probes)].tokens,
                          sampling=sampling, model=MODEL), probes[i % len(probes)]) for i in range(len(times))]
    start = time.perf_counter()
    tasks = []
    for at, (req, probe) in zip(times, work):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(ask(bus, req, probe, start + at)))
    return await asyncio.gather(*tasks), start


async def route_spans(receiver: OtlpReceiver, ids: set[str], timeout_s: float = 15) -> dict[str, Span]:
    """The router.route span of each request in `ids` (exporters batch: wait for them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        by_id = {s.attributes.get("request_id"): s for s in list(receiver.spans) if s.name == "router.route"}
        found = {k: v for k, v in by_id.items() if k is not None and k in ids}
        if len(found) == len(ids) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.25)


def placements(sent: list[Sent], spans: dict[str, Span], admits: dict[str, tuple[int, int]]) -> list[Placement]:
    """Every placement a router made (its span says ok, whether or not the gateway still
    waited), with the times its admit was asked and answered (the simulated decode worker's
    clock), as the decision check takes them."""
    out = []
    for s in sent:
        span = spans.get(s.request_id)
        if span is None or not span.attributes.get("ok"):
            continue
        a = span.attributes
        asked, answered = admits.get(s.request_id, (None, None))
        out.append(Placement(s.request_id, s.probe, MAX_TOKENS, str(a.get("router", "")), span.start_ns,
                             span.end_ns, a.get("prefill_worker") or None, a.get("decode_worker") or None,
                             a.get("prefill_cached_tokens"), a.get("prefill_queued_tokens"), asked, answered))
    return out


def admit_split(spans: dict[str, Span], admits: dict[str, tuple[int, int]]) -> dict[str, dict]:
    """Each placement's admit wait (the span's `admit_wait_ms`) in three, p50 / p99 ms: to the
    simulated decode worker (from the admit sent, as the span's claim and renewals end, to the
    worker's handler running: the router's publish, nats-server, the fleet process's loop), the
    worker's own answer, and back (nats-server, the router's loop taking the reply)."""
    to, own, back = [], [], []
    for rid, span in spans.items():
        a = span.attributes
        if not a.get("ok") or rid not in admits:
            continue
        asked, answered = admits[rid]
        sent_ns = span.start_ns + 1e6 * (a.get("begin_ms", 0.0) + a.get("renew_ms", 0.0))
        to.append((asked - sent_ns) / 1e6)
        own.append((answered - asked) / 1e6)
        back.append(a.get("admit_wait_ms", 0.0) - to[-1] - own[-1])
    return {"to_worker": percentiles(to), "worker": percentiles(own), "back": percentiles(back)}
