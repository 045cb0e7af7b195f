"""guidellm's 30 s synthetic benchmark against the stack (chat completions, streamed, 4 at a time),
from its own venv; SmolLM2's tokenizer from a local directory (no Hub)."""

from __future__ import annotations

import json

import pytest
import venvs
from steps import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.clients]
SECONDS, STREAMS, PROMPT, OUTPUT = 30, 4, 64, 16


@pytest.mark.works_with("guidellm", f"run: {SECONDS} s, {STREAMS} concurrent streams, synthetic "
                                    f"{PROMPT}-token prompts, {OUTPUT} tokens out")
def test_guidellm_synthetic_benchmark(stack, tokenizer_dir, record, tmp_path):
    report = tmp_path / "guidellm.json"
    done = venvs.run("guidellm", [
        "-m", "guidellm", "run", f"--backend=kind=openai_http,target={stack.url},model={MODEL}",
        f"--profile=kind=concurrent,streams={STREAMS}", f"--constraint=kind=max_duration,seconds={SECONDS}",
        f"--data=kind=synthetic_text,prompt_tokens={PROMPT},output_tokens={OUTPUT}",
        f"--tokenizer=kind=huggingface_auto,model={tokenizer_dir}", f"--output=kind=json,path={report}",
        "--disable-console-interactive"], timeout=SECONDS + 240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    assert totals["errored"] == 0 and totals["successful"] >= 10, totals
    assert metrics["output_token_count"]["successful"]["median"] == OUTPUT  # max_tokens and ignore_eos honoured
    record(venvs.version("guidellm"), requests=totals["successful"], errors=totals["errored"],
           requests_per_s=round(metrics["requests_per_second"]["successful"]["mean"], 2),
           output_tokens_per_s=round(metrics["output_tokens_per_second"]["successful"]["mean"], 1),
           ttft_median_ms=round(metrics["time_to_first_token_ms"]["successful"]["median"]))
