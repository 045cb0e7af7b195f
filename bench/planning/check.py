"""The planner's predictions against the real system: `make plan-check`.

    python -m bench.planning.check [--profile bench/results/profile-cpu.json] [--measured RESULT.json]

Runs the three arms of `make bench` (bench/interference/run.py, quick mode: colocated, chunked,
disaggregated on this machine's cores, the SLOs from this machine's costs), and a fourth with
another P:D ratio (1P:2D: the prefill worker on one core, two one-thread decode workers sharing
the rest, `split_arm`), and simulates the same four on the very workloads they ran — the same
seeded victims and aggressors, the same slices of the Azure trace at the same rates, the same
SLOs — with the cost models of the profile; then sets each prediction beside what was
measured: goodput at 90% SLO attainment, the victims' ITL p99 and TTFT p50, the attainment at
each rate. `make plan-check` measures the
profile just before, and a probe of each arm's worker shapes either side of it (a few of the
profile's points again, bench/profile.probe): a machine's speed drifts over minutes, and each
arm's prediction takes the profile's costs rescaled by its probes (pdserve/planner/cost.level;
`--no-drift`: as profiled). `--measured` compares
with a `make bench` result (or an earlier plan_check.json's measurements) instead of running
the arms. Writes bench/results/plan_check.json
(`summary`: goodput_error_max, itl_p99_error_max over make bench's three arms; the 1P:2D
arm's errors beside them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.interference import run as interference
from bench.interference import stacks
from bench.planning.profile import probe
from pdserve.local.stack import StackConfig
from pdserve.planner import workloads
from pdserve.planner.cluster import Layout, as_sim, simulate
from pdserve.planner.cost import STACKS, Cost, control_plane, level
from pdserve.planner.device import device_name
from pdserve.planner.slo import Slo, goodput, score
from pdserve.planner.worker import Knobs

RESULTS = Path(__file__).parents[1] / "results"
SPLIT = "1P:2D"
WHOLE = {"PD_PREFILL_CHUNK": "2048", "PD_MAX_BATCHED_TOKENS": "4096"}
# make bench's quick rates (1, 2, 4) leave goodput to a line between two of them: finer here, low
# enough for a slow machine (goodput 0.6 req/s on one), and 30 s of arrivals per rate instead of
# 20 (8-90 requests: a point's attainment is a sample)
RATES = "0.25,0.5,0.75,1,1.5,2,3"
REPLAY_S = "30"
NO_DRIFT = {"prefill": 1.0, "decode": 1.0}


def split_arm(cores: int) -> StackConfig:
    """A P:D ratio other than 1:1 on these cores: 1 prefill worker on the first core, 2 decode
    workers sharing the others (each one thread)."""
    cpus = sorted(stacks.ALL)[:cores]
    rest = set(cpus[1:]) or {cpus[0]}
    return StackConfig.on_free_ports(prefill=1, decode=2, kv_blocks=2048, threads=1, env=WHOLE,
                                     cpus={"prefill-0": {cpus[0]}, "decode-0": rest, "decode-1": rest})


def arm_shapes(cores: int) -> dict[str, dict[str, str]]:
    """The profiled worker shape of each arm's pools (bench/interference/stacks.arms, `split_arm`)."""
    return {"colocated": {"decode": f"{cores}t"}, "chunked": {"decode": f"{cores}t"},
            # the prefill worker on one core, the decode worker on the others
            "disaggregated": {"prefill": "1t+busy", "decode": f"{cores - 1}t+busy"},
            # one-thread decode workers, two on the cores that are not the prefill worker's
            SPLIT: {"prefill": "1t+busy", "decode": "1t+busy"}}


