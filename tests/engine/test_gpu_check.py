"""`make gpu-check`'s script runs on a GPU image's own python3: torch, transformers and the engine, none of
the services' packages. Here it runs with `--device cpu` (tiny shapes of the same architectures) in a
process where pydantic, pydantic_settings, gguf, deploy, xgrammar, NATS, Redis and UCX do not import, the
way they do not on that image; every check passes and the services step is skipped, saying why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABSENT = ("pydantic", "pydantic_settings", "gguf", "deploy", "xgrammar", "nats", "redis", "ucxx", "ucp")
# the interpreter as that image's: the modules above unimportable, then the script as __main__
RUN = f"""
import importlib.abc, runpy, sys
ABSENT = {ABSENT!r}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU image)", name=name)
sys.meta_path.insert(0, Absent())
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("IMPORTED:", sorted(m for m in sys.modules if m.split(".")[0] in ABSENT))
"""


def check(tmp_path: Path, *args: str) -> dict:
    """The script's JSON, run as the image would run it; it passed, and imported none of ABSENT."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-c", RUN, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu",
                           "--out", str(out), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "IMPORTED: []" in proc.stdout
    return json.loads(out.read_text())


def test_the_check_passes_on_cpu_with_none_of_the_services_packages(tmp_path):
    result = check(tmp_path)
    assert result["failed"] == [] and result["summary"]["passed"]
    assert set(result["models"]) == {"qwen2.5-1.5b", "llama-3.2-1b", "gemma-3-1b"}
    for name, m in result["models"].items():
        assert m["tokens_equal"] == m["tokens"] == 16, name  # (fp32 on both sides: every token)
        assert [s["batch"] for s in m["decode"]["auto"]["steps"]] == [64, 32, 8, 1]
        assert m["decode"]["auto"]["prefill_tokens_per_s"] > 0
    assert result["models"]["gemma-3-1b"]["config"]["arch"] == "gemma3_text"
    assert "pydantic" in result["services"]["skipped"]


def test_its_lower_precision_comparison_passes_too(tmp_path):
    """bfloat16, the GPU's dtype: the engine's log probabilities against transformers' fp32 ones, within
    twice transformers' own bfloat16 error."""
    result = check(tmp_path, "--dtype", "bfloat16", "--models", "gemma-3-1b", "--batches", "1,8", "--no-services")
    gemma = result["models"]["gemma-3-1b"]
    assert result["dtype"] == "bfloat16" and gemma["transformers_low_precision_err"] > 0
    assert gemma["logprob_max_abs_err"] <= 2 * gemma["transformers_low_precision_err"]
