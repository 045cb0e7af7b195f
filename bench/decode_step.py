"""Where a decode step's time goes in the stack, between the engine's forward pass and the ITL a
client sees, at batch 1, 8 and 32.

    python -m bench.decode_step [--batches 1 8 32] [--tokens 256] [--reps 1]
                                (writes bench/results/decode_step.json)

Starts the local stack (1 prefill + 1 decode worker, 1 torch thread each, SmolLM2) and, per
batch, sends that many streamed requests at once as bench/load/client.py does (prompt ids,
`ignore_eos`, temperature 0). Everything is read in the steady window: from the moment every
request has its first token to the moment the first one ends (so the batch is whole).

Each batch runs twice. The first run is clean: the ITL p50 at the client (gaps inside the
window), the decode steps in the window, their period (window / steps) and their mean
(`pd_engine_step_seconds` on the decode worker: the engine's whole `step()`), and each
process's CPU per step (/proc). The second run samples the decode worker with py-spy at 100 Hz
(`--threads --idle`: wall time, every thread) and splits its engine thread's time into named
parts, by the innermost frame of ours, each its share of the clean run's period:

    forward        the model (engine/model.py, attention, kernels, projections)
    inputs         the pass's tensors (engine/runner.py)
    scheduler      the schedule and the blocks (scheduler.py, block_manager.py, hashing)
    sampler        sampler.py, logprobs, the grammar's masks
    detokenizer    detokenizer.py / tokenizer.py and the stop checks (sequence.finish_reason)
    engine other   the rest of engine.step (outputs, block commits)
    host           engine_host.py / engine_ahead.py around the step (metrics, the pass record)
    hop            no frame of ours: the executor handing a step's result to the loop
    loop wait      the engine thread idle: waiting for the worker's event loop between two steps

and the event loop's thread the same way (`publish`: the chunks made, signed, logged and put
on the bus; `bus`: the NATS client's own work; `engine calls`; `idle`). A part's share counts
the time a thread waited there for the GIL too. The engine thread's parts add up to the
period; `engine_ms` (forward + sampler) is what an engine called in-process would take, and
`gap_ms` the ITL p50 less that. `--old` names a checkout (`git worktree add /tmp/before
<rev>`) whose stack runs the same measurement first: the result holds both side by side
(`before`, `after`; alone: `now`). The machine's CPU model is written beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.machine import cpu_model

MODEL = "SmolLM2-135M-Instruct"
PROMPT_TOKENS = 16
OUT = Path(__file__).parent / "results" / "decode_step.json"
Parts = tuple[tuple[str, tuple[str, ...]], ...]
ENGINE_PARTS: Parts = (  # (part, markers of the innermost frame of ours), first match wins
    ("forward", ("engine/model.py", "engine/attention.py", "engine/kernels/", "engine/projection.py",
                 "engine/rope.py", "engine/weights.py", "engine/fake.py")),
    ("inputs", ("engine/runner.py", "engine/batch.py", "engine/step_buffers.py", "engine/cuda_graphs.py")),
    ("scheduler", ("engine/scheduler.py", "engine/block_manager.py", "shared/hashing.py")),
    ("sampler", ("engine/sampler.py", "engine/device_sampler.py", "engine/seeded_draw.py", "engine/logprobs.py",
                 "engine/grammar.py")),
    ("detokenizer", ("engine/detokenizer.py", "engine/tokenizer.py", "engine/sequence.py")),
    ("engine other", ("engine/engine.py",)),
    ("host", ("shared/engine_host.py", "shared/engine_ahead.py", "shared/batches.py", "shared/metrics")),
)
LOOP_PARTS: Parts = (
    ("publish", ("DecodeWorker.publish", "DecodeWorker._publish", "decode/chunk_log.py", "shared/macs.py",
                 "shared/messages.py", "shared/bus.py", "shared/tracing.py")),
    ("engine calls", ("shared/engine_host.py", "shared/engine_ahead.py")),
)
OURS = ("pdserve/", "services/", "shared/")
ENTRY = (":<module>", "main.py:main", "service.py:run")  # a service's start: not where its time goes


def frames(stack: str) -> list[str]:
    """py-spy's raw frames ("function (path/file.py:line)"), outermost first: their files."""
    out = []
    for f in stack.split(";"):
        name, _, where = f.partition(" (")
        out.append(f"{where.rsplit(':', 1)[0]}:{name}")
    return out


def part_of(stack: list[str], parts: Parts, idle: bool, idle_part: str, fallback: str) -> str:
    if idle:
        return idle_part
    for frame in reversed(stack):
        if not any(o in frame.rsplit(":", 1)[0] for o in OURS) or frame.endswith(ENTRY):
            continue
        for part, markers in parts:
            if any(m in frame for m in markers):
                return part
        return "other"
    return "bus" if any("nats/" in f for f in stack) else fallback


