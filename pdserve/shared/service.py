"""Running a service process: logging, signals, the registry heartbeat."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from typing import NoReturn

import uvloop

from pdserve.shared import identity, logs, metrics
from pdserve.shared.bus import Bus
from pdserve.shared.config import Common, lease_s
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.probes import PROBES
from pdserve.shared.state import State
from pdserve.shared.tasks import every

log = logging.getLogger(__name__)


async def connect(stack: AsyncExitStack, settings: Common, name: str, role: str) -> tuple[Bus, State]:
    """NATS and Redis for an instance of `role`, closed (NATS drained) when `stack` unwinds: as
    its own users, from the identity issuer when it has an enrollment token (pdserve/shared/identity.py)."""
    me = identity.mine(role, settings.enroll_token)
    bus = await Bus.connect(settings.nats_url, name=name, me=me, pending_bytes=settings.nats_pending_bytes)
    stack.push_async_callback(bus.close)
    state = State.for_service(settings, await bus.enroll_redis(me, settings.redis_url) if me else "")
    stack.push_async_callback(state.close)
    return bus, state


def setup_logging(settings: Common, service: str) -> None:
    """Logging as the settings say; then a warning for each renamed setting still set by its old name."""
    logs.setup(settings.log_level, service, settings.log_format)
    for note in settings.renamed:
        log.warning(note)


def run(main: Coroutine) -> None:
    """Run a service's main coroutine on uvloop (fewer microseconds per message hop), with the
    liveness stamp of its /health (pdserve/shared/probes.py) turning beside it. Once it returns, what is
    left goes with the process: frozen, so that the interpreter's exit collections do not walk
    it (a model and its vocabulary: about a second of a worker's stop)."""
    async def with_probes() -> object:
        tick = asyncio.create_task(PROBES.tick())
        try:
            return await main
        finally:
            tick.cancel()
    uvloop.run(with_probes())
    gc.freeze()


def stop_event() -> asyncio.Event:
    """Set on SIGINT / SIGTERM: the service stops taking work, finishes what it has, exits
    (its /ready answers 503 from then on)."""
    stop = asyncio.Event()

    def on_signal() -> None:
        PROBES.draining = True
        stop.set()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    return stop


async def until_stopped(stop: asyncio.Event, required: dict[str, asyncio.Task], state: State,
                        worker_id: str) -> None:
    """Wait for `stop`. A task the worker needs (its engine loop, heartbeat, watchers) that
    ends first, raising or not, ends the worker: `leave_and_exit`."""
    stopped = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([stopped, *required.values()], return_when=asyncio.FIRST_COMPLETED)
    if stopped in done:
        return
    stopped.cancel()
    await _ended(next((n, t) for n, t in required.items() if t in done), state, worker_id)


async def _ended(named: tuple[str, asyncio.Task], state: State, worker_id: str) -> NoReturn:
    name, task = named
    error = None if task.cancelled() else task.exception()
    await leave_and_exit(state, worker_id, f"its {name} ended" + (f": {error!r}" if error else ""), error)


async def leave_and_exit(state: State, worker_id: str, why: str, error: BaseException | None = None) -> NoReturn:
    """The worker cannot do its work: it leaves the registry now (its requests fail over as
    after a kill -9, without waiting out its lease) and exits non-zero, whatever its threads
    are doing (an engine step may never return)."""
    log.critical("%s: %s; leaving the registry and exiting", worker_id, why, exc_info=error)
    try:
        await asyncio.wait_for(state.registry.deregister(worker_id), timeout=2.0)
    except Exception as e:  # noqa: BLE001 - Redis away: the lease lapses by itself
        log.warning("could not leave the registry: %s", e)
    logging.shutdown()
    os._exit(1)


def serving() -> None:
    """The service's loop has started (subscriptions made): its /ready answers 200. What it built
    to start is frozen (`started`)."""
    PROBES.serving = True
    started()


def started() -> None:
    """What a service built to start (its modules, torch's among them, a model, a vocabulary) moved
    out of the garbage collector's reach: a full collection then walks only what its work made.
    Unfrozen, a router's walked ~230k objects, ~100 ms with its loop stopped: its placements' p99."""
    gc.collect()
    gc.freeze()


async def heartbeat(state: State, info: Callable[[], WorkerInfo], period_s: float, stop: asyncio.Event) -> None:
    """Refresh the registry entry (`info()` gives the current one) until stopped; the lease is
    LEASE_BEATS periods, so a worker that dies vanishes from the registry by itself. Redis
    down: the worker keeps serving, the next period tries again."""
    async def beat() -> None:
        entry = info()
        if entry.role in ("prefill", "decode"):
            metrics.worker(entry)
        await state.registry.heartbeat(entry, lease_s=lease_s(period_s))
    await every(period_s, beat, stop, log, "heartbeat")
