"""Control-plane overhead: what the services add to a request's first token, per request and
per hop, from each request's own trace.

    python -m bench.stack_overhead [--requests 100] [--colocated]   (writes bench/results/stack.json)

Starts the local stack (1 prefill + 1 decode worker, the workers' default weights; each worker
gets cores/workers torch threads) exporting its spans to an in-process OTLP receiver, then sends
streamed requests one at a time through HTTP → gateway → router → decode admit → prefill
(JetStream) → first token over NATS → SSE, each with a trace id of its own (`traceparent`).
A request's overhead is its time to first token less its prompt's computation, `prefill.compute`
(from the prefill worker taking the job to its first token; colocated: `decode.admit` to the
first token is counted as the engine's): what the request would wait on an engine called
in-process. The hops split the rest, each from that request's spans on one host's clock:

    to the router      client sends → `router.route` starts
      to the gateway   client sends → `gateway.request` starts (HTTP, uvicorn)
      gateway          `gateway.request` starts → `router.route` starts (the checks, the chat
                       template and tokenizer, the route request over NATS)
    placing            `router.route` (the decision, Redis, the decode worker's admit)
      claim            its decision and Redis round trip(s) before the admit (`begin_ms`)
      admit wait       the admit asked and answered over NATS (`admit_wait_ms`)
      admit            of which `decode.admit` on the decode worker
    to the prefill     `router.route` ends → `prefill.compute` starts (the job on JetStream, the pull)
    the first token    `prefill.compute` ends → the client reads its token (NATS, the gateway, SSE)

Beside it, the same prompt on an engine in this process (the same weights), as a check: TTFT
through the stack less the engine's, p50 less p50; and the same kinds of hop with nothing in them
(bench/hop_floor.py: a NATS request and reply, a job through JetStream), what this machine's
hops cost before any service's work; and what this machine charges a process that waited
(bench/warmth.py). Targets: overhead p50 ≤ 3 ms, p99 ≤ 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import time
from pathlib import Path

import httpx
import torch

from bench import hop_floor, warmth
from bench.results_doc import RESULTS_DOC, update_block
from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.config import WorkerSettings
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.tools.otlp_sink import OtlpReceiver, Span

MESSAGES = [{"role": "user", "content": "Hi!"}]
MODEL = "SmolLM2-135M-Instruct"
TARGET_P50_MS, TARGET_P99_MS = 3.0, 10.0
HOPS = ("to_router", "to_gateway", "gateway", "placing", "claim", "admit_wait", "admit", "to_prefill", "first_token")
BEGIN, END = "<!-- bench:stack:begin -->", "<!-- bench:stack:end -->"
HOP_NAMES = {"overhead": "**overhead** (TTFT less `prefill.compute`)", "to_router": "client sends → `router.route`",
             "to_gateway": "↳ client sends → `gateway.request` (HTTP)",
             "gateway": "↳ `gateway.request` → `router.route` (checks, template, tokenizer, NATS)",
             "placing": "`router.route`", "claim": "↳ its decision and claim (Redis)",
             "admit_wait": "↳ the admit asked and answered (NATS)", "admit": "↳ ↳ `decode.admit` on the decode worker",
             "to_prefill": "`router.route` ends → `prefill.compute` (JetStream)",
             "first_token": "`prefill.compute` ends → the client reads the token"}


def stack_ttft(http: httpx.Client, model: str, trace_id: str | None = None) -> float:
    """Seconds to the first token of one streamed request (read to its end)."""
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"} if trace_id else {}
    start = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", headers=headers, json={
            "model": model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, "stream": True,
            "return_token_ids": True}) as r:
        ttft = None
        for line in r.iter_lines():  # read to the end: the request finishes before the next one
            if ttft is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("token_ids"):
                ttft = time.perf_counter() - start
    assert ttft is not None, "no token in the stream"
    return ttft


def engine_ttft(engine: Engine, ids: list[int], i: int) -> float:
    start = time.perf_counter()
    engine.add_request(f"b{i}", ids, SamplingParams(max_tokens=2, temperature=0), prefill_only=True)
    while not engine.step():
        pass
    ttft = time.perf_counter() - start
    engine.abort(f"b{i}")
    return ttft


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def hops(sent_ns: int, ttft_s: float, spans: list[Span], colocated: bool) -> dict[str, float] | None:
    """One request's overhead and hops in ms (module docstring), from its spans; None if one is missing."""
    by = {s.name: s for s in spans}
    route, admit, gateway = by.get("router.route"), by.get("decode.admit"), by.get("gateway.request")
    compute = admit if colocated else by.get("prefill.compute")
    if route is None or admit is None or compute is None or gateway is None:
        return None
    first_ns = sent_ns + int(ttft_s * 1e9)
    engine_ns = first_ns - compute.start_ns if colocated else compute.end_ns - compute.start_ns
    out = {"overhead": ttft_s * 1e3 - engine_ns / 1e6, "to_router": (route.start_ns - sent_ns) / 1e6,
           "to_gateway": (gateway.start_ns - sent_ns) / 1e6, "gateway": (route.start_ns - gateway.start_ns) / 1e6,
           "placing": route.duration_ms, "claim": float(route.attributes.get("begin_ms", 0.0)),
           "admit_wait": float(route.attributes.get("admit_wait_ms", 0.0)), "admit": admit.duration_ms}
    if not colocated:
        out |= {"to_prefill": (compute.start_ns - route.end_ns) / 1e6, "first_token": (first_ns - compute.end_ns) / 1e6}
    return out


