"""Speculative decoding (prompt lookup, pdserve/shared/engine/speculative.py) on the engine in-process with SmolLM2:
decode tokens/s with it off and at k = 3 and 5 draft tokens, side by side, on workloads where it should pay (code
editing: a ~40-line function rewritten with one change; a summary quoting its document) and one where it should
not (free chat): `make bench-speculative`.

    python -m bench.speculative [--tokens 256] [--rounds 2] [--threads 2] [--ks 3 5]

Each request runs alone (batch 1), greedy, its chat template applied; its decode tokens/s is (tokens - 1) / the
time from its first token to its last (the prompt's pass left out), a workload's the sum of its requests' tokens
over the sum of their times (wall clock; and this process's CPU time, steadier where other work shares the cores). The
arms take turns request by request, round by round; each keeps its best round per request.
Every arm's tokens are asserted equal to those without speculation. Writes bench/results/speculative.json
(`summary`: per workload, tokens/s off and at each k, the speedup over off and the accept rate), with the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.machine import cpu_model
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import LoadedModel, load
from pdserve.shared.engine.sequence import SamplingParams

OUT = Path(__file__).resolve().parent / "results" / "speculative.json"
MODEL = "smollm2"

FUNCTION = '''def summarize_orders(orders, customers, tax_rate=0.2):
    """Totals per customer, the largest order and the count of late orders."""
    totals = {}
    largest = None
    late = 0
    for order in orders:
        customer = customers.get(order["customer_id"])
        if customer is None:
            continue
        subtotal = 0
        for item in order["items"]:
            price = item["price"]
            quantity = item["quantity"]
            if quantity <= 0:
                continue
            subtotal += price * quantity
        if order.get("coupon"):
            subtotal = subtotal * 0.9
        total = subtotal * (1 + tax_rate)
        name = customer["name"]
        if name not in totals:
            totals[name] = 0
        totals[name] += total
        if largest is None or total > largest["total"]:
            largest = {"id": order["id"], "total": total}
        if order["shipped_day"] > order["due_day"]:
            late += 1
    report = []
    for name in sorted(totals):
        report.append(f"{name}: {totals[name]:.2f}")
    return {
        "report": report,
        "largest": largest,
        "late": late,
    }
'''

ARTICLE = (
    "The city council voted on Tuesday to turn the old rail yard into a public park. The plan, which took three "
    "years to prepare, adds forty acres of green space, a community garden and a bicycle path that links the river "
    "to the north side. \"This is the largest new park the city has built in half a century,\" said the mayor, "
    "Elena Ruiz, after the vote. Construction starts next spring and should take two years. The project costs 48 "
    "million dollars, most of it from a state grant; the rest comes from the sale of two unused city buildings. "
    "Some residents worried about traffic near the park's main entrance. \"We asked for a second entrance on Mill "
    "Street, and the council listened,\" said Tom Becker, who leads the neighborhood association. The council also "
    "agreed to keep the old water tower as a landmark. Local schools plan to use the garden for science classes, "
    "and the parks department will hire twelve new staff to run it."
)

WORKLOADS: dict[str, list[list[dict[str, str]]]] = {
    "code_editing": [
        [{"role": "user", "content": "Rewrite this Python function so that the coupon discount is 15% instead of "
                                     "10%. Change nothing else and reply with the complete function.\n\n" + FUNCTION}],
        [{"role": "user", "content": "Here is a function:\n\n" + FUNCTION + "\nRename the variable `late` to "
                                     "`late_orders` everywhere and show the full updated function."}],
    ],
    "summarization_quotes": [
        [{"role": "user", "content": ARTICLE + "\n\nSummarize this article in a few sentences. Quote the mayor's "
                                               "and Tom Becker's words exactly."}],
    ],
    "free_chat": [
        [{"role": "user", "content": "What are some fun things to do on a rainy weekend?"}],
        [{"role": "user", "content": "Write a short story about a dragon who learns to bake bread."}],
    ],
}


def run(loaded: LoadedModel, prompt: list[int], params: SamplingParams,
        k: int) -> tuple[list[int], tuple[float, float], Engine]:
    """One request alone; its tokens and its decode time (first token to last), wall and this process's CPU."""
    eng = Engine(loaded, EngineConfig(num_blocks=256, speculative_tokens=k))
    eng.add_request("r", prompt, params)
    out: list[int] = []
    first = last = (0.0, 0.0)
    while eng.has_work():
        for o in eng.step():
            now = (time.perf_counter(), time.process_time())
            first = first if first[0] else now
            last = now
            out += o.new_token_ids
    return out, (last[0] - first[0], last[1] - first[1]), eng


