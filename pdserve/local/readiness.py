"""Waiting for the local stack to be ready: the gateway up (its /ready, on its metrics port) with every worker
registered and seen by the routers (a server's port: servers.wait_for_port)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

from pdserve.services.router.recent import REGISTRY_READ_S


def wait_ready(ready_url: str, want: dict[str, int], procs: dict[str, subprocess.Popen], timeout_s: float,
               logs: Path) -> None:
    """Until the gateway's /ready at `ready_url` (on its metrics port) says ready with as many workers of each
    role registered as `want` says (the gateway is ready with one of each; placement tests and benchmarks need
    them all) and the routers, which re-read the registry every REGISTRY_READ_S, have seen them. A process of
    `procs` that exits ends the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited during start; logs in {logs}")
        try:
            with urllib.request.urlopen(ready_url, timeout=2) as r:
                workers = json.loads(r.read()).get("workers", {})
                if r.status == 200 and all(workers.get(k, 0) >= n for k, n in want.items()):
                    time.sleep(REGISTRY_READ_S + 0.3)  # and the routers' background view has them too
                    return
        except (OSError, ValueError):   # not up yet (or not the gateway on that port)
            pass
        time.sleep(0.05)
    raise TimeoutError(f"stack not ready after {timeout_s} s; logs in {logs}")
