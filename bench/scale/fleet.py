"""A simulated fleet for `make bench-scale` (a benchmark's stand-in, never run by a user): W
workers that speak the real protocol to the real router, with no model and no KV to move.

    python -m bench.scale.fleet PLAN     (PD_NATS_URL, PD_REDIS_URL, PD_HEARTBEAT_S from the environment)

PLAN is a pickled list of bench/scale/plan.FleetWorker. Each simulated worker:
1. Registers and heartbeats through `pdserve.shared.service.heartbeat` (`state.registry.heartbeat`) with its
   static load and what the prefix index asks of a registry entry (`worker_info`: the one
   place to change when the registry entry changes).
2. Publishes its prefix cache as a worker does (PD_PREFIX_INDEX: events on JetStream through its own
   `PrefixEventPublisher`, answering snapshots; or written to Redis through a `PrefixPublisher`):
   the plan's trace blocks at start, filler blocks on `fill N` (N indexed blocks across the fleet).
3. Decode: answers every admit (ok, with a KV tag), puts a remote one's prefill job on its
   prefill worker's queue (as pdserve/services/decode does) and records the request finished soon
   after (`state.requests.note`: the routers' supervisor sees it end). Prefill: pulls its jobs from its
   JetStream durable consumer (as pdserve/services/prefill does) and acks them.
4. Each admit or job churns its cache by the prompt's size: as many new filler blocks stored
   as old ones evicted, published once per simulated engine step (STEP_S) with the rest of
   that step's, as a worker publishes its engine's events. The index carries a serving
   fleet's write traffic while every prompt's answer stays the plan's, so decisions can be
   checked against the policy's.
Control, one line each way on stdin / stdout: (started) -> "ready"; "fill N" -> "filled N";
"admits" -> JSON: the admits answered since last asked, [request id, asked, answered] (wall
clock, ns: when the router decided and when it heard back, as near as they can be seen), how
many caches were rewritten whole so far (`rewrites`: each a lapsed lease or failed update) and
how late its loop woke a timer every LATE_EVERY_S since last asked (`late_ms`: how long the
loop was busy with something else, the wait an admit that arrived meanwhile had too);
"quit" -> the workers deregister and release their index entries, then the process exits.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import pickle
import random
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
from nats.aio.msg import Msg

from bench.scale.plan import BLOCK, MODEL, FleetWorker, filler, filler_counts
from pdserve.shared import streams, subjects
from pdserve.shared.bus import Bus, context_of
from pdserve.shared.config import Common, lease_s
from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.messages import AdmitReply, AdmitRequest, PrefillJob, WorkerInfo
from pdserve.shared.prefix_events import PrefixEventPublisher
from pdserve.shared.prefix_index import PrefixPublisher
from pdserve.shared.service import heartbeat, run, setup_logging
from pdserve.shared.state import State
from pdserve.shared.tasks import Background
from pdserve.shared.urls import async_redis

log = logging.getLogger("fleet")
FILL_CHUNK = 16_384      # filler blocks handed to a publisher at a time
FILL_AT_ONCE = 4         # workers filled concurrently
STEP_S = 0.05            # a simulated engine step: the churn of the requests it took, published together
FETCH_JOBS, FETCH_WAIT_S = 64, 5.0   # idle pulls wait longer than a real worker's 0.5 s: 128 idle simulated
                                     # workers polling that often would cost this one process more than they tell
FINISH_AFTER_S = 2.0     # an admitted request is recorded finished this long after its admit
LATE_EVERY_S = 0.01      # the loop's lateness sampled this often (uvloop's timers tick in ms)


@dataclass(eq=False)   # by identity: a set of them is kept
class Sim:
    spec: FleetWorker
    prefix: PrefixEventPublisher | PrefixPublisher = field(init=False)
    low: int = 0         # its filler blocks low..high-1 are in its cache
    high: int = 0
    first_slot: int = 0  # its prefix slot at start (redis)
    pending: int = 0     # blocks to churn at the next step
    changes: int = 0     # cache changes published so far (events: a snapshot's sequence)

    def cache(self) -> list[int]:
        """Every block in its cache."""
        return self.spec.cached + filler(self.spec.index, self.low, self.high)

    async def snapshot(self) -> list[int]:
        """The cache (redis: the publisher rewrites the index from it, should it be lost)."""
        return self.cache()

    async def snapshot_at(self) -> tuple[list[int], int]:
        """The cache and the count of changes it reflects (events: a router's resync)."""
        return self.cache(), self.changes

    def publish(self, changes: list[CacheChange]) -> None:
        self.prefix.publish(changes)
        self.changes += len(changes)

    def settled(self) -> bool:
        """Every change published has been sent (events) or written (redis)."""
        if isinstance(self.prefix, PrefixEventPublisher):
            return self.prefix.seq == self.changes
        return self.prefix.size == len(self.spec.cached) + self.high - self.low

    def churn(self, blocks: int) -> None:
        """Store `blocks` new filler blocks and evict as many of the oldest: the size stays."""
        n = min(blocks, self.high - self.low)
        if n:
            i = self.spec.index
            self.publish([CacheChange("stored", h) for h in filler(i, self.high, self.high + n)] +
                         [CacheChange("evicted", h) for h in filler(i, self.low, self.low + n)])
            self.low, self.high = self.low + n, self.high + n


def worker_info(sim: Sim) -> WorkerInfo:
    """A simulated worker's registry entry: its static load, and what routers read of its
    prefix index (events: its publisher's life and sequence; redis: its slot), its cache's size."""
    return WorkerInfo(worker_id=sim.spec.worker_id, role=sim.spec.role, model=MODEL, fingerprint=MODEL,
                      block_size=BLOCK, cached_blocks=len(sim.spec.cached) + sim.high - sim.low,
                      **sim.prefix.registry_fields(),
                      **sim.spec.load)


class Fleet:
    def __init__(self, plan: list[FleetWorker], bus: Bus, state: State, heartbeat_s: float, index: str = "events"):
        self.plan, self.bus, self.state, self.heartbeat_s, self.index = plan, bus, state, heartbeat_s, index
        self.sims: list[Sim] = []
        self.tasks: list[asyncio.Task] = []
        self.queueing = Background(logging.getLogger("fleet"), "prefill job")
        self.stop = asyncio.Event()
        self.tags = 0
        self.stepping: set[Sim] = set()   # workers with churn pending
        self.admits: list[tuple[str, int, int]] = []   # (request id, asked, answered) in wall-clock ns
        self.late_ms: list[float] = []                 # the loop's lateness, each LATE_EVERY_S

    async def start(self) -> None:
        await streams.ensure(self.bus.js)   # (as the operator: the fleet's bus is the operator's)
        for spec in self.plan:
            sim = Sim(spec)
            sim.prefix = PrefixEventPublisher(self.bus, spec.worker_id, sim.snapshot_at) if self.index == "events" \
                else PrefixPublisher(self.state, spec.worker_id, lease_s(self.heartbeat_s), sim.snapshot)
            await sim.prefix.start()
            sim.first_slot = getattr(sim.prefix, "slot", 0)
            sim.publish([CacheChange("stored", h) for h in spec.cached])
            self.sims.append(sim)
        await self.settled()
        self.tasks.append(asyncio.create_task(self.steps()))
        self.tasks.append(asyncio.create_task(self.lateness()))
        phases = random.Random(0)
        for sim in self.sims:
            self.tasks.append(asyncio.create_task(self.beating(sim, phases.uniform(0, self.heartbeat_s))))
            if sim.spec.role == "decode":
                await self.bus.subscribe(subjects.decode_admit(sim.spec.worker_id),
                                         functools.partial(self.on_admit, sim))
            else:
                pull = await self.bus.js.pull_subscribe(subjects.prefill_jobs(sim.spec.worker_id),
                                                        durable=sim.spec.worker_id)
                self.tasks.append(asyncio.create_task(self.take_jobs(sim, pull)))

    async def beating(self, sim: Sim, phase_s: float) -> None:
        """Its heartbeat from `phase_s` on: the workers' beats spread over the period, as separate
        processes' are (all at once, the fleet's loop answered no admit for tens of ms each second)."""
        await asyncio.sleep(phase_s)
        await heartbeat(self.state, functools.partial(worker_info, sim), self.heartbeat_s, self.stop)

    async def on_admit(self, sim: Sim, msg: Msg) -> None:
        asked = time.time_ns()
        req = AdmitRequest.decode(msg.data)
        self.took(sim, len(req.prompt_token_ids) // BLOCK)
        self.tags += 1
        self.admits.append((req.request_id, asked, time.time_ns()))
        reply = AdmitReply(request_id=req.request_id, ok=True, kv_tag=self.tags << 8,
                           num_blocks=-(-(len(req.prompt_token_ids) + 1) // BLOCK))
        await self.bus.respond(msg, reply)
        if req.mode == "remote" and req.prefill_worker:  # as a decode worker does: the job, after the reply
            self.queueing.start(self.bus.queue_prefill(req.prefill_worker, PrefillJob(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                decode_worker=sim.spec.worker_id, decode_address="00", decode_fingerprint=MODEL,
                first_block=0, kv_tag=reply.kv_tag), context_of(msg)))
        # it ends a little later, as a request does: off the supervisor's list of requests in flight
        asyncio.get_running_loop().call_later(FINISH_AFTER_S, self.state.requests.note, req.request_id, "finished",
                                              sim.spec.worker_id, req.attempt)

    async def lateness(self) -> None:
        """How late a timer fires, each LATE_EVERY_S: the loop busy (or its process off the CPU)."""
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            t = loop.time()
            await asyncio.sleep(LATE_EVERY_S)
            self.late_ms.append(round(1e3 * (loop.time() - t - LATE_EVERY_S), 3))

    async def take_jobs(self, sim: Sim, pull) -> None:
        while not self.stop.is_set():
            try:
                msgs = await pull.fetch(FETCH_JOBS, timeout=FETCH_WAIT_S)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            for msg in msgs:
                self.took(sim, len(PrefillJob.decode(msg.data).prompt_token_ids) // BLOCK)
                await msg.ack()

    def took(self, sim: Sim, blocks: int) -> None:
        """A request's blocks enter `sim`'s cache at its next step."""
        sim.pending += blocks
        self.stepping.add(sim)

    async def steps(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(STEP_S)
            stepping, self.stepping = self.stepping, set()
            for sim in stepping:
                sim.churn(sim.pending)
                sim.pending = 0

    async def fill(self, total_blocks: int) -> None:
        """Filler blocks up to `total_blocks` indexed across the fleet, then wait until written."""
        gate = asyncio.Semaphore(FILL_AT_ONCE)

        async def one(sim: Sim, count: int) -> None:
            async with gate:
                while sim.high - sim.low < count:
                    n = min(FILL_CHUNK, count - (sim.high - sim.low))
                    stored = filler(sim.spec.index, sim.high, sim.high + n)
                    sim.publish([CacheChange("stored", h) for h in stored])
                    sim.high += n
                    while not sim.prefix.queue.empty():  # at most two chunks in hand at a time
                        await asyncio.sleep(0.002)
        await asyncio.gather(*(one(s, c) for s, c in zip(self.sims, filler_counts(total_blocks, self.plan))))
        await self.settled()

    async def settled(self, timeout_s: float = 600) -> None:
        """Until every publisher has written all its blocks (its own count of them)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not all(s.settled() for s in self.sims):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("prefix index writes did not finish")
            await asyncio.sleep(0.05)

    def rewrites(self) -> int:
        """Caches rewritten whole since the start (a new prefix slot each: an update failed or
        the lease lapsed)."""
        return sum(getattr(s.prefix, "slot", 0) != s.first_slot for s in self.sims)

    async def close(self) -> None:
        self.stop.set()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for sim in self.sims:
            await self.state.registry.deregister(sim.spec.worker_id)
            await sim.prefix.close()


def store(url: str, workers: int) -> State:
    """The fleet's store: connections as if each simulated worker were its own process (its
    publisher's and its heartbeat's), not one process's pool shared by all of them."""
    return State(async_redis(url, max_connections=2 * workers + 16))


async def serve(plan_path: Path) -> None:
    settings = Common()
    setup_logging(settings, "fleet")
    plan = pickle.loads(plan_path.read_bytes())
    async with AsyncExitStack() as stack:
        bus = await Bus.connect(settings.nats_url, "scale-fleet")
        stack.push_async_callback(bus.close)
        state = store(settings.redis_url, len(plan))
        stack.push_async_callback(state.close)
        fleet = Fleet(plan, bus, state, settings.heartbeat_s, settings.prefix_index)
        await fleet.start()
        print("ready", flush=True)
        while line := await asyncio.to_thread(sys.stdin.readline):
            words = line.split()
            if words[:1] == ["fill"]:
                await fleet.fill(int(words[1]))
                gc.collect()
                gc.freeze()   # (its admits answered on time: no full collection walks the plan)
                print(f"filled {words[1]}", flush=True)
            elif words[:1] == ["admits"]:
                print(json.dumps({"admits": fleet.admits, "rewrites": fleet.rewrites(), "late_ms": fleet.late_ms}),
                      flush=True)
                fleet.admits, fleet.late_ms = [], []
            elif words[:1] == ["quit"]:
                break
        await fleet.close()


def main() -> None:
    run(serve(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
