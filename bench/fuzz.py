"""`make fuzz`: property-based requests against the live stack's OpenAPI (schemathesis), at
scale: every response's status counted, no 5xx and no hang allowed, and the stack asked an
ordinary question afterwards.

    python -m bench.fuzz [--seeds 4] [--examples 100]   (writes bench/results/fuzz.json)

Per seed, two runs on one colocated stack: bodies naming any model (most end at validation),
then bodies naming the served model, so generated requests reach the worker. Generation is
capped (max_tokens <= 4, prompts <= 256 tokens) so that those stay cheap. `--examples` is
schemathesis's examples per operation; its phases (coverage, fuzzing) make more requests than
that, and stop at about 1,500 a run whatever the number, so more requests come from more seeds.
tests/stack/test_fuzz.py runs one seed at 10 examples: ~4,000 requests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.local.stack import Stack, StackConfig

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
CAPS = {"PD_MAX_TOKENS_LIMIT": "4", "PD_DEFAULT_MAX_TOKENS": "2", "PD_MAX_PROMPT_TOKENS": "256"}
OUT = Path("bench/results/fuzz.json")


@dataclass
class Run:
    rc: int                # schemathesis's exit status: 0 when every check passed
    generated: int         # requests it made, as it counts them
    statuses: Counter      # every response's status (from its HAR record)
    tail: str              # the end of its report


def pin_model(node, model: str) -> None:
    """Request bodies name the served model, so generated requests reach the workers (the
    unpinned run covers unknown models)."""
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict) and "model" in props and ("messages" in props or "prompt" in props):
            props["model"] = {"type": "string", "enum": [model]}
        for v in node.values():
            pin_model(v, model)
    elif isinstance(node, list):
        for v in node:
            pin_model(v, model)


def fuzz(schema: Path, url: str, examples: int, seed: int, timeout_s: float = 900) -> Run:
    """schemathesis against `url`: no response may be a 5xx (`not_a_server_error`) or take over
    30 s. One worker: with threads, hypothesis's ast.parse trips a CPython 3.11 bug now and then
    ("AST constructor recursion depth mismatch", cpython gh-106905) and schemathesis exits 1."""
    har = schema.with_suffix(f".{seed}.har")
    r = subprocess.run([str(SCHEMATHESIS), "run", str(schema), "--url", url, "--checks", "not_a_server_error",
                        "--max-examples", str(examples), "--seed", str(seed), "--request-timeout", "30",
                        "--workers", "1", "--report", "har", "--report-har-path", str(har)],
                       capture_output=True, text=True, timeout=timeout_s)
    found = re.search(r"(\d+) generated", r.stdout)
    entries = json.loads(har.read_text())["log"]["entries"] if har.exists() else []
    return Run(r.returncode, int(found.group(1)) if found else 0,
               Counter(str(e["response"]["status"]) for e in entries), r.stdout[-3000:])


def run_both(stack: Stack, work: Path, examples: int, seed: int = 7) -> tuple[Run, Run]:
    """Bodies naming any model, then the served one."""
    spec = httpx.get(stack.url + "/openapi.json", timeout=10).json()
    model = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    (work / "open.json").write_text(json.dumps(spec))
    pin_model(spec, model)
    (work / "pinned.json").write_text(json.dumps(spec))
    return fuzz(work / "open.json", stack.url, examples, seed), fuzz(work / "pinned.json", stack.url, examples, seed)


def answered_after(stack: Stack) -> bool:
    model = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 4})
    return r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=4, help="runs of each kind, seeds 7, 8, ...")
    ap.add_argument("--examples", type=int, default=100, help="schemathesis's examples per operation")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        cfg = StackConfig.on_free_ports(colocated=True, decode=1, kv_blocks=512, log_dir=work / "logs", env=CAPS)
        start = time.perf_counter()
        with Stack(cfg) as stack:
            runs = {(kind, seed): r for seed in range(7, 7 + args.seeds)
                    for kind, r in zip(("any_model", "served_model"), run_both(stack, work, args.examples, seed))}
            after = answered_after(stack)
            alive = all(p.poll() is None for p in stack.procs.values())
        seconds = time.perf_counter() - start
    statuses = sum((r.statuses for r in runs.values()), Counter())
    server_errors = sum(n for s, n in statuses.items() if s.startswith("5"))
    passed = all(r.rc == 0 for r in runs.values())
    out = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
           "examples_per_operation": args.examples,
           "runs": [{"bodies": kind, "seed": seed, "generated": r.generated, "passed": r.rc == 0,
                     "statuses": dict(sorted(r.statuses.items())), "report_tail": r.tail[-600:]}
                    for (kind, seed), r in runs.items()],
           "summary": {"requests": sum(statuses.values()), "server_errors": server_errors,
                       "checks_passed": passed, "statuses": dict(sorted(statuses.items())),
                       "answered_after": after, "processes_alive": alive, "seconds": round(seconds)}}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["summary"], indent=1))
    if server_errors or not passed or not after or not alive:
        sys.exit(1)


if __name__ == "__main__":
    main()
