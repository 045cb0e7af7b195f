"""The "Capacity planning" figures of docs/RESULTS.md, from the planner's committed JSON:
profile-cpu.json (`make profile`), plan_check.json and plan_check-no-drift.json (`make
plan-check`), plan-<trace>-cpu-<N>w.json (`make plan`) and sim_speed.json (`python -m
pdserve.planner.speed`). The make targets run `python -m bench.planning.readme` after the planner."""

from __future__ import annotations

import json
from pathlib import Path

from bench.results_doc import RESULTS_DOC, update_block
from pdserve.planner.cost import Cost, fit_service_step

RESULTS = Path(__file__).parents[1] / "results"
BEGIN, END = "<!-- bench:capacity:begin -->", "<!-- bench:capacity:end -->"
PROFILE, CHECK, NO_DRIFT = "profile-cpu.json", "plan_check.json", "plan_check-no-drift.json"
PLANS = {"this machine ({cpus} cores)": "plan-azure_conv_2023-cpu-2w.json",
         "8 cores like these (hypothetical)": "plan-azure_conv_2023-cpu-8w.json"}
SHAPES = {"1t": "1 core", "1t+busy": "1 core beside a busy one", "2t": "2 cores"}


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}"


def _span(row: list[float]) -> str:
    return f"{_ms(min(row))}–{_ms(max(row))} ms"


def profile(p: dict) -> str:
    rows = []
    for name, s in p["shapes"].items():
        m, d = s["prefill_model"], s["decode_model"]
        steps = dict(zip(d["batches"], d["step_s"]))
        rows.append(f"| {SHAPES.get(name, name)} | {1 / m['per_token_s']:.0f}, + {_ms(m['fixed_s'])} | "
                    f"{_span(steps[1])} | {_span(steps[2])} | {_span(steps[32])} | {m['max_rel_error']:.0%} |")
    d = next(iter(p["shapes"].values()))["decode_model"]
    cp = p["control_plane"]
    per_seq = {k: fit_service_step(p, k).get("step_per_seq_s", 0.0) for k in ("colocated", "disaggregated")}
    return "\n".join([
        f"**Profile** (`{PROFILE}`, {p['wall_s']:.0f} s, {p['machine']['cpus']} CPU cores):", "",
        "| shape | prefill (tok/s, + ms per pass) | decode step, batch 1 | batch 2 | batch 32 "
        "| prefill fit's worst error |",
        "|---|---|---|---|---|---|", *rows, "",
        f"The decode ranges span contexts of {d['contexts'][0]}–{d['contexts'][-1]} tokens per sequence; the grid "
        f"has batches {', '.join(map(str, d['batches']))}. The services add "
        f"{_ms(cp['colocated']['ttft_overhead_s'])} ms to the first token on the colocated stack and "
        f"{_ms(cp['disaggregated']['ttft_overhead_s'])} ms on the disaggregated one, and to each decode step "
        f"{per_seq['colocated'] * 1e3:.1f} ms per sequence (colocated) and {per_seq['disaggregated'] * 1e3:.1f} ms "
        f"per sequence (disaggregated), fitted against the cost model's own step for the stack's decode worker. "
        f"The KV handoff runs at {p['handoff']['gbps']:.1f} GB/s."])


def _pair(d: dict, fmt: str) -> str:
    return f"{fmt.format(d['predicted'])} / {fmt.format(d['measured'])}"