def bench_layouts(profile: dict, cores: int, levels: dict[str, dict[str, dict]] | None = None) -> dict[str, Layout]:
    """`make bench`'s arms (bench/interference/stacks.arms) and `split_arm` as the simulator's layouts;
    `levels`: each arm's drift from the profile, per shape (pdserve/planner/cost.level), where measured."""
    over = {s: control_plane(profile, s).get("ttft_overhead_s", 0.0) for s in STACKS}
    whole = Knobs(prefill_chunk=2048, max_batched_tokens=4096)
    chunked = Knobs(prefill_chunk=128, max_batched_tokens=256)
    shapes = arm_shapes(cores)

    def cost(arm: str, pool: str) -> Cost:
        shape = shapes[arm][pool]
        stack = "colocated" if arm in ("colocated", "chunked") else "disaggregated"
        return Cost.of(profile, shape, stack).scaled(**(levels or {}).get(arm, {}).get(shape, NO_DRIFT))

    per_core = max(1, round(2 / max(1, cores - 1)))
    return {"colocated": Layout("colocated", decode=1, decode_cost=cost("colocated", "decode"), decode_knobs=whole,
                                overhead_s=over["colocated"]),
            "chunked": Layout("colocated", decode=1, decode_cost=cost("chunked", "decode"), decode_knobs=chunked,
                              overhead_s=over["colocated"]),
            "disaggregated": Layout("disaggregated", prefill=1, decode=1, decode_cost=cost("disaggregated", "decode"),
                                    prefill_cost=cost("disaggregated", "prefill"), decode_knobs=whole,
                                    prefill_knobs=whole, overhead_s=over["disaggregated"]),
            SPLIT: Layout("disaggregated", prefill=1, decode=2, decode_cost=cost(SPLIT, "decode"),
                          prefill_cost=cost(SPLIT, "prefill"), decode_knobs=whole, prefill_knobs=whole,
                          overhead_s=over["disaggregated"], decode_per_core=per_core)}


def drift(profile: dict, probes: dict[str, list[dict]]) -> dict[str, dict]:
    """An arm's level per shape: the mean of its probes' (one before the arm, one after) against
    the profile (pdserve/planner/cost.level)."""
    out = {}
    for shape, runs in probes.items():
        each = [level(profile["shapes"][shape], r) for r in runs]
        out[shape] = {k: sum(e[k] for e in each) / len(each) for k in NO_DRIFT}
    return out


