"""llama.cpp's `llama-server`, the server a user who serves on CPUs would pick instead, as an arm of
`make bench`: the same GGUF file, the same cores (all of them: `-t` = the machine's cores), 8 slots
(`-np 8`) with continuous batching, prompts in 512-token micro-batches beside the other slots'
decode tokens (its defaults), on the same OpenAI `/v1/completions` API the stack's arms are
measured on (bench/load/client.py).

Built once from the source the llama-cpp-python sdist vendors (`scripts/peer_venvs.sh
llama-server`, ~11 minutes on 2 cores) into $PD_PEERS_DIR (default ~/.cache/pdserve/peers)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from pdserve.local.servers import die_with_parent, free_port, running

VERSION = os.environ.get("LLAMA_CPP_VERSION", "0.3.36")
PEERS = Path(os.environ.get("PD_PEERS_DIR", Path.home() / ".cache" / "pdserve" / "peers"))
BINARY = PEERS / "llama-server" / VERSION / "llama-server"
BUILD = Path(__file__).parents[2] / "scripts" / "peer_venvs.sh"
SLOTS = 8
CONTEXT_PER_SLOT = 4096


def built() -> Path | None:
    """The binary, built first if it is not (None when the build fails)."""
    if not BINARY.exists():
        subprocess.run(["bash", str(BUILD), "llama-server"], check=False)
    return BINARY if BINARY.exists() else None


def argv(binary: Path, gguf: Path, port: int, threads: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(SLOTS), "-c", str(SLOTS * CONTEXT_PER_SLOT),
            "--log-disable"]


def version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    text = (out.stdout + out.stderr).strip()
    return text.splitlines()[0] if text else "unknown"


@contextlib.contextmanager
def serving(gguf: Path, threads: int | None = None, log: Path | None = None,
            timeout_s: float = 120) -> Iterator[str]:
    """llama-server on `gguf`, its base URL while the block runs."""
    binary = built()
    if binary is None:
        raise RuntimeError(f"llama-server did not build: run `bash {BUILD} llama-server` and read its output")
    port = free_port()
    with (log.open("w") if log else contextlib.nullcontext(subprocess.DEVNULL)) as out, \
            running(argv(binary, gguf, port, threads or os.cpu_count() or 1), stdout=out, stderr=subprocess.STDOUT,
                    preexec_fn=die_with_parent) as proc:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become healthy (exit {proc.poll()}; log: {log})")
            time.sleep(0.2)
        yield url


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