def _err(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def check(c: dict, no_drift: dict) -> str:
    s, replay = c["summary"], c["workload"]["replay"]
    rows, drifts = [], []
    for name, a in c["arms"].items():
        label = {"disaggregated": f"disaggregated ({a['layout']})"}.get(name, name)
        rows.append(f"| {label} | {_pair(a['goodput_rate'], '{:.2f}')} | {_err(a['goodput_rate']['error'])} | "
                    f"{_pair({k: a['victim_itl_p99_s'][k] * 1e3 for k in ('predicted', 'measured')}, '{:.0f}')} | "
                    f"{_err(a['victim_itl_p99_s']['error'])} | {a['attainment_error_mean']:.3f} |")
        for level in (a.get("drift") or {}).values():
            drifts.append(f"{name} {level['prefill']:.2f} (prefill) / {level['decode']:.2f} (decode)")
    t = s["targets"]

    def verdict(key: str) -> str:
        return f"**{s[key]:.3f}** against a target of ≤ {t[key]}"

    met = all(s[k] <= t[k] for k in t)
    nd = no_drift["summary"]
    return "\n".join([
        f"**Check** (`{CHECK}`). The SLOs were set from this machine's costs: TTFT ≤ {replay['slo']['ttft_s']:.2f} s, "
        f"TPOT ≤ {replay['slo']['tpot_s'] * 1e3:.0f} ms. Rates were {', '.join(f'{r:g}' for r in replay['rates'])} "
        f"req/s, {replay['seconds_per_rate']:.0f} s of arrivals each. Each arm's probes found it this much slower "
        f"than the profile: {'; '.join(drifts)}.", "",
        "| arm | goodput predicted / measured (req/s) | error | victims' ITL p99 predicted / measured (ms) | error "
        "| attainment error, mean over rates |",
        "|---|---|---|---|---|---|", *rows, "",
        f"- `goodput_error_max` is {verdict('goodput_error_max')}, and `itl_p99_error_max` is "
        f"{verdict('itl_p99_error_max')}: {'both **met**' if met else '**not both met**'}.",
        f"- The same measurements simulated with the profile as it was measured (`--no-drift`, `{NO_DRIFT}`) give "
        f"{nd['goodput_error_max']:.2f} and {nd['itl_p99_error_max']:.2f}.",
        "- An arm whose prediction and measurement both stay under 90% attainment at every rate has a goodput "
        "of 0 on both sides and no goodput error."])


def plan(plans: dict[str, dict], cpus: int) -> str:
    rows, slo = [], None
    for budget, p in plans.items():
        s = p["summary"]
        slo = s.get("slo", slo)
        per_worker = {c["config"]: c["goodput_per_worker"] for c in p["configs"]}
        rows.append(f"| {budget.format(cpus=cpus)} | {s['best_colocated']} "
                    f"({s['best_colocated_goodput_per_worker']:.2f}) | {s['best_disaggregated']} "
                    f"({per_worker[s['best_disaggregated']]:.2f}) | {s['disagg_over_colocated_per_worker']:.2f} |")
    last = list(plans.values())[-1]
    sig = last["summary"]["signals_best_disaggregated"]
    slos = f"; SLOs from the profile: TTFT ≤ {slo['ttft_s']:.2f} s, TPOT ≤ {slo['tpot_s'] * 1e3:.0f} ms" if slo else ""
    head = f"**Plan** ({last['trace']} ÷ {last['scale']}, simulated{slos}):"
    return "\n".join([
        head, "",
        "| budget | best colocated (req/s per worker) | best disaggregated (req/s per worker) "
        "| disaggregated / colocated |",
        "|---|---|---|---|", *rows, "",
        f"At {last['summary']['best_disaggregated']}'s goodput rate on {last['workers']} workers the autoscaling "
        f"signals to hold are ~{sig['queued_prompt_tokens_per_worker']:.0f} queued prompt tokens per prefill worker "
        f"and ~{sig['running_per_decode_worker']:.1f} running sequences per decode worker. These are what the HPAs "
        f"of `deploy/k8s` read."])


def prompt_alone(p: dict, shape: str, tokens: int) -> float:
    """A prompt of `tokens` prefilled alone by a worker of `shape` (the profile's cost model)."""
    return Cost.of(p, shape, None).prefill_s([(tokens, 0)])


def speed(s: dict) -> str:
    s = s["summary"]
    return (f"**Simulator speed** (`python -m pdserve.planner.speed`, `sim_speed.json`): {s['requests']:,} requests "
            f"({s['simulated_s'] / 60:.0f} minutes at {s['rate']:,} req/s) on {s['workers']} workers, with "
            f"{s['costs']} so the fleet carries the load ({s['busy_mean']:.0%} busy), take **{s['wall_s']:.1f} s** "
            f"against a target of < {s['target_wall_s']} s: "
            f"{'met' if s['wall_s'] < s['target_wall_s'] else 'missed'}.")


def section(files: dict[str, dict]) -> str:
    p = files[PROFILE]
    slo = files[PLANS["this machine ({cpus} cores)"]]["summary"]["slo"]
    stop = (f"On {p['machine']['cpus']} cores the one-core prefill worker is what stops 1P:1D: a 500-token prompt "
            f"takes {prompt_alone(p, '1t+busy', 500):.1f} s alone there against the {slo['ttft_s']:.2f} s TTFT bound "
            f"({prompt_alone(p, '2t', 500):.1f} s on two cores).")
    plans = {k: files[v] for k, v in PLANS.items()}
    return "\n\n".join([profile(p), check(files[CHECK], files[NO_DRIFT]), plan(plans, p["machine"]["cpus"]), stop,
                        speed(files["sim_speed.json"])])


def committed() -> dict[str, dict]:
    names = [PROFILE, CHECK, NO_DRIFT, *PLANS.values(), "sim_speed.json"]
    return {n: json.loads((RESULTS / n).read_text()) for n in names}


def write() -> None:
    update_block(RESULTS_DOC, BEGIN, END, section(committed()))


if __name__ == "__main__":
    write()
    print(f"wrote the capacity-planning figures of {RESULTS_DOC}")
