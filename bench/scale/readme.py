"""The "Scale" section of docs/RESULTS.md, from bench/results/scale.json (`make bench-scale` writes it;
`python -m bench.scale.readme` writes it again from the committed JSON)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.results_doc import RESULTS_DOC, update_block

RESULTS = Path(__file__).parents[1] / "results"
BEGIN, END = "<!-- bench:scale:begin -->", "<!-- bench:scale:end -->"
STORES_BEGIN, STORES_END = "<!-- bench:stores:begin -->", "<!-- bench:stores:end -->"


def _ms(d: dict | None) -> str:
    return "–" if not d or d.get("p50") is None else f"{d['p50']:.1f} / {d['p99']:.1f}"


def _num(x, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def row(r: dict) -> str:
    d = r.get("decisions") or {}
    hits = "–" if d.get("hit_rate_router") is None else f"{d['hit_rate_router']:.3f} / {d['hit_rate_policy']:.3f}"
    return (f"| {r['workers']} | {r['blocks']:,} | {r['rate']:g} ({r['achieved_rate']:.0f}) | {r['replicas']} | "
            f"{_ms(r.get('decision_ms'))} | {_ms(r.get('placement_ms'))} | "
            f"{_num((r.get('router_cpu_ms_per_placement') or {}).get('net'))} | "
            f"{_num((r.get('redis_cpu_ms_per_placement') or {}).get('net'))} | "
            f"{_num((r.get('nats_per_request') or {}).get('net_in'))} | "
            f"{_num(r.get('redis_bytes_per_block'), '{:.1f}')} | "
            f"{hits} | {r.get('limited_by', '')} |")


def own_split(runs: list[dict], at: dict) -> str:
    """The router's own p99 at W=4 and W=256 in the growth's cell, and its part before the first admit."""
    cell = {r["workers"]: r for r in runs if r["replicas"] == 1 and r["blocks"] == at.get("blocks")
            and r["rate"] == at.get("rate") and r["workers"] in (4, 256)}
    if len(cell) < 2 or not all(r.get("decision_redis_ms") for r in cell.values()):
        return ""
    lo, hi = cell[4], cell[256]
    return (f" ({lo['decision_own_ms']['p99']:.1f} → {hi['decision_own_ms']['p99']:.1f} ms, of which the "
            "lookup, the first choice and the claim in Redis before the first admit "
            f"{lo['decision_redis_ms']['p99']:.1f} → {hi['decision_redis_ms']['p99']:.1f} ms at p99)")


def admit_legs(legs: dict | None) -> str:
    """The admit wait's parts (bench/scale/drive.admit_split), p50 / p99, as a clause."""
    if not legs or any((legs.get(k) or {}).get("p50") is None for k in ("to_worker", "worker", "back")):
        return ""
    return (f"; of its admit wait, p50 / p99 ms: {_ms(legs['to_worker'])} to the simulated decode worker (the "
            f"router's publish, nats-server, the fleet process's loop), {_ms(legs['worker'])} its answer, "
            f"{_ms(legs['back'])} back")


