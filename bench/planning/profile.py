"""The engine's cost on this hardware, for the capacity planner: `make profile`.

    python -m bench.planning.profile [--threads 1,2] [--reps 2] [--no-stack]

Measured with the real model (SmolLM2, with the weights a worker takes by default: PD_WEIGHTS=auto,
native on CPU) in fresh processes, one per worker shape:
- prefill passes: time against new prompt tokens, tokens already cached (a prefix computed
  before), and prompts in one pass;
- decode steps: time against the batch and each sequence's context (sequences reserved and
  committed as a KV handoff would, so no prefill is needed to fill them);
- each shape alone and, for workers smaller than the machine, beside a busy neighbour (the
  same work pinned to the other cores, as the other pool of a disaggregated split runs);
- the KV handoff: bytes between two processes on one host the way the services move them
  (bench/transfer/segment.py), and the model's KV bytes per token;
- the control plane: on each kind of stack `make bench` runs (colocated; 1 prefill + 1
  decode worker), the time to first token through it minus the in-process engine's
  (bench/stack_overhead.py's two measurements, alternated), and a decode step's time through
  it (TPOT of B streams at once) minus the step the cost model gives that stack's decode
  worker shape (the simulator adds the difference to that model, so the two sum to what the
  stack measured).
Fits the cost models of pdserve/planner/cost.py to the points and writes both to
bench/results/profile-<device>.json (device: `cpu`, or the CUDA device's name).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.children import children, in_process
from pdserve.planner import cost
from pdserve.planner.device import device_name
from pdserve.shared.config import WorkerSettings
from pdserve.shared.progress import progress

RESULTS = Path(__file__).parents[1] / "results"
# (new tokens, tokens cached before them): whole prompts, then chunks of a long prompt
PREFILL = [(16, 0), (64, 0), (256, 0), (512, 0), (1024, 0), (2000, 0),
           (128, 512), (128, 896), (256, 768), (512, 512)]
BATCHED = [(4, 64), (8, 32), (16, 16), (4, 256)]          # (prompts in one pass, tokens each)
DECODE = [(b, n) for b in cost.DECODE_BATCHES for n in cost.DECODE_CONTEXTS]  # (batch, context per sequence)
DECODE_STEPS = 3
# the points `probe` measures again: a short and a middling prompt, and decode steps at 1, 4 and 16
PROBE: tuple[list[tuple[int, int]], ...] = ([(64, 0), (256, 0)], [], [(1, 256), (4, 256), (16, 256)])
KV_BLOCKS = 2304
WEIGHTS = WorkerSettings.model_fields["weights"].default  # what a worker computes with unless told otherwise
STACK_TOKENS = 48  # tokens of each stream through the stack


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def _prefill_pass(engine, prompts: list[list[int]]) -> tuple[float, int]:
    """One prefill pass of these prompts (prefill only, then aborted): its seconds, and the
    tokens the first found cached."""
    from pdserve.shared.engine.sequence import SamplingParams
    one = SamplingParams(max_tokens=1, temperature=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, one, prefill_only=True)
    first = engine.seqs["p0"]
    start = time.perf_counter()
    engine.step()
    elapsed, cached = time.perf_counter() - start, first.num_cached
    for i in range(len(prompts)):
        engine.abort(f"p{i}")
    return elapsed, cached


def _decode_steps(engine, batch: int, context: int, seed: int, steps: int, reps: int = 1) -> list[float]:
    """Seconds per step of `reps` runs of `steps` decode steps of `batch` sequences of `context`
    tokens, reserved and committed as a KV handoff would (no prefill fills them), after one
    warm-up step; the sequences are aborted after."""
    from pdserve.shared.engine.sequence import SamplingParams
    params = SamplingParams(max_tokens=steps * reps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.reserve(f"d{i}", _ids(context, seed + i), params)
        engine.commit_import(f"d{i}", 1000)
    engine.step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times.append((time.perf_counter() - start) / steps)
    for i in range(batch):
        engine.abort(f"d{i}")
    return times


def _spin(cpus: set[int], stop) -> None:
    """The neighbour: model-sized matmuls, one thread per core of `cpus`, until told."""
    import torch
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    a, b = torch.randn(256, 576), torch.randn(576, 1536)
    while not stop.is_set():
        for _ in range(20):
            a @ b


def _measure(threads: int, cpus: list[int], reps: int, prefill=PREFILL, batched=BATCHED, decode=DECODE,
             device: str = "cpu") -> dict:
    import torch

    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import Engine
    from pdserve.shared.engine.loader import load

    os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(threads)
    cfg = EngineConfig(num_blocks=KV_BLOCKS, max_batched_tokens=4096, prefill_chunk=2048, max_num_seqs=128,
                       device=device)
    loaded = load("smollm2", dtype=cfg.torch_dtype, device=device, weights=WEIGHTS)
    engine = Engine(loaded, cfg)  # (a step returns its sampled tokens on the host: timed to the end of its work)
    seed = iter(range(10**6))

    _prefill_pass(engine, [_ids(64, next(seed))])  # warm-up
    points = []
    prefixes = {c: _ids(c, next(seed)) for _, c in prefill}
    for new, cached in prefill:
        times = []
        for _ in range(reps):
            if cached:
                _prefill_pass(engine, [prefixes[cached]])  # in the prefix cache (again, if evicted: nothing runs then)
            elapsed, found = _prefill_pass(engine, [prefixes[cached] + _ids(new, next(seed))])
            assert found == cached, f"{found} of {cached} prefix tokens cached"
            times.append(elapsed)
        points.append({"new": [new], "cached": [cached], "s": statistics.median(times)})
    for k, n in batched:
        times = [_prefill_pass(engine, [_ids(n, next(seed)) for _ in range(k)])[0] for _ in range(reps)]
        points.append({"new": [n] * k, "cached": [0] * k, "s": statistics.median(times)})

    steps = [{"batch": batch, "context": context,
              "s": statistics.median(_decode_steps(engine, batch, context, 1000 * next(seed), DECODE_STEPS, reps))}
             for batch, context in decode]
    assert engine.num_free_blocks == engine.num_blocks
    mc = loaded.config
    return {"prefill": points, "decode": steps, "layers": mc.num_layers,
            "kv_bytes_per_token": mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * engine.runner.kv.element_size()}


def _references(points: list[tuple[int, int, int]], reps: int) -> list[dict]:
    import torch

    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import Engine
    from pdserve.shared.engine.loader import load

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    loaded, out = load("smollm2", weights=WEIGHTS), []
    for prompt, batch, context in points:  # an engine of its own each: nothing cached from the one before
        engine = Engine(loaded, EngineConfig(num_blocks=1024, max_batched_tokens=4096, prefill_chunk=2048))
        times = [_prefill_pass(engine, [_ids(prompt, i)])[0] for i in range(reps + 1)]  # the first warms up
        out.append({"prefill_s": statistics.median(times[1:]),
                    "decode_step_s": _decode_steps(engine, batch, context, 100, 4 * reps)[0]})
    return out


def reference(prompt: int, batch: int, context: int, reps: int = 3) -> dict:
    """The isolated costs SLOs are set from (pdserve/planner/slo.py, `make bench`): a `prompt`-token
    prefill alone and a decode step of `batch` sequences of `context` tokens, on all cores."""
    return references([(prompt, batch, context)], reps)[0]


def references(points: list[tuple[int, int, int]], reps: int = 3) -> list[dict]:
    """`reference` at each (prompt, batch, context), in one process: one load of the model."""
    return in_process(_references, points, reps, timeout_s=600)


def shape(threads: int, neighbour: bool, reps: int, points: tuple = (PREFILL, BATCHED, DECODE)) -> dict:
    """One worker shape: `threads` cores, the rest idle or (neighbour) busy."""
    cpus = sorted(os.sched_getaffinity(0))
    mine, rest = cpus[:threads], set(cpus[threads:])
    if not neighbour:
        return in_process(_measure, threads, mine, reps, *points, timeout_s=1800)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    with children(ctx.Process(target=_spin, args=(rest, stop))):
        try:
            return in_process(_measure, threads, mine, reps, *points, timeout_s=1800)
        finally:
            stop.set()


def probe(name: str, reps: int = 2) -> dict:
    """A few of a profiled shape's points measured again (PROBE: ~10 s and the model's load):
    set beside the profile's, they say how far this machine's speed has drifted since
    (pdserve/planner/cost.level)."""
    threads, neighbour = int(name.split("t")[0]), name.endswith("+busy")
    return shape(threads, neighbour, reps, PROBE)


def handoff() -> dict:
    """KV bytes between two processes as the services move them on one host: seconds per payload."""
    from bench.transfer.segment import bench_segment
    sizes = [256 << 10, 1 << 20, 4 << 20, 16 << 20]
    gbps = bench_segment(sizes)
    return {"points": [{"bytes": s, "s": s / (gbps[s] * 1e9)} for s in sizes]}


def control_plane(stack: str, requests: int = 10) -> dict:
    """What the services add to the engine on `make bench`'s stack of that kind (bench/
    interference.arms: "colocated", one worker on all cores; "disaggregated", 1 prefill + 1
    decode worker pinned to a core each): to the first token (a short prompt, one at a time)
    and to each decode step with B streams at once (their TPOT, from which the simulator takes
    its own model of the stack's decode worker shape at that batch: pdserve/planner/cost.
    fit_service_step): publishing, relaying, and the processes beside the engine on the same
    cores."""
    import asyncio

    import httpx
    import torch

    from bench.interference.stacks import arms
    from bench.load.client import run
    from bench.stack_overhead import MESSAGES, engine_ttft, stack_ttft
    from pdserve.local.stack import Stack
    from pdserve.planner.workloads import Request
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import Engine
    from pdserve.shared.engine.loader import load

    cfg = arms()[stack]
    torch.set_num_threads(cfg.threads or 1)
    loaded = load("smollm2", weights=WEIGHTS)
    engine = Engine(loaded, EngineConfig(num_blocks=256))
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(MESSAGES))

    steps = []
    with Stack(cfg) as stack_, httpx.Client(base_url=stack_.url, timeout=60) as http:
        for i in range(3):
            stack_ttft(http, "SmolLM2-135M-Instruct"), engine_ttft(engine, ids, -i - 1)
        over = [stack_ttft(http, "SmolLM2-135M-Instruct") - engine_ttft(engine, ids, i) for i in range(requests)]
        for batch in (1, 4, 8, 16):
            reqs = [Request(0.0, _ids(16, 100 + i), STACK_TOKENS) for i in range(batch)]
            timings, _ = asyncio.run(run(stack_.url, "SmolLM2-135M-Instruct", reqs))
            steps.append({"batch": batch, "tpot_s": statistics.median(t.tpot for t in timings if t.tpot is not None)})
    threads = cfg.threads or 1
    return {"threads": threads, "shape": cost.shape_name(threads, threads < len(os.sched_getaffinity(0))),
            "context": 16 + STACK_TOKENS // 2, "ttft_overhead_s": statistics.median(over), "decode": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ncpu = len(os.sched_getaffinity(0))
    # one core, all of them, and the rest beside one (a disaggregated split's decode worker: bench/interference/stacks)
    ap.add_argument("--threads", default=",".join(map(str, sorted({1, max(1, ncpu - 1), ncpu}))),
                    help="worker shapes, in cores")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-stack", action="store_true", help="skip the control-plane measurement")
    args = ap.parse_args()
    started = time.monotonic()
    shapes = {}
    if device_name() != "cpu":  # one worker a device: one shape, "1t" (the planner's one-worker shape)
        print("CUDA: one worker shape (the whole device); the stack's control plane is not measured here "
              "(this path has not yet run on a GPU)", flush=True)
        raw = in_process(_measure, 1, sorted(os.sched_getaffinity(0)), args.reps, PREFILL, BATCHED, DECODE, "cuda",
                         timeout_s=1800)
        shapes["1t"] = {"threads": 1, "neighbour": False, **raw, **cost.fit(raw)}
        args.threads, args.no_stack = "", True
    todo = [(threads, neighbour) for threads in (int(t) for t in args.threads.split(",") if t)
            for neighbour in ((False, True) if threads < ncpu else (False,))]
    for threads, neighbour in progress(todo, "profiling", unit="shape"):
        name = cost.shape_name(threads, neighbour)
        t0 = time.monotonic()
        raw = shape(threads, neighbour, args.reps)
        shapes[name] = {"threads": threads, "neighbour": neighbour, **raw, **cost.fit(raw)}
        print(f"{name:>14}: prefill {cost.describe_prefill(shapes[name])}; "
              f"decode {cost.describe_decode(shapes[name])} ({time.monotonic() - t0:.0f} s)", flush=True)
    out: dict[str, Any] = {"device": device_name(), "machine": {"cpus": ncpu, "platform": platform.platform(),
                                                "processor": platform.processor()},
           "model": f"SmolLM2-135M-Instruct, PD_WEIGHTS={WEIGHTS}", "shapes": shapes,
           "handoff": cost.fit_handoff(handoff())}
    print(f"handoff: {out['handoff']['fixed_s'] * 1e3:.2f} ms + {out['handoff']['gbps']:.2f} GB/s", flush=True)
    if not args.no_stack:
        out["control_plane"] = {}
        for stack in cost.STACKS:
            cp = out["control_plane"][stack] = in_process(control_plane, stack, timeout_s=900)
            share = cost.fit_service_step(out, stack)  # (the simulator fits it so too: pdserve/planner/cost.py)
            print(f"control plane ({stack}): {cp['ttft_overhead_s'] * 1e3:.1f} ms per request; "
                  + (f"{share['step_fixed_s'] * 1e3:.1f} ms + {share['step_per_seq_s'] * 1e3:.2f} ms per sequence "
                     f"on each decode step over the {share['against']} model's" if share else
                     f"no {cp['shape']} shape profiled to set its decode steps against"), flush=True)
    out["wall_s"] = round(time.monotonic() - started, 1)
    path = RESULTS / f"profile-{out['device']}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path} in {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