def spy_threads(raw: Path) -> dict[str, collections.Counter[str]]:
    """py-spy raw output (`--threads --idle`): per thread (engine, loop, other), samples per part.
    A thread is the engine's if any of its stacks passes through engine_host.py's step; the loop
    is the main thread."""
    by_thread: dict[str, list[tuple[list[str], bool, int]]] = collections.defaultdict(list)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        fs = stack.split(";")
        thread = fs[0] if fs[0].startswith("thread (") else "?"
        rest = ";".join(f for f in fs if not f.startswith(("thread (", "process ")) and f)
        stack_frames = frames(rest) if rest else []
        idle = not stack_frames or is_idle(stack_frames)
        by_thread[thread].append((stack_frames, idle, int(count)))
    out: dict[str, collections.Counter[str]] = {}
    for thread, samples in by_thread.items():
        parts: Parts
        if thread.endswith("MainThread"):
            role, parts, fallback = "loop", LOOP_PARTS, "loop"
        elif any("EngineHost.step" in f for s, _, _ in samples for f in s):
            role, parts, fallback = "engine", ENGINE_PARTS, "hop"
        else:
            continue
        counter = out.setdefault(role, collections.Counter())
        for s, idle, n in samples:
            counter[part_of(s, parts, idle, "loop wait" if role == "engine" else "idle", fallback)] += n
    return out


def is_idle(stack: list[str]) -> bool:
    """A thread waiting: the executor's queue, a selector, a lock."""
    top = stack[-1]
    return any(m in top for m in ("queue.py:get", "threading.py:wait", "selectors.py:select", "thread.py:_worker",
                                  "runners.py:Runner.run"))


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks


def step_metric(text: str) -> tuple[float, float]:
    """The decode worker's engine steps so far: (count, seconds)."""
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pd_engine_step_seconds_count":
                count += s.value
            elif s.name == "pd_engine_step_seconds_sum":
                total += s.value
    return count, total


class Window:
    """What is read at the start and the end of the steady window."""

    def __init__(self, stack, pids: dict[str, int]):
        self.stack, self.pids = stack, pids
        self.marks: list[tuple[float, tuple[float, float], dict[str, int]]] = []

    async def mark(self, http: httpx.AsyncClient) -> None:
        text = (await http.get(self.stack.metrics_url("decode-0"))).text
        self.marks.append((time.perf_counter(), step_metric(text),
                           {name: cpu_ticks(pid) for name, pid in self.pids.items()}))

    def result(self) -> dict:
        (t0, (c0, s0), cpu0), (t1, (c1, s1), cpu1) = self.marks[:2]
        steps = max(1.0, c1 - c0)
        tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
        return {"window_s": round(t1 - t0, 3), "steps": int(c1 - c0),
                "period_ms": round(1e3 * (t1 - t0) / steps, 3), "step_ms": round(1e3 * (s1 - s0) / steps, 3),
                "cpu_ms_per_step": {n: round((cpu1[n] - cpu0[n]) * tick_ms / steps, 3) for n in cpu0}}


async def stream(http: httpx.AsyncClient, prompt: list[int], tokens: int, times: list[float],
                 started: asyncio.Event, ended: asyncio.Event) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"token_ids":[' in line and '"token_ids":[]' not in line:
                times.append(time.perf_counter())
                started.set()
    ended.set()


async def run_batch(stack, batch: int, tokens: int, pids: dict[str, int], spy: Path | None, seed: int) -> dict:
    """`batch` streams at once; the window from all started to the first ended."""
    import random

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=batch + 4)
    async with httpx.AsyncClient(base_url=stack.url, timeout=300, limits=limits) as http:
        times: list[list[float]] = [[] for _ in range(batch)]
        starts = [asyncio.Event() for _ in range(batch)]
        ended = asyncio.Event()
        tasks = [asyncio.create_task(stream(http, [rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS)],
                                            tokens, times[i], starts[i], ended)) for i in range(batch)]
        for s in starts:
            await s.wait()
        window = Window(stack, pids)
        await window.mark(http)
        spying = None
        if spy is not None:
            spying = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                                       str(pids["decode"]), "--rate", "100", "--format", "raw", "--threads",
                                       "--idle", "--nonblocking", "--output", str(spy)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await ended.wait()
        await window.mark(http)
        if spying is not None:
            spying.send_signal(2)
        await asyncio.gather(*tasks)
        if spying is not None:
            spying.wait(timeout=60)
    t0, t1 = window.marks[0][0], window.marks[1][0]
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:]) if t0 <= b <= t1]
    out = window.result()
    out["itl_p50_ms"] = round(1e3 * statistics.median(gaps), 3) if gaps else None
    out["itl_gaps"] = len(gaps)
    return out


def split(raw: Path, period_ms: float) -> dict:
    """Per thread, ms per step of each part (the thread's samples scaled to the period)."""
    threads = spy_threads(raw)
    out = {}
    for role in ("engine", "loop"):
        counts = threads.get(role, collections.Counter())
        total = sum(counts.values()) or 1
        out[role] = {part: round(period_ms * n / total, 3) for part, n in counts.most_common()}
    return out


