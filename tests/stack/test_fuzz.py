"""Property-based fuzzing of the gateway's OpenAPI on the live stack (schemathesis): no 5xx and
no hang, whatever the body. Generation is capped (max_tokens <= 4, prompts <= 256 tokens) so
that the requests that do reach a worker stay cheap."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import MODEL

from deploy.local.stack import Stack, StackConfig

pytestmark = pytest.mark.slow
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


def _pin_model(node) -> None:
    """Request bodies name the served model, so generated requests reach the workers (the
    unpinned run covers unknown models)."""
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict) and "model" in props and ("messages" in props or "prompt" in props):
            props["model"] = {"type": "string", "enum": [MODEL]}
        for v in node.values():
            _pin_model(v)
    elif isinstance(node, list):
        for v in node:
            _pin_model(v)


def _fuzz(schema: str, url: str, examples: int) -> tuple[int, int, str]:
    # one worker: with threads, hypothesis's ast.parse trips a CPython 3.11 bug now and then
    # ("AST constructor recursion depth mismatch", cpython gh-106905) and schemathesis exits 1
    r = subprocess.run([str(SCHEMATHESIS), "run", schema, "--url", url, "--checks", "not_a_server_error",
                        "--max-examples", str(examples), "--seed", "7", "--request-timeout", "30", "--workers", "1"],
                       capture_output=True, text=True, timeout=900)
    found = re.search(r"(\d+) generated", r.stdout)
    return r.returncode, int(found.group(1)) if found else 0, r.stdout[-3000:]


def test_over_1000_generated_requests_get_no_5xx_and_no_hang(tmp_path):
    cfg = StackConfig.on_free_ports(colocated=True, decode=1, kv_blocks=512, log_dir=tmp_path, env={
        "PD_MAX_TOKENS_LIMIT": "4", "PD_DEFAULT_MAX_TOKENS": "2", "PD_MAX_PROMPT_TOKENS": "256"})
    with Stack(cfg) as stack:
        spec = httpx.get(stack.url + "/openapi.json", timeout=10).json()
        (tmp_path / "open.json").write_text(json.dumps(spec))
        _pin_model(spec)
        (tmp_path / "pinned.json").write_text(json.dumps(spec))
        open_rc, open_n, open_out = _fuzz(str(tmp_path / "open.json"), stack.url, 40)
        pinned_rc, pinned_n, pinned_out = _fuzz(str(tmp_path / "pinned.json"), stack.url, 60)
        alive = stack.procs["decode-0"].poll() is None
    print(f"schemathesis: {open_n} requests (any model) + {pinned_n} (the served model)")
    assert open_rc == 0, open_out
    assert pinned_rc == 0, pinned_out
    assert open_n + pinned_n >= 1000 and alive