def measure(loaded: LoadedModel, ks: list[int], tokens: int, rounds: int) -> dict[str, dict]:
    tok = loaded.tokenizer
    assert tok is not None
    params = SamplingParams(max_tokens=tokens, temperature=0)
    arms = [0, *ks]
    results: dict[str, dict] = {}
    for name, convs in WORKLOADS.items():
        prompts = [tok.encode(tok.apply_chat_template(c)) for c in convs]
        wall = {k: [float("inf")] * len(prompts) for k in arms}
        cpu = {k: [float("inf")] * len(prompts) for k in arms}
        outs: dict[int, list[list[int]]] = {k: [[] for _ in prompts] for k in arms}
        stats = {k: [[0, 0] for _ in prompts] for k in arms}
        for _ in range(rounds):
            for i, prompt in enumerate(prompts):
                for k in arms:
                    ids, (seconds, cpu_s), eng = run(loaded, prompt, params, k)
                    wall[k][i], cpu[k][i] = min(wall[k][i], seconds), min(cpu[k][i], cpu_s)
                    outs[k][i] = ids
                    stats[k][i] = [eng.speculator.stats.drafted, eng.speculator.stats.accepted]
        n = sum(len(o) - 1 for o in outs[0])
        res: dict[str, dict] = {}
        for k in arms:
            same = outs[k] == outs[0]
            assert same, f"{name}: tokens at k={k} differ from those without speculation"
            drafted, accepted = (sum(col) for col in zip(*stats[k]))
            res["off" if k == 0 else f"k{k}"] = {
                "decode_tokens_per_s": round(n / sum(wall[k]), 2),
                "decode_tokens_per_cpu_s": round(n / sum(cpu[k]), 2), "tokens": n + len(prompts),
                "drafted": drafted, "accepted": accepted,
                "accept_rate": round(accepted / drafted, 3) if drafted else None, "identical": same}
        results[name] = {"prompt_tokens": [len(p) for p in prompts], "arms": res}
        print(name, json.dumps(res))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens of each request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5], help="draft lengths measured beside off")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(MODEL, weights="auto")  # as a worker loads it (PD_WEIGHTS auto: the file's own blocks on CPU)
    results = measure(loaded, args.ks, args.tokens, args.rounds)
    summary = {}
    for name, r in results.items():
        off, off_cpu = r["arms"]["off"]["decode_tokens_per_s"], r["arms"]["off"]["decode_tokens_per_cpu_s"]
        row: dict[str, float | bool | None] = {"off_tokens_per_s": off}
        for k in args.ks:
            arm = r["arms"][f"k{k}"]
            row[f"k{k}_tokens_per_s"] = arm["decode_tokens_per_s"]
            row[f"k{k}_speedup"] = round(arm["decode_tokens_per_s"] / off, 3)
            row[f"k{k}_speedup_cpu"] = round(arm["decode_tokens_per_cpu_s"] / off_cpu, 3)
            row[f"k{k}_accept_rate"] = arm["accept_rate"]
        row["identical"] = all(a["identical"] for a in r["arms"].values())
        summary[name] = row
    OUT.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "model_name": cpu_model(), "threads": args.threads},
                               "model": MODEL, "weights": loaded.weights, "max_tokens": args.tokens,
                               "rounds": args.rounds,
                               "summary": summary, "workloads": results}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
