"""Transfer libraries other systems build on, each run from a virtualenv of its own
(scripts/peer_venvs.sh, under $PD_PEERS_DIR): NIXL bundles its own UCX, which must not meet
ucxx's in the project's venv. Each library's arm is a script, bench/transfer/<lib>_arm.py, printing
one JSON line; `make bench-transfer` runs them beside its own arms."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

PEER_RUNS: list[dict] = []  # what each run said besides its GB/s (transports, idle CPU), for the JSON
PEERS = Path(os.environ.get("PD_PEERS_DIR", Path.home() / ".cache" / "pdserve" / "peers"))


def bench_peer(lib: str, sizes, *args: str, env: dict[str, str] | None = None, timeout_s: float = 300
               ) -> dict[int, float]:
    """bench/transfer/<lib>_arm.py under $PD_PEERS_DIR/<lib>'s interpreter; its JSON line's GB/s (the
    rest of it kept in PEER_RUNS)."""
    python = PEERS / lib / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{python} missing: run scripts/peer_venvs.sh")
    cmd = [str(python), str(Path(__file__).parent / f"{lib}_arm.py"), "--sizes", ",".join(map(str, sizes)),
           "--idle-s", "2", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-500:]}")
    run = json.loads(done.stdout.strip().splitlines()[-1])
    PEER_RUNS.append({"lib": lib, "args": list(args), "env": env or {},
                      **{k: v for k, v in run.items() if k != "gbps"}})
    return {int(k): v for k, v in run["gbps"].items()}
