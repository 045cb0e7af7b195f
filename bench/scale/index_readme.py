"""The "Prefix index: Redis or router memory" table of docs/RESULTS.md, from
bench/results/prefix_index_compare.json (`make bench-index` writes both)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.results_doc import RESULTS_DOC, update_block

RESULT = Path(__file__).parents[1] / "results" / "prefix_index_compare.json"
BEGIN, END = "<!-- bench:index:begin -->", "<!-- bench:index:end -->"


def _cell(key: str) -> str:
    w, b = key[1:].split("_b")
    return f"{w} | {b.upper()}"


def table(data: dict) -> str:
    s, m, c = data["summary"], data["machine"], data["config"]
    rows = [f"| {_cell(k)} | {s['lookup_p50_us']['redis'][k]:.0f} / {s['lookup_p99_us']['redis'][k]:.0f} | "
            f"{s['redis_lookup_server_us'][k]:.0f} | {s['lookup_p50_us']['memory'][k]:.0f} / "
            f"{s['lookup_p99_us']['memory'][k]:.0f} | {s['lookup_p50_speedup'][k]:.1f}× | "
            f"{s['update_p50_us']['redis'][k]:.0f} ({s['redis_update_server_us'][k]:.0f}) | "
            f"{s['update_p50_us']['memory'][k]:.0f} |" for k in s["lookup_p50_us"]["redis"]]
    router, redis = s["router_mb_per_million_blocks"], s["redis_mb_per_million_blocks"]
    at = _cell(router["at"]).replace(" | ", " workers, ")
    return "\n".join([
        f"`make bench-index` ({data['duration_s'] / 60:.0f} min, {m['cpus']} CPU cores, {m.get('cpu_model', '')}): "
        f"lookups of {c['prompt_blocks']}-block prompts ({c['shared_prefix_blocks']} shared) and one engine step's "
        f"update ({c['step_blocks']}), µs.", "",
        "| workers | blocks | Redis lookup p50 / p99 | of it, Redis's own | memory lookup p50 / p99 | p50 ratio "
        "| Redis update p50 (its own) | memory update p50 |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        f"Memory per million indexed blocks: {redis['used_memory']:.0f} MB in Redis, {router['structural']:.0f} MB "
        f"in the router's index ({router['rss']:.0f} MB of process growth), at {at} blocks."])


def write(data: dict) -> None:
    update_block(RESULTS_DOC, BEGIN, END, table(data))


if __name__ == "__main__":
    write(json.loads(RESULT.read_text()))
    print(f"wrote the prefix-index table of {RESULTS_DOC}")