def spans_of(receiver: OtlpReceiver, trace_ids: list[str], want: int, timeout_s: float = 20.0) -> dict[str, list[Span]]:
    """Each trace's spans, once each has `want` of the names measured (the batch exporters' delay)."""
    names = {"gateway.request", "router.route", "decode.admit", "prefill.compute"}
    deadline = time.monotonic() + timeout_s
    while True:
        by: dict[str, list[Span]] = {t: [] for t in trace_ids}
        for s in list(receiver.spans):
            if s.trace_id in by and s.name in names:
                by[s.trace_id].append(s)
        if all(len(v) >= want for v in by.values()) or time.monotonic() > deadline:
            return by
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--colocated", action="store_true")
    args = ap.parse_args()
    workers = 1 if args.colocated else 2
    threads = max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)

    loaded = load("smollm2", weights=WorkerSettings().weights)  # the workers' weights
    engine = Engine(loaded, EngineConfig(num_blocks=256))
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(MESSAGES))
    receiver = OtlpReceiver()
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, colocated=args.colocated, threads=threads, kv_blocks=512,
                                    env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                                         # every prompt through the prefill worker (a prompt whose blocks the
                                         # decode worker holds could be prefilled there: no hop to measure)
                                         "PD_PLACEMENT": "remote"})
    t0 = time.monotonic()
    with Stack(cfg) as stack:
        ready_s = time.monotonic() - t0
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            for i in range(3):  # warm both paths
                stack_ttft(http, MODEL), engine_ttft(engine, ids, -i - 1)
            through, direct, sent = [], [], []
            for i in range(args.requests):
                trace_id = secrets.token_hex(16)
                sent.append((trace_id, time.time_ns()))
                through.append(stack_ttft(http, MODEL, trace_id))
                direct.append(engine_ttft(engine, ids, i))
            traces = spans_of(receiver, [t for t, _ in sent], 3 if args.colocated else 4)
        floor = hop_floor.measure()   # (the stack up and idle beside it, as between its requests)
        cold = warmth.measure()
    rows = [h for (t, at), ttft in zip(sent, through) if (h := hops(at, ttft, traces[t], args.colocated))]
    mode = "colocated" if args.colocated else "1 prefill + 1 decode"
    per_hop = {k: {"p50": round(pct([r[k] for r in rows], 50), 2), "p99": round(pct([r[k] for r in rows], 99), 2)}
               for k in ("overhead", *HOPS) if rows and k in rows[0]}
    ms = {name: {"p50": round(1e3 * pct(xs, 50), 2), "p99": round(1e3 * pct(xs, 99), 2)}
          for name, xs in (("through_stack", through), ("engine_in_process", direct))}
    print(f"\nstack ({mode}) ready in {ready_s:.1f} s; prompt {len(ids)} tokens; {args.requests} requests "
          f"({len(rows)} with every span); {threads} torch thread(s) per worker and in-process")
    print(f"{'ms':28} {'p50':>8} {'p99':>8}")
    for name, v in (*ms.items(), *per_hop.items()):
        print(f"{name:28} {v['p50']:8.2f} {v['p99']:8.2f}")
    p50, p99 = (per_hop["overhead"]["p50"], per_hop["overhead"]["p99"]) if rows else (None, None)
    summary = {"overhead_p50_ms": p50, "overhead_p99_ms": p99,
               "floor_nats_request_reply_p50_ms": floor["nats_request_reply"]["p50"],
               "floor_jetstream_pickup_p50_ms": floor["jetstream_pickup"]["pull_max_jobs"]["p50"],
               "overhead_p50_less_p50_ms": round(1e3 * (pct(through, 50) - pct(direct, 50)), 2),
               "requests_traced": len(rows), "target_p50_ms": TARGET_P50_MS, "target_p99_ms": TARGET_P99_MS,
               "targets_met": {"overhead_p50_ms": p50 is not None and p50 <= TARGET_P50_MS,
                               "overhead_p99_ms": p99 is not None and p99 <= TARGET_P99_MS}}
    out = Path(__file__).parent / "results" / ("stack_colocated.json" if args.colocated else "stack.json")
    out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                                           "warmth": cold},
                               "mode": mode, "prompt_tokens": len(ids), "requests": args.requests,
                               "threads": threads, "weights": WorkerSettings().weights, "ttft_ms": ms,
                               "hops_ms": per_hop, "floor_ms": floor, "summary": summary}, indent=1) + "\n")
    print(f"wrote {out}")
    if not args.colocated:
        update_block(RESULTS_DOC, BEGIN, END, section(json.loads(out.read_text())))