def measure(seed: int) -> dict:
    """make bench's three arms here, now (quick mode), as interference.json holds them."""
    args = interference.parse(["--seed", str(seed), "--rates", RATES, "--replay-s", REPLAY_S])
    reqs = workloads.victims_and_aggressors(args.duration, args.victim_rate, aggressor_rate=args.aggressor_rate,
                                            seed=seed)
    trace = workloads.trace(interference.AZURE, scale=args.scale, limit=max(8, round(max(args.rates) * args.replay_s)),
                            seed=seed)
    slo = interference.slo_for(trace, args)
    print(f"replay SLO: {slo}", flush=True)
    configs = {**stacks.arms(), SPLIT: split_arm(len(stacks.ALL))}
    shapes = arm_shapes(len(stacks.ALL))
    arms = {}
    for name, cfg in configs.items():
        # this machine's speed drifts over minutes: the arm's own shapes measured again either side of it
        before = {s: probe(s) for s in set(shapes[name].values())}
        arms[name] = interference.one_arm(name, cfg, reqs, trace, args)
        del arms[name]["timeline"], arms[name]["victim_itls_s"]
        arms[name]["probes"] = {s: [before[s], probe(s)] for s in before}
    return {"machine": {"cpus": len(stacks.ALL)},
            "workload": {"seed": seed,
                         "victims_and_aggressors": {"duration_s": args.duration, "victim_rate": args.victim_rate,
                                                    "aggressor_rate": args.aggressor_rate,
                                                    "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}},
                         "replay": {"seconds_per_rate": args.replay_s, "scale": args.scale, "rates": args.rates,
                                    "slo": {"ttft_s": args.replay_slo_ttft, "tpot_s": args.replay_slo_tpot,
                                            "how": slo.how}}},
            "arms": arms}


def error(predicted: float, measured: float) -> float | None:
    return abs(predicted - measured) / measured if measured else None


def summarize(arms: dict, levels: dict) -> dict:
    """The largest errors over make bench's three arms (the other P:D ratio reported beside them)."""
    errs = lambda k: [a[k]["error"] for n, a in arms.items() if n != SPLIT and a[k]["error"] is not None]  # noqa: E731
    summary = {"goodput_error_max": max(errs("goodput_rate"), default=None),
               "itl_p99_error_max": max(errs("victim_itl_p99_s"), default=None),
               "ttft_p50_error_max": max(errs("victim_ttft_p50_s"), default=None),
               "targets": {"goodput_error_max": 0.15, "itl_p99_error_max": 0.25}}
    summary["attainment_error_mean"] = {n: round(a["attainment_error_mean"], 3) for n, a in arms.items()}
    summary["drift"] = {n: {s: {k: round(v, 3) for k, v in d.items()} for s, d in levels[n].items()} for n in levels}
    if SPLIT in arms:
        summary[SPLIT] = {k: arms[SPLIT][k]["error"] for k in ("goodput_rate", "victim_itl_p99_s", "victim_ttft_p50_s")}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, help="default: this machine's (bench/results/profile-<device>.json)")
    ap.add_argument("--measured", type=Path, help="a make bench result (interference.json) instead of running the arms")
    ap.add_argument("--seed", type=int, default=0, help="make bench's --seed")
    ap.add_argument("--out", type=Path, default=RESULTS / "plan_check.json")
    ap.add_argument("--no-drift", action="store_true", help="simulate with the profile's costs as they are, not "
                    "rescaled by the probes measured either side of each arm")
    args = ap.parse_args()
    args.profile = args.profile or RESULTS / f"profile-{device_name()}.json"
    profile = json.loads(args.profile.read_text())
    measured = json.loads(args.measured.read_text()) if args.measured else measure(args.seed)
    if "measured_arms" in measured:  # an earlier plan_check.json: its measurements, simulated again
        measured = {"machine": profile["machine"], **measured, "arms": measured["measured_arms"],
                    "measured": "measured right after the profile (simulated again since)"}
    seed = measured["workload"].get("seed", args.seed)
    w = measured["workload"]
    va, rp = w["victims_and_aggressors"], w["replay"]
    victims = workloads.victims_and_aggressors(va["duration_s"], va["victim_rate"],
                                               aggressor_rate=va["aggressor_rate"], seed=seed)
    trace = workloads.trace(interference.AZURE, scale=rp["scale"],
                            limit=max(8, round(max(rp["rates"]) * rp["seconds_per_rate"])), seed=seed)

    def at_rate(rate: float):
        return as_sim(workloads.retimed(trace[:max(8, round(rate * rp["seconds_per_rate"]))], rate, seed=seed))

    slo = Slo(rp["slo"]["ttft_s"], rp["slo"]["tpot_s"])
    victim_slo = Slo(va["slo"]["ttft_s"], va["slo"]["tpot_s"])
    arms: dict[str, dict[str, Any]] = {}
    levels = {} if args.no_drift else {name: drift(profile, m["probes"]) for name, m in measured["arms"].items()
                                        if m.get("probes")}
    for name, layout in bench_layouts(profile, measured["machine"]["cpus"], levels).items():
        if name not in measured["arms"]:  # (a make bench result has no split_arm)
            continue
        for shape, d in levels.get(name, {}).items():
            print(f"{name:14} {shape}: {d['prefill']:.2f}x the profile's prefill time, {d['decode']:.2f}x its decode "
                  "steps (probes either side of the arm)", flush=True)
        v = score(simulate(layout, as_sim(victims)), victim_slo, layout.overhead_s, kind="victim")
        g = goodput(layout, at_rate, rp["rates"], slo)
        m = measured["arms"][name]
        arms[name] = {
            "layout": layout.name, "drift": levels.get(name),
            "goodput_rate": {"predicted": g["goodput_rate"], "measured": m["replay"]["goodput_rate"]},
            "victim_itl_p99_s": {"predicted": v["itl_s"]["p99"], "measured": m["victims"]["itl_s"]["p99"]},
            "victim_ttft_p50_s": {"predicted": v["ttft_s"]["p50"], "measured": m["victims"]["ttft_s"]["p50"]},
            "attainment": [{"rate": p["rate"], "predicted": p["slo_attainment"], "measured": q["slo_attainment"]}
                           for p, q in zip(g["points"], m["replay"]["points"])],
        }
        for k in ("goodput_rate", "victim_itl_p99_s", "victim_ttft_p50_s"):
            arms[name][k]["error"] = error(arms[name][k]["predicted"], arms[name][k]["measured"])
        # the whole curve, not only where it crosses 90% (a goodput of 0 on both sides says little)
        points = arms[name]["attainment"]
        errors = [abs(p["predicted"] - p["measured"]) for p in points]
        arms[name]["attainment_error_mean"] = sum(errors) / max(1, len(errors))
        g, i, t = (arms[name][k] for k in ("goodput_rate", "victim_itl_p99_s", "victim_ttft_p50_s"))
        print(f"{name:14} goodput predicted {g['predicted']:.2f} measured {g['measured']:.2f} req/s; victims' "
              f"ITL p99 predicted {i['predicted'] * 1e3:.0f} measured {i['measured'] * 1e3:.0f} ms; TTFT p50 "
              f"predicted {t['predicted']:.2f} measured {t['measured']:.2f} s", flush=True)
    summary = summarize(arms, levels)
    origin = measured.get("measured") if "measured_arms" in measured else None  # kept through a re-simulation
    out = {"profile": args.profile.name,
           "measured": origin or (args.measured.name if args.measured else "measured here, right after the profile"),
           "profile_machine": profile["machine"], "machine": measured["machine"],
           "workload": {**measured["workload"], "seed": seed}, "arms": arms,
           "measured_arms": measured["arms"], "summary": summary}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
