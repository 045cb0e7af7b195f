"""bench/scale/fleet.py in its own process, driven over its stdin / stdout (`make bench-scale`)."""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
from pathlib import Path

from bench.scale.plan import FleetWorker
from pdserve.local.servers import die_with_parent


class FleetProcess:
    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    async def start(self, plan: list[FleetWorker], env: dict[str, str], timeout_s: float = 300) -> None:
        """Start it with `plan` and the services' environment; return once its workers are up."""
        plan_path = self.log_path.with_suffix(".plan.pkl")
        plan_path.write_bytes(pickle.dumps(plan))
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.scale.fleet", str(plan_path), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=log, env=env, preexec_fn=die_with_parent,
                limit=1 << 28)   # the admits' answer is one long line
        await self.expect("ready", timeout_s)

    def _pipes(self) -> tuple[asyncio.StreamWriter, asyncio.StreamReader]:
        """Its stdin and stdout (once started)."""
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        return self.proc.stdin, self.proc.stdout

    async def fill(self, blocks: int, timeout_s: float = 1800) -> None:
        """Index filler blocks until the fleet indexes `blocks` in all; return once written."""
        stdin, _ = self._pipes()
        stdin.write(f"fill {blocks}\n".encode())
        await stdin.drain()
        await self.expect("filled", timeout_s)

    async def admits(self, timeout_s: float = 60) -> tuple[dict[str, tuple[int, int]], int, list[float]]:
        """(request id -> (asked, answered) in wall-clock ns, of the admits answered since last
        asked; caches the fleet has rewritten whole since it started; its loop's lateness in ms
        since last asked)."""
        stdin, _ = self._pipes()
        stdin.write(b"admits\n")
        await stdin.drain()
        answer = json.loads(await self.expect("{", timeout_s))
        return ({rid: (asked, answered) for rid, asked, answered in answer["admits"]}, answer["rewrites"],
                answer["late_ms"])

    async def expect(self, start: str, timeout_s: float) -> str:
        _, stdout = self._pipes()
        line = (await asyncio.wait_for(stdout.readline(), timeout_s)).decode()
        if not line.startswith(start):
            raise RuntimeError(f"the simulated fleet answered {line[:80]!r}, not {start!r}…; see {self.log_path}")
        return line

    async def stop(self, timeout_s: float = 60) -> None:
        """Its workers deregister and release their index entries, then it exits."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            stdin, _ = self._pipes()
            stdin.write(b"quit\n")
            await stdin.drain()
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except (TimeoutError, ConnectionError):
            self.proc.kill()
            await self.proc.wait()