def section(data: dict) -> str:
    """docs/RESULTS.md's "Request path overhead" block, from stack.json."""
    s, t = data["summary"], data["ttft_ms"]
    met = {True: "met", False: "missed"}
    return "\n".join([
        f"Measured by `make bench-stack` ({data['mode']}, {data['requests']} requests one at a time, a "
        f"{data['prompt_tokens']}-token prompt, `{data.get('weights', '')}` weights, {data['threads']} torch thread "
        f"per worker, {data['machine']['cpus']} cores; {s['requests_traced']} requests with every span). Each "
        "request's overhead is its time to first token less its prompt's computation on the prefill worker; the "
        "hops split it from the same request's spans (ms):", "",
        "| hop | p50 | p99 |", "|---|---|---|",
        *[f"| {HOP_NAMES.get(k, k)} | {v['p50']:.2f} | {v['p99']:.2f} |" for k, v in data["hops_ms"].items()],
        f"| TTFT through the stack | {t['through_stack']['p50']:.2f} | {t['through_stack']['p99']:.2f} |",
        f"| TTFT of the same prompt on an engine in the benchmark's process | {t['engine_in_process']['p50']:.2f} | "
        f"{t['engine_in_process']['p99']:.2f} |", "",
        *floor_lines(data.get("floor_ms")),
        *([f"The services wait between these requests, sent one at a time; in the same run {why}.", ""]
          if (why := warmth.clause(data["machine"].get("warmth"))) else []),
        f"Targets: overhead p50 ≤ {s['target_p50_ms']:g} ms ({met[s['targets_met']['overhead_p50_ms']]}), "
        f"p99 ≤ {s['target_p99_ms']:g} ms ({met[s['targets_met']['overhead_p99_ms']]})."])


def floor_lines(floor: dict | None) -> list[str]:
    """The hops with nothing in them (bench/hop_floor.py), measured in the same run."""
    if not floor:
        return []
    rr, pickup = floor["nats_request_reply"], floor["jetstream_pickup"]
    return [f"The same kinds of hop with nothing in them, in the same run (`bench/hop_floor.py`: two idle processes "
            f"on a nats-server of their own, a message every {1e3 * floor['gap_s']:g} ms): a NATS request and its "
            f"reply {rr['p50']:.2f} / {rr['p99']:.2f} ms (p50 / p99); a job from its publish to its consumer on the "
            f"prefill job stream's configuration, taken as the prefill worker takes jobs (a pull of up to "
            f"`max_jobs`) {pickup['pull_max_jobs']['p50']:.2f} / {pickup['pull_max_jobs']['p99']:.2f} ms, "
            f"one job a pull {pickup['pull_1']['p50']:.2f} / {pickup['pull_1']['p99']:.2f} ms, pushed "
            f"{pickup['push']['p50']:.2f} / {pickup['push']['p99']:.2f} ms.", ""]


if __name__ == "__main__":
    main()