def section(data: dict) -> str:
    s, m = data["summary"], data["machine"]
    met = s.get("targets_met", {})

    def mark(key: str) -> str:
        return {True: "met", False: "missed", None: "not measured"}[met.get(key)]

    cores: dict = next((r["cores"] for r in data["runs"] if r.get("cores")), {})
    where = (f"the router processes pinned to core(s) {cores['router']} and everything else to "
             f"{cores['fleet']} (`bench/scale/pin.py`)" if cores else "everything on the same cores") \
        + ": nats-server, "
    reads = s.get("registry_read_ms") or {}
    index = data["config"].get("prefix_index", "redis")
    lines = [
        f"Measured by `make bench-scale` ({data['mode']} mode, {data.get('duration_s', 0) / 60:.0f} min) on "
        f"{m['cpus']} CPU cores ({m.get('cpu_model', '')}), {where}"
        "redis-server, the router process (1 replica; 3 where marked), the simulated fleet (`bench/scale/fleet.py`: "
        "registry heartbeats, its prefix caches' changes through the workers' own publisher, admits answered, "
        "jobs acked, no KV) and the load driver asking placements as the gateway does. Prompts and cached "
        f"blocks from the Mooncake conversation trace ({data['config'].get('scale', '')}); the index filled "
        f"to B blocks with the same kind of entries. The prefix index: `PD_PREFIX_INDEX={index}` "
        + ("(in each router's memory, fed by the workers' events: Redis holds none of it)." if index == "events"
           else "(in Redis)."),
        "",
        "| W workers | B blocks | req/s offered (achieved) | routers | decision p50 / p99 ms | gateway-observed "
        "p50 / p99 ms | router CPU ms / placement | Redis CPU ms / placement | NATS msgs / request | "
        "Redis bytes / block | hit rate router / policy | limited by |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[row(r) for r in data["runs"]],
        "",
        "- Router CPU per placement (less its idle rate; mean of the runs it kept up with): "
        + ", ".join(f"W={w[1:]} {v:.2f} ms" for w, v in (s.get("router_cpu_ms_per_placement") or {}).items())
        + f" (target ≤ 1 ms, 1,000 placements/s a core: {mark('router_cpu_ms_per_placement')}).",
        f"- Decision p50 / p99 at W=256, B=10M, 100 req/s: {_num(s.get('decision_p50_ms_w256_b10m_r100'))} / "
        f"{_num(s.get('decision_p99_ms_w256_b10m_r100'))} ms (target p99 ≤ 5 ms and ≤ 1.5× p50: "
        f"{mark('decision_p99_ms_w256_b10m_r100')}){admit_legs(s.get('admit_ms_w256_b10m_r100'))}.",
        f"- Decision p99 at W=256, B=10M, 1,000 req/s: {_num(s.get('decision_p99_ms_w256_b10m_r1000'))} ms "
        f"(target ≤ 2 ms: {mark('decision_p99_ms_w256_b10m_r1000')}).",
        f"- p99 growth W=4 → W=256 (B={s.get('growth_measured_at', {}).get('blocks', 0):,}, "
        f"{s.get('growth_measured_at', {}).get('rate', 0):g} req/s): {_num(s.get('decision_p99_growth_w4_to_w256'))}× "
        f"(target ≤ 1.5×: {mark('decision_p99_growth_w4_to_w256')}); without the wait for the simulated "
        f"decode workers' admit answers (the router's own part): {_num(s.get('router_own_p99_growth_w4_to_w256'))}×"
        f"{own_split(data['runs'], s.get('growth_measured_at') or {})}.",
        f"- Redis bytes per indexed block at B={s.get('redis_bytes_per_block_at_blocks', 0):,}: "
        f"{_num(s.get('redis_bytes_per_block'), '{:.1f}')} (target ≤ 100: {mark('redis_bytes_per_block')}).",
        f"- NATS messages per request: {_num(s.get('nats_msgs_per_request_w4'))} at W=4, "
        f"{_num(s.get('nats_msgs_per_request_w256'))} at W=256 ({mark('nats_msgs_per_request_independent_of_w')}).",
        f"- Hit rate equal to the policy's on the same stream: {s.get('hit_rate_same_as_policy')} "
        f"({s.get('hit_rate_checked_runs', '')}).",
        *(["- A router's registry read, side by side in the same runs (median ms): " + ", ".join(
            f"W={w[1:]} {v['changes']:.2f} reading the changes vs {v['whole']:.2f} the whole registry"
            for w, v in reads.items()) + "."] if reads else []),
    ]
    for key, why in (s.get("limited_by") or {}).items():
        lines.append(f"- `{key}` limited by: {why}.")
    lines += ["", "![decision p99 against fleet size](../bench/results/scale.png)", *peer(data.get("peer") or [])]
    return "\n".join(lines)


def peer(runs: list[dict]) -> list[str]:
    """The peer's table (bench/scale/peer.py): vllm-router before as many mock workers."""
    if not runs:
        return []
    return ["", "In the same run, vLLM's Rust router (`vllm-router` 0.1.17) in front of as many mock OpenAI workers "
            "(`bench/scale/peer.py`: each answers at once), fed the same prompts (as text) at the same rates; "
            "added latency = p50 (p99) through it less p50 (p99) straight to the workers; CPU less its idle rate:",
            "", "| policy | W workers | req/s offered | answered | added p50 / p99 ms | CPU ms / request |",
            "|---|---|---|---|---|---|",
            *[f"| {r['policy']} | {r['workers']} | {r['rate']:g} | {r['answered']} of {r['offered']} | "
              f"{_ms(r.get('added_ms'))} | {_num(r.get('cpu_ms_per_request'))} |" for r in runs]]


def update(data: dict) -> None:
    update_block(RESULTS_DOC, BEGIN, END, section(data))


def stores_section(data: dict) -> str:
    """The same cells on one redis-server and on a Redis Cluster (`make bench-scale-stores`)."""
    m, c = data["machine"], data["config"]
    names = sorted({r["store"] for r in data["runs"]}, key=lambda n: (n != "redis", n))
    label = {n: "one redis-server" if n == "redis" else f"a Redis Cluster of {n.removeprefix('cluster')} primaries"
             for n in names}
    rows = [f"| {cell.replace('-', ' ').replace('w', 'W=', 1).replace('b', 'B=', 1).replace('r', '', 1)} req/s | "
            f"{label[n]} | {v['decision_p50_ms']:.1f} / {v['decision_p99_ms']:.1f} | {v['achieved_rate']:g} | "
            f"{_num(v['router_cpu_ms_per_placement'])} | {_num(v['redis_cpu_ms_per_placement'])} |"
            for cell, by in data["summary"].get("by_store", {}).items() for n in names if (v := by.get(n))]
    return "\n".join([
        f"`make bench-scale-stores` ({data['duration_s'] / 60:.0f} min, {m['cpus']} CPU cores, "
        f"{m.get('cpu_model', '')}; {c['seconds']:g} s of arrivals per run): the same fleets, trace and router on "
        f"{' and on '.join(label[n] for n in names)}, one after the other in one run.",
        "", "| cell | store | decision p50 / p99 ms | placed req/s | router CPU ms / placement | "
        "Redis CPU ms / placement (all nodes) |", "|---|---|---|---|---|---|", *rows])


def update_stores(data: dict) -> None:
    update_block(RESULTS_DOC, STORES_BEGIN, STORES_END, stores_section(data))


def main() -> None:
    update(json.loads((RESULTS / "scale.json").read_text()))
    update_stores(json.loads((RESULTS / "scale_stores.json").read_text()))
    print(f"wrote the Scale sections of {RESULTS_DOC.name}")


if __name__ == "__main__":
    main()
