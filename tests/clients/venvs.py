"""Each client's interpreter and how to run it.

A client runs from its own virtualenv, .venv-clients/<name> (scripts/client_venvs.sh installs it
from tests/clients/requirements/<name>.txt), or from the project's venv where its package
imports there (the openai SDK always; LangChain once `make setup` has installed it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".venv-clients"
# client -> (module it imports, distribution whose version the table shows)
PACKAGES = {
    "openai": ("openai", "openai"),
    "langchain": ("langchain_openai", "langchain-openai"),
    "litellm": ("litellm", "litellm"),
    "guidellm": ("guidellm", "guidellm"),
    "lm-eval": ("lm_eval", "lm_eval"),
}
# no Hugging Face Hub here: tokenizers come from a local directory, datasets from local files
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "TOKENIZERS_PARALLELISM": "false"}


def interpreter(client: str) -> Path | None:
    own = VENVS / client / "bin" / "python"
    if own.exists():
        return own
    spec = importlib.util.find_spec(PACKAGES[client][0])
    return Path(sys.executable) if spec is not None and spec.origin else None  # (not a namespace package)


def python(client: str) -> Path:
    found = interpreter(client)
    assert found is not None, f"{client} is not installed: scripts/client_venvs.sh {client}"
    return found


def version(client: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({PACKAGES[client][1]!r}))"
    return subprocess.run([python(client), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def run(client: str, args: list[str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python <args>` with the client's interpreter, offline; output captured, raised on timeout."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")} | OFFLINE
    return subprocess.run([str(python(client)), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
