"""The engine on each weights' format against transformers and llama.cpp on the same GGUF and
threads, measured side by side in one run: `make bench-engine`.

    python -m bench.engine [--threads 2] [--rounds 3] [--decode-steps 16] [--no-quality]

Speed: prompt tokens/s at 512 and 2048 tokens (one prompt, one pass) and the decode step at
batch 1, 8 and 32 — for our engine with fp32 weights (every matrix dequantized) and with the
file's own blocks (`native`, pdserve/shared/engine/weights.py), transformers (fp32, its own KV
cache, only the last position's logits in prefill as its generate() does) and llama.cpp
(batch 1 only: its server runs one sequence a slot); each the median of interleaved rounds.
Structured output (bench/engine/structured.py): the decode step at batch 8 under a JSON schema
against the same prompts unconstrained, per format.
Quality (bench/engine/quality.py): greedy agreement with transformers' fp32 tokens, and
perplexity, per format. Formats (bench/engine/formats.py): the block formats people download
(Q4_K_M, Q8_0, Q4_1 and Gemma 3's Q4_K_M), native against fp32 and llama.cpp, speed and
quality. Mixed load (bench/engine/mixed_load.py): make bench's victims and aggressors on a
1P+1D stack with each weights' format. Writes bench/results/engine.json (`summary`: decode_b1_over_llamacpp,
prefill_512_over_llamacpp, prefill_2048_over_llamacpp, greedy_agreement, perplexity_ratio —
the last two of `native`; structured_b8_overhead, the larger format's; formats.summary's keys:
decode_b1_over_llamacpp_q4_k_m, _q8_0, _q4_1, native_prefill_512_over_fp32, …), with the
machine's CPU features beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from functools import partial
from pathlib import Path

import torch

from bench.engine import formats as engine_formats
from bench.engine import mixed_load
from bench.engine import quality as engine_quality
from bench.engine import readme as engine_readme
from bench.engine import structured as structured_bench
from bench.engine.llamacpp_arm import LlamaCpp
from bench.engine.timing import (
    BATCHES,
    PREFILLS,
    PROMPT_FOR_DECODE,
    Arm,
    engine_arm,
    llamacpp_arm,
    random_prompt,
    ratio,
    speed,
)
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sources import smollm2_path

RESULTS = Path(__file__).parents[1] / "results"


def hf_prefill(model, n: int, seed: int) -> float:
    ids = torch.tensor([random_prompt(n, seed)])
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def hf_decode(model, batch: int, steps: int, seed: int) -> float:
    ids = torch.tensor([random_prompt(PROMPT_FOR_DECODE, seed + i) for i in range(batch)])
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - start) / steps


def arms(threads: int) -> tuple[dict, dict]:
    """Each implementation's prefill(n, seed) and decode(batch, steps, seed) (None: not run)."""
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    cfg = EngineConfig(num_blocks=2048, max_batched_tokens=2048, prefill_chunk=2048, max_num_seqs=64)
    loaded = {f: load("smollm2", weights=f) for f in ("fp32", "native")}
    engines = {f: Engine(m, cfg) for f, m in loaded.items()}
    run: dict[str, Arm] = {f"pdserve {f}": engine_arm(e) for f, e in engines.items()}
    run["transformers"] = (partial(hf_prefill, hf), partial(hf_decode, hf))
    if LlamaCpp.available():
        run["llama.cpp"] = llamacpp_arm(LlamaCpp(str(path), threads))
    else:
        print("llama.cpp: not installed (make bench-engine installs llama-cpp-python)", flush=True)
    return run, {"loaded": loaded, "hf": hf, "engines": engines}


def summarize(speeds: dict, quality: dict | None) -> dict:
    ours = {f: speeds[f"pdserve {f}"] for f in ("fp32", "native")}
    cpp = speeds.get("llama.cpp")
    # each pool runs the format that suits its phase: the faster of ours for each figure
    decode_b1 = min(o["decode_ms"]["1"] for o in ours.values())
    out: dict = {"decode_b1_ms": {f: round(o["decode_ms"]["1"], 2) for f, o in ours.items()},
                 "decode_b1_over_llamacpp": ratio(decode_b1, cpp and cpp["decode_ms"]["1"]),
                 "decode_b1_over_llamacpp_target": 1.2}
    for n in map(str, PREFILLS):
        best = max(o["prefill_tok_s"][n] for o in ours.values())
        out[f"prefill_{n}_over_llamacpp"] = ratio(best, cpp and cpp["prefill_tok_s"][n])
        tok_s = {f: o["prefill_tok_s"][n] for f, o in ours.items()}
        out[f"prefill_{n}_format"] = max(tok_s, key=tok_s.__getitem__)
    for b in map(str, BATCHES):
        out[f"native_over_fp32_decode_b{b}"] = ratio(ours["fp32"]["decode_ms"][b], ours["native"]["decode_ms"][b])
    if quality:
        native = quality["formats"]["native"]
        out["greedy_agreement"] = round(native["greedy_agreement"], 4)
        out["perplexity_ratio"] = round(native["perplexity_ratio"], 5)
        out["targets"] = {"greedy_agreement": 0.95, "perplexity_ratio_max": 1.01}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--no-quality", action="store_true", help="speed only")
    ap.add_argument("--mixed-duration", type=float, default=90.0,
                    help="seconds of the mixed load per weights' format (0: not run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.monotonic()

    run, parts = arms(args.threads)
    speeds = speed(run, args.rounds, args.decode_steps)
    structured = structured_bench.measure(parts["engines"], max(args.rounds, 5), args.decode_steps)
    for engine in parts["engines"].values():
        assert engine.num_free_blocks == engine.num_blocks
    quality = None if args.no_quality else engine_quality.measure(parts["loaded"], parts["hf"])
    del run, parts
    formats = engine_formats.measure(args.threads, args.rounds, args.decode_steps, not args.no_quality) \
        if LlamaCpp.available() else None
    mixed = mixed_load.measure(args.mixed_duration) if args.mixed_duration else None
    if quality:
        for f, q in quality["formats"].items():
            print(f"{f}: greedy agreement {q['greedy_agreement']:.4f}, perplexity {q['perplexity']:.3f} "
                  f"({q['perplexity_ratio']:.4f}x the reference's)", flush=True)
    summary = {**summarize(speeds, quality), **structured_bench.summary(structured),
               **(engine_formats.summary(formats) if formats else {}), **(mixed_load.summary(mixed) if mixed else {})}
    out = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, embeddings Q8_0)", "threads": args.threads,
           "rounds": args.rounds, "decode_steps": args.decode_steps, "decode_prompt_tokens": PROMPT_FOR_DECODE,
           "machine": {"cpus": os.cpu_count(), "processor": platform.processor(), "torch": torch.__version__,
                       "cpu_features": engine_formats.cc_features()},
           "speed": speeds, "structured": structured, "quality": quality, "formats": formats,
           "mixed_load": mixed, "summary": summary,
           "wall_s": round(time.monotonic() - started, 1)}
    (RESULTS / "engine.json").write_text(json.dumps(out, indent=1) + "\n")
    engine_readme.write(out)
    print(json.dumps(summary, indent=1))
    print(f"wrote {RESULTS / 'engine.json'}")


if __name__ == "__main__":
    main()
