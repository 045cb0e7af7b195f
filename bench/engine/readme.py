"""The engine figures of docs/RESULTS.md, from bench/results/engine.json (`make bench-engine` writes
both; `python -m bench.engine.readme` rewrites the block from the committed JSON): the table and
the ratios between the `bench:engine` markers."""

from __future__ import annotations

import json
from pathlib import Path

from bench.results_doc import RESULTS_DOC, update_block

RESULTS = Path(__file__).parents[1] / "results" / "engine.json"
BEGIN, END = "<!-- bench:engine:begin -->", "<!-- bench:engine:end -->"
ARMS = ["pdserve fp32", "pdserve native", "transformers", "llama.cpp"]


def _cell(v: float | None, digits: int) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def block(out: dict) -> str:
    s, speed, q = out["summary"], out["speed"], out["quality"]
    rows = ["| | pdserve fp32 | pdserve native (4-bit) | transformers fp32 | llama.cpp |", "|---|---|---|---|---|"]
    for n in ("512", "2048"):
        rows.append(f"| prefill, {n} tokens (tok/s) | " + " | ".join(_cell(speed[a]["prefill_tok_s"][n], 0)
                                                                     for a in ARMS) + " |")
    for b in ("1", "8", "32"):
        rows.append(f"| decode step, batch {b} (ms) | " + " | ".join(_cell(speed[a]["decode_ms"][b], 1)
                                                                     for a in ARMS) + " |")
    if q:
        f = q["formats"]
        rows.append("| greedy agreement with transformers fp32 (teacher-forced) | "
                    f"{f['fp32']['greedy_agreement']:.3f} | {f['native']['greedy_agreement']:.3f} | — | — |")
        rows.append(f"| perplexity, {q['perplexity_tokens']:,} tokens (reference {q['reference_perplexity']:.3f}) | "
                    f"{f['fp32']['perplexity']:.3f} | {f['native']['perplexity']:.3f} | "
                    f"{q['reference_perplexity']:.3f} | — |")
    native, fp32 = speed["pdserve native"]["prefill_tok_s"], speed["pdserve fp32"]["prefill_tok_s"]
    met = "met" if s["decode_b1_over_llamacpp"] <= s["decode_b1_over_llamacpp_target"] else "missed"
    lines = [
        f"- `native`'s decode step is {s['native_over_fp32_decode_b1']:.1f}× faster than fp32's at batch 1, "
        f"{s['native_over_fp32_decode_b8']:.1f}× at batch 8, {s['native_over_fp32_decode_b32']:.2f}× at batch 32; "
        f"its prefill runs at {native['512'] / fp32['512']:.2f}× (512 tokens) and "
        f"{native['2048'] / fp32['2048']:.2f}× (2,048) fp32's speed.",
        f"- Decode step at batch 1 against llama.cpp's: **{s['decode_b1_over_llamacpp']:.2f}×** its time "
        f"(`decode_b1_over_llamacpp`; target ≤ {s['decode_b1_over_llamacpp_target']}: **{met}**); prefill "
        f"{s['prefill_512_over_llamacpp']:.1f}× and {s['prefill_2048_over_llamacpp']:.1f}× llama.cpp's speed at "
        f"512 and 2,048 tokens.",
        f"- Structured output: a batch-8 decode step with every sequence under a JSON schema costs "
        f"{s['structured_b8_overhead']:+.1%} (target ≤ {s['structured_b8_overhead_target']:.0%})."]
    if q:
        lines.append(f"- Quality: greedy agreement {s['greedy_agreement']:.3f} (≥ {s['targets']['greedy_agreement']}), "
                     f"perplexity {s['perplexity_ratio']:.4f}× the fp32 reference's "
                     f"(≤ {s['targets']['perplexity_ratio_max']}).")
    m = out["machine"]
    head = (f"`make bench-engine` (`bench/results/engine.json`; {out['threads']} threads of {m['cpus']} CPUs, "
            f"torch {m['torch']}, each figure the median of {out['rounds']} interleaved rounds), one GGUF:")
    return "\n".join([head, "", *rows, "", *lines])


def write(out: dict) -> None:
    update_block(RESULTS_DOC, BEGIN, END, block(out))


if __name__ == "__main__":
    write(json.loads(RESULTS.read_text()))
