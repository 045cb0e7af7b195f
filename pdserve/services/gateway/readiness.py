"""The gateway's readiness, judged in the background: NATS connected and a router and the
pools registered. Every JUDGE_S (STARTING_S until it is first ready) one registry read sets the verdict
its /ready answers (pdserve/shared/probes.py, on the metrics port), so a probe, however many, never
reaches Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from pdserve.shared.messages import WorkerInfo
from pdserve.shared.probes import PROBES, Probes
from pdserve.shared.state import State

JUDGE_S = 0.5
STARTING_S = 0.05      # until the first ready verdict: the pools register while a rollout waits on /ready
READ_TIMEOUT_S = 2.0   # a registry read that hangs longer is a store away (the verdict's STALE_S is longer)
ROLES = ("router", "prefill", "decode")


def verdict(workers: Sequence[WorkerInfo], require_prefill: bool, nats_connected: bool) -> tuple[list[str], dict]:
    """What is missing (roles with none registered, NATS) and the workers by role."""
    count = {role: sum(w.role == role for w in workers) for role in ROLES}
    missing = [role for role, n in count.items() if n == 0 and (role != "prefill" or require_prefill)]
    return missing + ([] if nats_connected else ["nats"]), count


async def judge(state: State, require_prefill: bool, nats_connected: Callable[[], bool],
                probes: Probes = PROBES) -> None:
    """One verdict: the registry read once; Redis away is a verdict too (not ready, and why)."""
    try:
        workers = await asyncio.wait_for(state.registry.workers(), READ_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - Redis unreachable or slow
        probes.judge(["state store"], reason=f"state store: {e!r}")
        return
    missing, count = verdict(workers, require_prefill, nats_connected())
    probes.judge(missing, workers=count)


async def keep_judging(state: State, require_prefill: bool, nats_connected: Callable[[], bool],
                       stop: asyncio.Event) -> None:
    """A verdict every JUDGE_S until `stop` (every STARTING_S until the first ready one)."""
    started = False
    while not stop.is_set():
        await judge(state, require_prefill, nats_connected)
        started = started or not PROBES.missing
        try:
            await asyncio.wait_for(stop.wait(), JUDGE_S if started else STARTING_S)
        except TimeoutError:
            pass
