"""Each architecture the engine serves against transformers, on the tiny random checkpoints of
bench/engine/tiny_archs.py (what tests/engine/test_architectures.py asserts, measured):

    python -m bench.engine.architectures     (make bench-archs; ~1 minute)

Writes bench/results/architectures.json (per architecture: greedy tokens equal to transformers'
in fp32, the logits' max abs difference in fp32, and in bf16 beside transformers' own bf16
difference from its fp32; the same fp32 figures from the checkpoint converted to GGUF by
llama.cpp's converter) and the table between the `bench:archs` markers of docs/RESULTS.md.
"""

from __future__ import annotations

import json
import platform
import tempfile
from pathlib import Path

import torch

from bench.engine import tiny_archs
from bench.engine.quality import logits_all, reference_greedy
from bench.results_doc import RESULTS_DOC, update_block
from pdserve.shared.engine.architectures import ARCHITECTURES
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sequence import SamplingParams

RESULTS = Path(__file__).parents[1] / "results" / "architectures.json"
BEGIN, END = "<!-- bench:archs:begin -->", "<!-- bench:archs:end -->"
NEW = 12


def greedy(loaded, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """The engine's greedy tokens for the prompts, run together."""
    engine = Engine(loaded, EngineConfig(num_blocks=512))
    got: dict[str, list[int]] = {k: [] for k in prompts}
    for k, ids in prompts.items():
        engine.add_request(k, ids, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    while engine.has_work():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    return got


def reference(hf, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], list[int], torch.Tensor]:
    """transformers' greedy tokens for each prompt, the long prompt with its tokens, and the
    logits over that."""
    ref = {k: reference_greedy(hf, ids, NEW) for k, ids in prompts.items()}
    ids = prompts["long"] + ref["long"]
    with torch.no_grad():
        return ref, ids, hf(torch.tensor([ids])).logits[0]


def measure(name: str, root: Path, prompts: dict[str, list[int]], gguf: Path) -> dict:
    hf, hf_bf16 = tiny_archs.build(name), tiny_archs.build(name, torch.bfloat16)
    path = tiny_archs.save(name, root)
    ours, ours_bf16 = load(str(path)), load(str(path), dtype=torch.bfloat16)
    ref, ids, want = reference(hf, prompts)
    got = greedy(ours, prompts)
    with torch.no_grad():
        theirs = float((hf_bf16(torch.tensor([ids])).logits[0].float() - want).abs().max())
    return {"model_type": ours.config.arch, "greedy_equal": got == ref,
            "tokens_equal": sum(a == b for k in ref for a, b in zip(got[k], ref[k])),
            "tokens": sum(len(v) for v in ref.values()),
            "fp32_max_abs_logit_diff": float((logits_all(ours, ids) - want).abs().max()),
            "bf16_max_abs_logit_diff": float((logits_all(ours_bf16, ids) - want).abs().max()),
            "transformers_bf16_max_abs_logit_diff": theirs,
            "logit_std": float(want.std()), **measure_gguf(name, gguf, prompts)}


def measure_gguf(name: str, path: Path, prompts: dict[str, list[int]]) -> dict:
    ours = load(str(path))
    ref, ids, want = reference(tiny_archs.gguf_reference(name), prompts)
    return {"gguf_greedy_equal": greedy(ours, prompts) == ref,
            "gguf_fp32_max_abs_logit_diff": float((logits_all(ours, ids) - want).abs().max())}


def table(results: dict) -> str:
    rows = ["| `model_type`: what differs from Llama | tiny checkpoint | greedy = transformers | logits Δ fp32 | "
            "logits Δ bf16 (transformers' bf16) | as GGUF: greedy =, logits Δ |", "|---|---|---|---|---|---|"]
    seen = set()
    for name, r in results["architectures"].items():
        arch = "" if r["model_type"] in seen else f"`{r['model_type']}`: {ARCHITECTURES[r['model_type']]}"
        seen.add(r["model_type"])
        rows.append(f"| {arch} | {name}: {tiny_archs.NOTES[name]} | "
                    f"{'yes' if r['greedy_equal'] else 'no'} ({r['tokens_equal']}/{r['tokens']}) | "
                    f"{r['fp32_max_abs_logit_diff']:.1e} | {r['bf16_max_abs_logit_diff']:.2f} "
                    f"({r['transformers_bf16_max_abs_logit_diff']:.2f}) | "
                    f"{'yes' if r['gguf_greedy_equal'] else 'no'}, {r['gguf_fp32_max_abs_logit_diff']:.1e} |")
    return "\n".join(rows)


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(3, 384, (k,), generator=g).tolist() for n, k in (("short", 9), ("mid", 40),
                                                                                 ("long", 70))}
    with tempfile.TemporaryDirectory() as root:
        files = tiny_archs.save_gguf(list(tiny_archs.configs()), Path(root))
        archs = {name: measure(name, Path(root), prompts, files[name]) for name in tiny_archs.configs()}
    out = {"machine": platform.processor() or platform.machine(), "new_tokens": NEW,
           "prompt_tokens": {k: len(v) for k, v in prompts.items()}, "architectures": archs,
           "summary": {"checkpoints": len(archs), "greedy_equal": sum(r["greedy_equal"] for r in archs.values()),
                       "fp32_max_abs_logit_diff": max(r["fp32_max_abs_logit_diff"] for r in archs.values()),
                       "gguf_greedy_equal": sum(r["gguf_greedy_equal"] for r in archs.values()),
                       "gguf_fp32_max_abs_logit_diff": max(r["gguf_fp32_max_abs_logit_diff"] for r in archs.values()),
                       "bf16_over_transformers_bf16": max(r["bf16_max_abs_logit_diff"]
                                                          / r["transformers_bf16_max_abs_logit_diff"]
                                                          for r in archs.values())}}
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    update_block(RESULTS_DOC, BEGIN, END, table(out))
    print(json.dumps(out["summary"], indent=2))


if __name__ == "__main__":
    main()
