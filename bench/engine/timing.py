"""How `make bench-engine` times an engine: one prompt's prefill pass, and a decode step of a
batch after its prompts, on random token ids from a fixed seed."""

from __future__ import annotations

import random
import time

from bench.engine import structured as structured_bench
from shared.engine.engine import Engine
from shared.engine.sequence import SamplingParams

PROMPT_FOR_DECODE = 128


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


def decode_ms(engine: Engine, batch: int, steps: int, seed: int) -> float:
    """Milliseconds a decode step of `batch` sequences after PROMPT_FOR_DECODE-token prompts."""
    prompts = [random_prompt(PROMPT_FOR_DECODE, seed + i) for i in range(batch)]
    return 1e3 * structured_bench.decode_step(engine, prompts, None, steps)


def greedy(engine: Engine, ids: list[int], new: int) -> list[int]:
    """The engine's greedy continuation of `ids`."""
    engine.add_request("g", ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    out: list[int] = []
    while engine.has_work():
        for o in engine.step():
            out += o.new_token_ids
    return out
