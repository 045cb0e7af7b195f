"""lm-eval-harness' local-completions against the stack, from its own venv: the tiny tasks in
tests/clients/lm-eval-tasks/ (six questions), as log-likelihoods of choices (echo + logprobs,
max_tokens 0, batched prompts) and as greedy generations."""

from __future__ import annotations

import json
import math

import pytest
import venvs
from steps import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.clients]
TASKS = venvs.ROOT / "tests" / "clients" / "lm-eval-tasks"


def evaluate(stack, tokenizer_dir, out, task: str) -> tuple[dict, list[dict]]:
    args = (f"model={MODEL},base_url={stack.url}/v1/completions,tokenizer={tokenizer_dir},"
            "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1")
    done = venvs.run("lm-eval", ["-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                                 "--batch_size", "4", "--tasks", task, "--include_path", str(TASKS),
                                 "--output_path", str(out), "--log_samples"], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
    return results, samples


@pytest.mark.works_with("lm-eval", "local-completions, loglikelihood: a 6-question multiple-choice task, batch 4")
def test_loglikelihood(stack, tokenizer_dir, record, tmp_path):
    results, samples = evaluate(stack, tokenizer_dir, tmp_path, "pdserve_tiny_mc")
    scores = [float(ll) for s in samples for (ll, _greedy) in s["filtered_resps"]]  # (the log writes strings)
    assert len(samples) == 6 and len(scores) == 24 and all(math.isfinite(x) and x < 0 for x in scores)
    assert 0 <= results["acc,none"] <= 1
    record(venvs.version("lm-eval"), acc=round(results["acc,none"], 3), requests=len(scores))


@pytest.mark.works_with("lm-eval", "local-completions, generate_until: the same 6 questions, greedy, until newline")
def test_generate_until(stack, tokenizer_dir, record, tmp_path):
    results, samples = evaluate(stack, tokenizer_dir, tmp_path, "pdserve_tiny_gen")
    answers = [s["filtered_resps"][0] for s in samples]
    assert len(answers) == 6 and any(a.strip() for a in answers) and not any("\n" in a for a in answers)
    record(venvs.version("lm-eval"), exact_match=round(results["exact_match,none"], 3), requests=len(answers))
