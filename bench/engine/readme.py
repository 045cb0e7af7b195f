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
    head = (f"`make bench-engine` (`bench/results/engine.json`; {out['threads']} threads of {m['cpus']} CPUs "
            f"({', '.join(m.get('cpu_features', [])) or 'features not recorded'}), torch {m['torch']}, each figure "
            f"the median of {out['rounds']} interleaved rounds), one GGUF:")
    return "\n".join([head, "", *rows, "", *lines, *formats_block(out), *mixed_block(out)])


def mixed_block(out: dict) -> list[str]:
    """The victims' tokens under a mixed load, per weights' format."""
    m = out.get("mixed_load")
    if not m:
        return []
    rows = ["", f"Mixed load, per weights' format (`bench/engine/mixed_load.py`: `make bench`'s victims and "
                f"aggressors for {m['duration_s']:.0f} s on {m['arm']}, both pools on the format):", "",
            "| `PD_WEIGHTS` | victims' inter-token p50 (ms) | p99 (ms) | longest gap (s) | TTFT p99 (s) | "
            "TTFT p99 alone (s) |", "|---|---|---|---|---|---|"]
    for fmt, f in m["formats"].items():
        rows.append(f"| {fmt} | {f['itl_p50_ms']:.1f} | {f['itl_p99_ms']:.1f} | {f['max_gap_s']:.2f} | "
                    f"{f['ttft_p99_s']:.2f} | {f['ttft_p99_alone_s']:.2f} |")
    return rows


def formats_block(out: dict) -> list[str]:
    """The formats people download, native against fp32 and llama.cpp on each file."""
    if not out.get("formats"):
        return []
    s, t = out["summary"], out["summary"]["format_targets"]
    rows = ["", "Each file computed with as it is (`native`) against its fp32 dequantization and llama.cpp "
                "(`bench/engine/formats.py`; the SmolLM2 files re-quantized from its Q4_1 by llama.cpp):", "",
            "| file (block formats) | prefill 512 tok/s: native / fp32 / llama.cpp | prefill 2,048 | "
            "decode batch 1 ms: native / llama.cpp | batch 8 ms: native / fp32 | batch 32 | greedy agreement "
            "| perplexity: native / llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    for name, f in out["formats"].items():
        sp, q = f["speed"], f.get("quality")
        pre = [" / ".join(_cell(sp[a]["prefill_tok_s"][n], 0) for a in ("native", "fp32", "llama.cpp"))
               for n in ("512", "2048")]
        dec = [" / ".join(_cell(sp[a]["decode_ms"][b], 1) for a in arms)
               for b, arms in (("1", ("native", "llama.cpp")), ("8", ("native", "fp32")), ("32", ("native", "fp32")))]
        ppl = q and f"{q['perplexity']['native']:.3f} / {q['perplexity']['llama.cpp']:.3f}"
        qual = [f"{q['greedy_agreement']:.3f}", ppl] if q else ["—", "—"]
        rows.append(f"| {name} ({', '.join(f['formats'])}) | " + " | ".join([*pre, *dec, *qual]) + " |")
    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    b1 = [s[f"decode_b1_over_llamacpp_{k}"] for k in ("q4_k_m", "q8_0", "q4_1")]
    gemma = s["decode_b1_over_llamacpp_gemma3_q4_k_m"]
    prefill = min(s["native_prefill_512_over_fp32"], s["native_prefill_2048_over_fp32"])
    rows += ["", f"- Decode step at batch 1 against llama.cpp's: Q4_K_M **{b1[0]:.2f}×**, Q8_0 **{b1[1]:.2f}×**, "
                 f"Q4_1 **{b1[2]:.2f}×** its time, Gemma 3's Q4_K_M **{gemma:.2f}×** "
                 f"(target ≤ {t['decode_b1_over_llamacpp']}, ≤ {t['decode_b1_over_llamacpp_worst']} at worst: "
                 f"{verdict(max(*b1, gemma) <= t['decode_b1_over_llamacpp_worst'])}).",
             f"- Native prefill against fp32's, the worst file's: **{s['native_prefill_512_over_fp32']:.2f}×** at 512 "
             f"tokens, **{s['native_prefill_2048_over_fp32']:.2f}×** at 2,048 (target ≥ "
             f"{t['native_prefill_over_fp32']}: {verdict(prefill >= t['native_prefill_over_fp32'])}); "
             f"against llama.cpp's {s['native_prefill_512_over_llamacpp']:.1f}× and "
             f"{s['native_prefill_2048_over_llamacpp']:.1f}× (target ≥ {t['native_prefill_over_llamacpp']})."]
    if "greedy_agreement_min" in s:
        rows.append(f"- Quality: greedy agreement with the fp32 dequantization {s['greedy_agreement_min']:.3f} at "
                    f"worst (≥ {t['greedy_agreement']}), perplexity at most {s['perplexity_over_llamacpp_max']:.4f}× "
                    f"llama.cpp's on the same file (≤ {t['perplexity_over_llamacpp_max']}).")
    return rows


def write(out: dict) -> None:
    update_block(RESULTS_DOC, BEGIN, END, block(out))


if __name__ == "__main__":
    write(json.loads(RESULTS.read_text()))
