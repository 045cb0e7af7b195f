"""How `make bench-engine` times an implementation: one prompt's prefill pass, and a decode step
of a batch after its prompts, on random token ids from a fixed seed; each arm's figures the
median of rounds interleaved across the arms (`speed`)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from functools import partial

from bench.engine import structured as structured_bench
from bench.engine.llamacpp_arm import LlamaCpp
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.sequence import SamplingParams

PROMPT_FOR_DECODE = 128
PREFILLS = (512, 2048)
BATCHES = (1, 8, 32)
# an arm: prefill(n, seed) -> s; decode(batch, steps, seed) -> s a step (None: not run)
Arm = tuple[Callable[[int, int], float], Callable[[int, int, int], float | None]]


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def prefill_s(engine: Engine, n: int, seed: int) -> float:
    """Seconds of one prefill pass over an n-token prompt."""
    engine.add_request("p", random_prompt(n, seed), SamplingParams(max_tokens=1, temperature=0),
                       prefill_only=True)
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    engine.abort("p")
    return elapsed


def decode_s(engine: Engine, batch: int, steps: int, seed: int) -> float:
    """Seconds a decode step of `batch` sequences after PROMPT_FOR_DECODE-token prompts."""
    prompts = [random_prompt(PROMPT_FOR_DECODE, seed + i) for i in range(batch)]
    return structured_bench.decode_step(engine, prompts, None, steps)


def engine_arm(engine: Engine) -> Arm:
    return partial(prefill_s, engine), partial(decode_s, engine)


def llamacpp_arm(cpp: LlamaCpp) -> Arm:
    """llama.cpp's prefill, and its decode step at batch 1 only (its server runs one sequence a slot)."""
    return (lambda n, s: cpp.prefill(random_prompt(n, s)),
            lambda b, k, s: cpp.decode(random_prompt(PROMPT_FOR_DECODE, s), k) if b == 1 else None)


def speed(run: dict[str, Arm], rounds: int, steps: int) -> dict:
    """Per arm: prompt tokens/s at each of PREFILLS and the decode step (ms) at each of BATCHES."""
    for prefill, _ in run.values():
        prefill(64, 0)  # warm each up
    out: dict = {name: {"prefill_tok_s": {}, "decode_ms": {}} for name in run}
    for n in PREFILLS:
        times: dict[str, list[float]] = {name: [] for name in run}
        for r in range(rounds):  # interleaved so drift on a shared machine hits each alike
            for name, (prefill, _) in run.items():
                times[name].append(prefill(n, r))
        for name, t in times.items():
            out[name]["prefill_tok_s"][str(n)] = n / statistics.median(t)
        print(f"prefill {n}: " + ", ".join(f"{k} {v['prefill_tok_s'][str(n)]:.0f} tok/s" for k, v in out.items()),
              flush=True)
    for b in BATCHES:
        times = {name: [] for name in run}
        for r in range(rounds):
            for name, (_, decode) in run.items():
                if (step := decode(b, steps, 100 * r)) is not None:
                    times[name].append(step)
        for name, t in times.items():
            out[name]["decode_ms"][str(b)] = 1e3 * statistics.median(t) if t else None
        print(f"decode batch {b}: " + ", ".join(f"{k} {v['decode_ms'][str(b)]:.1f} ms" for k, v in out.items()
                                                if v["decode_ms"][str(b)] is not None), flush=True)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def greedy(engine: Engine, ids: list[int], new: int) -> list[int]:
    """The engine's greedy continuation of `ids`."""
    engine.add_request("g", ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    out: list[int] = []
    while engine.has_work():
        for o in engine.step():
            out += o.new_token_ids
    return out
