"""Plots and the results section of docs/RESULTS.md, from bench/results/interference.json:

    python -m bench.interference.report        (make bench runs it after the measurements)

- bench/results/itl_cdf.png       the victims' inter-token latency CDF per arm
- bench/results/timeline.png      victims' tokens over time per arm, with the aggressors'
                                  arrivals: a stall is a gap in every stream at once
- bench/results/goodput.png       SLO attainment against request rate on the trace replay
- docs/RESULTS.md                 the text between the `bench:results` markers
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import numpy as np

from bench.results_doc import RESULTS_DOC, update_block

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parents[1] / "results"
ARMS = ("colocated", "chunked", "disaggregated", "llama-server")   # plotted and in the goodput table, where run


def shown(data: dict, replay: bool = False) -> list[str]:
    """The arms of ARMS that ran (with a replay, if asked)."""
    return [a for a in ARMS if a in data["arms"] and (not replay or "replay" in data["arms"][a])]


def suffix(data: dict) -> str:
    """"" for SmolLM2 (make bench's model), "-<model>" for another: its plots' and block's names."""
    source = data.get("model", {}).get("source", "smollm2")
    return "" if source == "smollm2" else f"-{source}"


def markers(data: dict) -> tuple[str, str]:
    name = "results" + suffix(data)
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def plot_itl_cdf(data: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in shown(data):
        xs = np.sort(np.asarray(data["arms"][arm]["victim_itls_s"]) * 1e3)
        if len(xs):
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=arm)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms, log)")
    ax.set_ylabel("fraction of gaps")
    ax.set_title("Victims' inter-token latency while long prompts arrive")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(data: dict, path: Path) -> None:
    arms = shown(data)
    fig, axes = plt.subplots(len(arms), 1, figsize=(9, 2 + 1.7 * len(arms)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    for ax, arm in zip(axes, arms):
        tl = data["arms"][arm]["timeline"]
        for i, times in enumerate(tl["victims"]):
            ax.plot(times, [i] * len(times), "|", markersize=4, color="tab:blue")
        for sent, first in tl["aggressors"]:
            ax.axvline(sent, color="tab:red", alpha=0.5, lw=1)
            if first is not None:
                ax.axvspan(sent, first, color="tab:red", alpha=0.08)
        ax.set_ylabel(f"{arm}\nvictim #")
    axes[-1].set_xlabel("seconds from the start (red: a 1024-token prompt arrives → its first token)")
    axes[0].set_title("Each victim's tokens (one tick each)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_goodput(data: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in shown(data, replay=True):
        pts = data["arms"][arm]["replay"]["points"]
        ax.plot([p["rate"] for p in pts], [p["slo_attainment"] for p in pts], "o-", label=arm)
    ax.axhline(0.9, color="grey", ls="--", lw=1)
    slo = data["workload"]["replay"]["slo"]
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("SLO attainment")
    ax.set_title(f"Azure conversation replay: TTFT ≤ {slo['ttft_s']} s and TPOT ≤ {slo['tpot_s'] * 1e3:.0f} ms")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(data: dict) -> str:
    """The results section of docs/RESULTS.md: the machine, the scale, a table per workload, the ratios."""
    m, w, s = data["machine"], data["workload"], data["summary"]
    va, rp = w["victims_and_aggressors"], w["replay"]
    ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
    cpu = m["processor"] + ", " if m.get("processor") else ""
    lines = [f"Measured by `{command(data)}` ({data['mode']} mode) on "
             f"{m['cpus']} CPU cores ({cpu}{m['platform']}), no GPU; all arms on the same cores, one after the other "
             "in one run: " + ", ".join(text for arm, text in arm_texts(data).items() if arm in data["arms"]) + "."
             " Every worker runs mixed passes (decode tokens and prompt chunks together)." + peer_text(data), "",
             f"**Victims and aggressors** ({va['duration_s']:.0f} s of arrivals, {va['requests']} requests): "
             f"{va['victim']} at {va['victim_rate']}/s while {va['aggressor']} arrive at {va['aggressor_rate']}/s; "
             "TTFT alone: the same victims at the same times with no aggressor, just before" + (
                 "; disaggregated-remote: the disaggregated arm with every prompt sent to the prefill pool "
                 "(PD_PLACEMENT=remote)" if "disaggregated-remote" in data["arms"] else "") + ".", "",
             "| arm | victim ITL p50 (ms) | ITL p99 (ms) | ITL p99.9 (ms) | longest gap (s) | TTFT p50 (s) | "
             "TTFT p99 (s) | TTFT p99.9 (s) | TTFT p99 alone (s) | TPOT p50 (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in data["arms"]:
        v, t = data["arms"][arm]["victims"], s["ttft_victims_s"][arm]
        lines.append(f"| {arm} | {ms(v['itl_s']['p50'])} | {ms(v['itl_s']['p99'])} | {ms(s['itl_p999_s'][arm])} | "
                     f"{v['max_gap_s']:.2f} | {t['victims']['p50']:.2f} | {t['victims']['p99']:.2f} | "
                     f"{t['victims']['p99.9']:.2f} | {t['alone']['p99']:.2f} | {ms(v['tpot_s']['p50'])} |")
    lines += ["", f"**Goodput** on the Azure conversation trace (lengths ÷ {rp['scale']:g}: "
              f"{rp['mean_prompt_tokens']:.0f} prompt / {rp['mean_output_tokens']:.0f} output tokens on average), "
              f"Poisson arrivals at {', '.join(f'{r:g}' for r in rp['rates'])} req/s for "
              f"{rp['seconds_per_rate']:g} s each; goodput = the highest rate "
              f"with ≥ 90% of requests within TTFT ≤ {rp['slo']['ttft_s']} s and TPOT ≤ "
              f"{ms(rp['slo']['tpot_s'])} ms" + (f" ({rp['slo']['how']})" if rp["slo"].get("how") else "") + ".", "",
              "| arm | " + " | ".join(f"attainment at {r:g}/s" for r in rp["rates"]) + " | goodput (req/s) |",
              "|---|" + "---|" * (len(rp["rates"]) + 1)]
    for arm in shown(data, replay=True):
        rep = data["arms"][arm]["replay"]
        lines.append(f"| {arm} | " + " | ".join(f"{p['slo_attainment']:.2f}" for p in rep["points"]) +
                     f" | {rep['goodput_rate']:.2f} |")
    lines += ["", "| ratio (target) | measured |", "|---|---|"]
    targets = {"ttft_p99_victims_over_alone_disagg": "≤ 2",
               "ttft_p99_victims_over_alone_disagg_remote": "reported",
               "itl_p99_colocated_over_disagg": "≥ 10", "itl_p99_chunked_over_disagg": "≥ 2",
               "itl_p999_colocated_over_disagg": "reported", "itl_p999_chunked_over_disagg": "reported",
               "max_gap_disagg_s": "≤ 1 s", "ttft_p50_disagg_over_colocated": "reported",
               "goodput_disagg_over_colocated": "≥ 1.5", "goodput_disagg_over_chunked": "reported",
               "itl_p50_disagg_over_llama_server": "≤ 1.0", "itl_p99_disagg_over_llama_server": "reported",
               "ttft_p99_disagg_over_llama_server": "≤ 0.5", "max_gap_disagg_over_llama_server": "≤ 0.5",
               "goodput_disagg_over_llama_server": "≥ 1.5"}
    for key, target in targets.items():
        if any(a not in data["arms"] for a in key_arms(key)):
            continue
        lines.append(f"| `{key}` ({target}) | {s[key] if s.get(key) is not None else 'n/a'} |")
    x = suffix(data)
    lines += ["", f"![victims' ITL CDF](../bench/results/itl_cdf{x}.png)",
              f"![token timeline](../bench/results/timeline{x}.png)",
              f"![SLO attainment against rate](../bench/results/goodput{x}.png)"]
    return "\n".join(lines)


def command(data: dict) -> str:
    """The make target (or command) that measured `data`."""
    argv = data.get("argv")
    if argv is None:   # (a run before the command was recorded)
        return f"make bench{'-full' if data['mode'] == 'full' else ''}"
    return {"": "make bench", "--full": "make bench-full",
            "--model gemma3-270m --arms disaggregated,llama-server": "make bench-gemma"}.get(
        " ".join(argv), "python -m bench.interference " + " ".join(argv))


def arm_texts(data: dict) -> dict[str, str]:
    lent = ("a thread each, the decode worker stepping on the prefill worker's thread too between that worker's "
            "passes: PD_CORE_BOARD" + ("; disaggregated-pinned: one core each, nothing lent"
                                       if "disaggregated-pinned" in data["arms"] else ""))
    return {"colocated": "colocated (one worker, whole prompts in a pass)",
            "chunked": "chunked (one worker, vLLM's chunked prefill: each pass holds every running stream's decode "
                       "token and at most 128 tokens of each prompt, 256 tokens in all)",
            "disaggregated": "disaggregated (1 prefill + 1 decode worker, " + (
                lent if data.get("lent_cores") else "one core each") + "; a short prompt that would queue behind a "
                "long one is prefilled beside the decode worker's streams: PD_PLACEMENT=cheapest)"}


def key_arms(key: str) -> list[str]:
    """The arms a summary key compares (both must have run for it to be shown)."""
    names = {"colocated": "colocated", "chunked": "chunked", "disagg": "disaggregated", "llama_server": "llama-server"}
    return [arm for word, arm in names.items() if word in key]


def peer_text(data: dict) -> str:
    if "llama-server" not in data["arms"]:
        return ""
    return (f" llama-server: llama.cpp's server ({data.get('peer') or 'its build'}) on the same GGUF "
            f"({data['model']['file']}) and all {data['machine']['cpus']} cores, 8 slots, continuous batching, "
            "prompts in 512-token micro-batches beside the other slots' decode tokens (its defaults).")


def write_all(data: dict) -> None:
    x = suffix(data)
    plot_itl_cdf(data, RESULTS / f"itl_cdf{x}.png")
    plot_timeline(data, RESULTS / f"timeline{x}.png")
    plot_goodput(data, RESULTS / f"goodput{x}.png")
    update_block(RESULTS_DOC, *markers(data), section(data))
    print(f"wrote {RESULTS}/itl_cdf{x}.png, timeline{x}.png, goodput{x}.png and a results section of "
          f"{RESULTS_DOC.name}")


if __name__ == "__main__":
    import sys

    write_all(json.loads((RESULTS / (sys.argv[1] if len(sys.argv) > 1 else "interference.json")).read_text()))
