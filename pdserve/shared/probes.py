"""`/health` and `/ready` of the router and the workers, served beside `/metrics` on their
metrics port (the gateway answers both on its API port): what an orchestrator probes.

  /health  liveness: 200 while the service's event loop turns (a task stamps PROBES every
           TICK_S; the HTTP thread reads the stamp). A loop stuck for STUCK_S — a blocking
           call, a deadlock — answers 503 and the process is restarted. Redis or NATS away
           does not fail it: the service rides that out itself.
  /ready   readiness: 200 once the service serves (its loop started, subscriptions made) and
           until it drains (SIGTERM), 503 before and after.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

TICK_S = 1.0
STUCK_S = 15.0


@dataclass
class Probes:
    ticked: float = field(default_factory=time.monotonic)
    serving: bool = False
    draining: bool = False

    async def tick(self) -> None:
        """Forever: stamp that the event loop turns."""
        while True:
            self.ticked = time.monotonic()
            await asyncio.sleep(TICK_S)

    def health(self) -> tuple[int, dict]:
        stuck_s = time.monotonic() - self.ticked
        return (200 if stuck_s < STUCK_S else 503), {"live": stuck_s < STUCK_S, "loop_idle_s": round(stuck_s, 1)}

    def ready(self) -> tuple[int, dict]:
        ok = self.serving and not self.draining
        return (200 if ok else 503), {"ready": ok, "serving": self.serving, "draining": self.draining}


PROBES = Probes()   # one per process


def answer(path: str) -> tuple[int, bytes] | None:
    """The status and JSON body for a probe path; None for any other path."""
    probe = {"/health": PROBES.health, "/ready": PROBES.ready}.get(path)
    if probe is None:
        return None
    status, body = probe()
    return status, json.dumps(body).encode()
