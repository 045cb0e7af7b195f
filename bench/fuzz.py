"""`make fuzz`: property-based requests against the live stack's OpenAPI (schemathesis), at
scale: every response's status counted, no 5xx and no hang allowed, and the stack asked an
ordinary question afterwards.

    python -m bench.fuzz [--seeds 4] [--examples 100]   (writes bench/results/fuzz.json)

Per seed, two runs on one colocated stack: bodies naming any model (most end at validation),
then bodies naming the served model, each operation given valid examples (BODIES: chat,
completions with a prompt and batches of texts and of token ids, responses, /tokenize,
/detokenize), which schemathesis sends and varies field by field, so generated requests reach
the handlers and the worker. Generation is capped (max_tokens <= 4, prompts <= 256 tokens) so
that those stay cheap. `--examples` is schemathesis's examples per operation; its phases
(examples, coverage, fuzzing) make more requests than that, and stop at about 1,500 a run
whatever the number, so more requests come from more seeds. tests/stack/test_fuzz.py runs one
seed at 10 examples: ~4,000 requests.
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


HI = [{"role": "user", "content": "Hi"}]
# valid bodies of each operation (the served model's name added): the starts that reach the handlers
BODIES: dict[str, list[dict]] = {
    "/v1/chat/completions": [{"messages": HI, "max_tokens": 2},
                             {"messages": HI, "max_tokens": 2, "n": 2, "seed": 3, "logprobs": True, "top_logprobs": 2}],
    "/v1/completions": [{"prompt": "Hi", "max_tokens": 2}, {"prompt": ["Hi", "Bye"], "max_tokens": 2},
                        {"prompt": [[1, 2], [3]], "max_tokens": 1, "echo": True, "logprobs": 1}],
    "/v1/responses": [{"input": "Hi", "max_output_tokens": 2}],
    "/tokenize": [{"prompt": "Hi"}, {"messages": HI}],
    "/detokenize": [{"tokens": [1, 2]}],
}


@dataclass
class Run:
    rc: int                # schemathesis's exit status: 0 when every check passed
    generated: int         # requests it made, as it counts them
    statuses: Counter      # every response's status (from its HAR record)
    answered: Counter      # 2xx answers per operation (a completions batch apart)
    tail: str              # the end of its report


def pin_model(spec: dict, model: str) -> None:
    """Every request body names the served model and has BODIES, so generated requests reach
    the handlers and the workers (the unpinned run covers unknown models)."""
    schemas = spec["components"]["schemas"]
    for path, ops in spec["paths"].items():
        media = ops.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if media is None:
            continue
        props = schemas[media["schema"]["$ref"].rsplit("/", 1)[1]]["properties"]
        props["model"] = {"type": "string", "enum": [model]}
        media["examples"] = {f"{path}-{i}": {"value": {"model": model, **body}}
                             for i, body in enumerate(BODIES.get(path, []))}


def operation(entry: dict) -> str:
    """A HAR entry's operation: its path, and `(batch)` for a completions batch."""
    path = "/" + entry["request"]["url"].split("/", 3)[3].split("?")[0]
    try:
        prompt = json.loads(entry["request"].get("postData", {}).get("text", "")).get("prompt")
    except (ValueError, AttributeError):
        prompt = None
    batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return path + (" (batch)" if path == "/v1/completions" and batch else "")


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
               Counter(str(e["response"]["status"]) for e in entries),
               Counter(operation(e) for e in entries if 200 <= e["response"]["status"] < 300), r.stdout[-3000:])


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
                     "statuses": dict(sorted(r.statuses.items())), "answered": dict(sorted(r.answered.items())),
                     "report_tail": r.tail[-600:]}
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
