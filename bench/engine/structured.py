"""What structured output adds to a decode step: batch 8, every sequence under a JSON schema,
against the same prompts unconstrained, interleaved rounds, fp32 and native weights.

    python -m bench.engine.structured [--threads 2] [--rounds 5] [--steps 16]

`make bench-engine` runs it as part of its run; alone, it replaces the `structured` part of
bench/results/engine.json (and its summary keys), leaving the rest as that run wrote it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.grammar import Grammar
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sequence import SamplingParams

RESULTS = Path(__file__).parents[1] / "results"
BATCH = 8
TARGET = 0.10  # at most this much longer a step
CITY = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
    "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    "famous_for": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    "continent": {"enum": ["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]}},
    "required": ["name", "country", "population_millions", "famous_for", "continent"],
    "additionalProperties": False}
CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Sydney", "Toronto", "Berlin", "Mumbai"]


def prompts(engine: Engine) -> list[list[int]]:
    tok = engine.tokenizer
    assert tok is not None
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Describe {c} as JSON."}]))
            for c in CITIES[:BATCH]]


def decode_step(engine: Engine, batch: list[list[int]], grammar: Grammar | None, steps: int) -> float:
    """Seconds per decode step of `batch` (greedy), once every prompt is prefilled; every
    sequence runs through the measured steps (a schema's answer runs past `steps` tokens)."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True, grammar=grammar)
    for i, ids in enumerate(batch):
        engine.add_request(f"s{i}", ids, params)
    while any(s.status.value == "waiting" for s in engine.seqs.values()):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    running = sum(s.status.value == "running" for s in engine.seqs.values())
    assert running == len(batch), f"{len(batch) - running} sequences ended inside the measured steps"
    for i in range(len(batch)):
        engine.abort(f"s{i}")
    return elapsed


def measure(engines: dict[str, Engine], rounds: int, steps: int) -> dict:
    grammar = Grammar("json_schema", json.dumps(CITY))
    out: dict = {"batch": BATCH, "steps": steps, "rounds": rounds, "schema": CITY, "formats": {}}
    for fmt, engine in engines.items():
        batch = prompts(engine)
        decode_step(engine, batch, grammar, 2)  # warm: the schema compiled, the matchers' caches
        times: dict[str, list[float]] = {"plain": [], "json_schema": []}
        for _ in range(rounds):  # interleaved: drift on a shared machine hits both alike
            times["plain"].append(decode_step(engine, batch, None, steps))
            times["json_schema"].append(decode_step(engine, batch, grammar, steps))
        plain, constrained = (1e3 * statistics.median(t) for t in times.values())
        out["formats"][fmt] = {"plain_ms": round(plain, 2), "json_schema_ms": round(constrained, 2),
                               "overhead": round(constrained / plain - 1, 4)}
        print(f"structured output, {fmt}, batch {BATCH}: {plain:.1f} ms plain, {constrained:.1f} ms under "
              f"a JSON schema ({constrained / plain - 1:+.1%})", flush=True)
    return out


def summary(structured: dict) -> dict:
    worst = max(f["overhead"] for f in structured["formats"].values())
    return {"structured_b8_overhead": worst, "structured_b8_overhead_target": TARGET}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(num_blocks=2048, max_batched_tokens=2048, prefill_chunk=2048, max_num_seqs=64)
    engines = {f: Engine(load("smollm2", weights=f), cfg) for f in ("fp32", "native")}
    structured = measure(engines, args.rounds, args.steps)
    structured["measured"] = time.strftime("%Y-%m-%d") + " (python -m bench.engine.structured, alone)"
    path = RESULTS / "engine.json"
    result = json.loads(path.read_text())
    result["structured"] = structured
    result["summary"].update(summary(structured))
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary(structured), indent=1))


if __name__ == "__main__":
    main()
