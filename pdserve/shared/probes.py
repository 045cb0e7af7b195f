"""`/health` and `/ready` of every service, served beside `/metrics` on its metrics port (never
the gateway's API port): what an orchestrator probes. Both answer from memory, never from Redis or NATS.

  /health  liveness: 200 while the service's event loop turns (a task stamps PROBES every
           TICK_S; the HTTP thread reads the stamp). A loop stuck for STUCK_S — a blocking
           call, a deadlock — answers 503 and the process is restarted. Redis or NATS away
           does not fail it: the service rides that out itself.
  /ready   readiness: 200 once the service serves (its loop started, subscriptions made) and
           until it drains (SIGTERM), 503 before and after. A service that judges more (the gateway:
           NATS and the pools in the registry, pdserve/services/gateway/readiness.py) sets its
           verdict here from the background: it must be younger than STALE_S to count.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

TICK_S = 1.0
STUCK_S = 15.0
STALE_S = 5.0


@dataclass
class Probes:
    ticked: float = field(default_factory=time.monotonic)
    serving: bool = False
    draining: bool = False
    missing: list[str] = field(default_factory=list)   # what the service's own verdict still waits for
    detail: dict = field(default_factory=dict)         # what it reports beside (the gateway: workers by role)
    judged: float | None = None                        # when that verdict was made (None: the service makes none)

    async def tick(self) -> None:
        """Forever: stamp that the event loop turns."""
        while True:
            self.ticked = time.monotonic()
            await asyncio.sleep(TICK_S)

    def health(self) -> tuple[int, dict]:
        stuck_s = time.monotonic() - self.ticked
        return (200 if stuck_s < STUCK_S else 503), {"live": stuck_s < STUCK_S, "loop_idle_s": round(stuck_s, 1)}

    def judge(self, missing: list[str], **detail: object) -> None:
        """The service's own verdict (from its background): ready while `missing` is empty."""
        self.missing, self.detail, self.judged = missing, detail, time.monotonic()

    def ready(self) -> tuple[int, dict]:
        missing = self.missing
        if self.judged is not None and time.monotonic() - self.judged > STALE_S:
            missing = [*missing, "verdict"]   # its background stopped judging: nothing is known
        ok = self.serving and not self.draining and not missing
        body = {"ready": ok, "serving": self.serving, "draining": self.draining}
        return (200 if ok else 503), body | ({"missing": missing, **self.detail} if self.judged is not None else {})


PROBES = Probes()   # one per process


def answer(path: str) -> tuple[int, bytes] | None:
    """The status and JSON body for a probe path; None for any other path."""
    probe = {"/health": PROBES.health, "/ready": PROBES.ready}.get(path)
    if probe is None:
        return None
    status, body = probe()
    return status, json.dumps(body).encode()