def measure(repo: Path, batches: list[int], tokens: int, reps: int, keep: Path | None) -> dict:
    """The stack of checkout `repo` (run from there: its pdserve is imported), every batch."""
    code = (f"import importlib.util, json, sys; sys.path.insert(0, {str(repo)!r}); "
            f"spec = importlib.util.spec_from_file_location('decode_step', {__file__!r}); "
            f"d = importlib.util.module_from_spec(spec); spec.loader.exec_module(d); "
            f"print('RESULT ' + json.dumps(d.measure_here({batches!r}, {tokens}, {reps}, "
            f"{str(keep) if keep else None!r})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"the stack of {repo} did not measure:\n{proc.stdout[-3000:]}")


def measure_here(batches: list[int], tokens: int, reps: int, keep: str | None) -> dict:
    import pdserve
    from pdserve.local.stack import Stack, StackConfig

    print(f"pdserve from {Path(pdserve.__file__).parent}", file=sys.stderr)
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=2048, threads=1)
    results: dict[str, list[dict]] = {}
    with Stack(cfg) as stack, tempfile.TemporaryDirectory() as tmp:
        folder = Path(keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        pids = {"decode": stack.procs["decode-0"].pid, "gateway": stack.procs["gateway"].pid,
                "prefill": stack.procs["prefill-0"].pid, "bench client": os.getpid()}
        pids.update({name: p.pid for name, p in stack.procs.items() if name.startswith("nats")})
        asyncio.run(run_batch(stack, 2, 32, pids, None, seed=99))  # warm: connections, the first passes
        for rep in range(reps):
            for batch in batches:
                clean = asyncio.run(run_batch(stack, batch, tokens, pids, None, seed=rep))
                raw = folder / f"decode-b{batch}-r{rep}.txt"
                spied = asyncio.run(run_batch(stack, batch, tokens, pids, raw, seed=rep))
                clean["parts_ms"] = split(raw, clean["period_ms"])
                clean["spied"] = {k: spied[k] for k in ("itl_p50_ms", "period_ms", "step_ms")}
                results.setdefault(str(batch), []).append(clean)
                print(f"batch {batch}: {json.dumps(clean)}", file=sys.stderr)
    return {str(b): median_of(runs) for b, runs in results.items()}


def median_of(runs: list[dict]) -> dict:
    """The run with the median ITL of a batch's repetitions (its parts with it), with all ITLs."""
    ordered = sorted(runs, key=lambda r: r["itl_p50_ms"] or 0.0)
    mid = dict(ordered[len(ordered) // 2])
    mid["itl_p50_ms_reps"] = [r["itl_p50_ms"] for r in runs]
    return mid


def row(arm: dict) -> dict:
    """A batch's figures in short: ITL, the step's period, the engine, and the parts."""
    eng = arm["parts_ms"]["engine"]
    engine_ms = round(eng.get("forward", 0.0) + eng.get("sampler", 0.0), 3)
    return {"itl_p50_ms": arm["itl_p50_ms"], "period_ms": arm["period_ms"], "step_ms": arm["step_ms"],
            "engine_ms": engine_ms, "gap_ms": round((arm["itl_p50_ms"] or 0.0) - engine_ms, 3),
            "parts_ms": {k: v for k, v in eng.items() if k != "forward"},
            "loop_ms": {k: v for k, v in arm["parts_ms"]["loop"].items() if k != "idle"},
            "cpu_ms_per_step": arm["cpu_ms_per_step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens of each request (ignore_eos)")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of each batch (the median ITL's is kept)")
    ap.add_argument("--old", help="a checkout of an earlier commit: its stack measured first, side by side")
    ap.add_argument("--keep", help="a folder to keep py-spy's raw stacks in")
    args = ap.parse_args()
    here = Path.cwd()
    arms = {}
    if args.old:
        arms["before"] = measure(Path(args.old).resolve(), args.batches, args.tokens, args.reps,
                                 Path(args.keep) / "before" if args.keep else None)
    arms["after" if args.old else "now"] = measure(here, args.batches, args.tokens, args.reps,
                                                   Path(args.keep) / "now" if args.keep else None)
    summary = {arm: {b: row(r) for b, r in res.items()} for arm, res in arms.items()}
    for arm, rows in summary.items():
        for b, r in rows.items():
            print(f"{arm:6} batch {b:>2}: ITL p50 {r['itl_p50_ms']:6.2f} ms, period {r['period_ms']:6.2f}, "
                  f"step {r['step_ms']:6.2f}, engine {r['engine_ms']:6.2f}, gap {r['gap_ms']:6.2f}  "
                  f"{json.dumps(r['parts_ms'])}  loop {json.dumps(r['loop_ms'])}")
    OUT.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "model_name": cpu_model()},
                               "model": MODEL, "tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS,
                               "reps": args.reps, "summary": summary, "runs": arms}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
