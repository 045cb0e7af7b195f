"""The prefix index in the routers' memory (PD_PREFIX_INDEX=events) against a real nats-server
(JetStream) and redis-server: workers' publishers (pdserve/shared/prefix_events.py) feeding two routers'
followers (pdserve/services/router/prefix_follower.py) that answer alike; a lost event, lost last
events, a worker's restart and a router's restart each end in a snapshot and an index equal to
the worker's cache; and the memory index answers as the Redis index's script does."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import nats.errors
from opentelemetry import trace

from pdserve.services.router.indexes import EventsIndex
from pdserve.services.router.main import Router
from pdserve.services.router.prefix_follower import PrefixFollower
from pdserve.services.router.prefix_memory import MemoryIndex
from pdserve.shared.bus import Bus
from pdserve.shared.config import RouterSettings
from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.hashing import block_hashes
from pdserve.shared.messages import RouteRequest, Sampling, WorkerInfo
from pdserve.shared.prefix_events import PrefixEventPublisher
from pdserve.shared.prefix_index import PrefixPublisher, lookup
from pdserve.shared.state import State


class Cache:
    """A worker's prefix cache as its engine host hands it on: each change counted as drained."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.drained = 0

    def step(self, stored: Sequence[int] = (), evicted: Sequence[int] = ()) -> list[CacheChange]:
        changes = [CacheChange("stored", h) for h in stored if h not in self.hashes]
        changes += [CacheChange("evicted", h) for h in evicted if h in self.hashes]
        self.hashes |= {c.block_hash for c in changes if c.kind == "stored"}
        self.hashes -= {c.block_hash for c in changes if c.kind == "evicted"}
        self.drained += len(changes)
        return changes

    async def snapshot(self) -> tuple[list[int], int]:
        return sorted(self.hashes), self.drained


class Fleet:
    """Workers publishing their caches' changes, and the registry entries they heartbeat."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.caches: dict[str, Cache] = {}
        self.pubs: dict[str, PrefixEventPublisher] = {}

    async def start(self, worker_id: str) -> None:
        if worker_id in self.pubs:
            await self.pubs[worker_id].close()
        self.caches[worker_id] = Cache()
        self.pubs[worker_id] = PrefixEventPublisher(self.bus, worker_id, self.caches[worker_id].snapshot)
        await self.pubs[worker_id].start()

    def step(self, worker_id: str, stored: Sequence[int] = (), evicted: Sequence[int] = ()) -> None:
        self.pubs[worker_id].publish(self.caches[worker_id].step(stored, evicted))

    async def registered(self) -> list[WorkerInfo]:
        return [WorkerInfo(worker_id=w, role="prefill", prefix_epoch=p.epoch, prefix_seq=p.seq)
                for w, p in self.pubs.items()]

    async def close(self) -> None:
        for p in self.pubs.values():
            await p.close()


def _matches(follower: PrefixFollower, fleet: Fleet) -> bool:
    feeds = follower.feeds.feeds
    return all(w in feeds and feeds[w].holder is not None and feeds[w].buffered is None
               and follower.index.held(feeds[w].holder) == c.hashes for w, c in fleet.caches.items())


async def _converged(follower: PrefixFollower, fleet: Fleet, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if _matches(follower, fleet):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{follower.id} did not converge: {follower.feeds.feeds}")


async def _follower(nats_url: str, name: str, fleet: Fleet, stop: asyncio.Event) -> tuple[PrefixFollower, Bus]:
    bus = await Bus.connect(nats_url, name)
    follower = PrefixFollower(bus, name, fleet.registered, gone_s=30)
    follower.feeds.behind_s = 0.3
    await follower.start()
    asyncio.get_running_loop().create_task(follower.keep(stop))
    return follower, bus


def _leading(fleet: Fleet, hashes: list[int]) -> dict[str, int]:
    out = {}
    for w, c in fleet.caches.items():
        n = next((i for i, h in enumerate(hashes) if h not in c.hashes), len(hashes))
        if n:
            out[w] = n
    return out


def _drop_next_publish(pub: PrefixEventPublisher) -> None:
    """The worker's next message is lost (the stream never gets it)."""
    js, real = pub.bus.js, pub.bus.js.publish

    async def lost(*args, **kwargs):
        js.publish = real  # type: ignore[method-assign]
        raise nats.errors.TimeoutError

    js.publish = lost  # type: ignore[method-assign]


def test_routers_fed_by_the_stream_answer_alike_and_converge_after_gaps_and_restarts(nats_url):
    async def run() -> None:
        stop = asyncio.Event()
        fleet = Fleet(await Bus.connect(nats_url, "workers"))
        for w in ("p0", "p1", "p2"):
            await fleet.start(w)
        fleet.step("p0", stored=list(range(1, 30)))            # before any router: taken by snapshot
        a, bus_a = await _follower(nats_url, "router-a", fleet, stop)
        b, bus_b = await _follower(nats_url, "router-b", fleet, stop)
        chain = list(range(100, 140))
        for i, w in enumerate(("p0", "p1", "p2")):
            fleet.step(w, stored=chain[:10 * (i + 2)])
        fleet.step("p1", evicted=chain[15:18])
        for f in (a, b):
            await _converged(f, fleet)
        prompts = [chain[:n] + [7] for n in (0, 5, 16, 25, 40)] + [list(range(1, 40))]
        assert [a.lookup(p) for p in prompts] == [b.lookup(p) for p in prompts] == [_leading(fleet, p) for p in prompts]
        assert a.lookup(chain[:40]) == {"p0": 20, "p1": 15, "p2": 40}

        _drop_next_publish(fleet.pubs["p2"])                    # a lost event, shown by the next one
        fleet.step("p2", evicted=chain[30:40])
        await asyncio.sleep(0.1)
        fleet.step("p2", stored=[500])
        await asyncio.sleep(0.1)
        _drop_next_publish(fleet.pubs["p0"])                    # lost last events: shown by the registry
        fleet.step("p0", evicted=list(range(1, 10)))
        await fleet.start("p1")                                 # a restart: a new life, another cache
        fleet.step("p1", stored=chain[:3])
        for f in (a, b):
            await _converged(f, fleet)
        assert a.feeds.snapshots >= 6 and a.lookup(chain[:40]) == b.lookup(chain[:40]) == {"p0": 20, "p1": 3, "p2": 30}

        c, bus_c = await _follower(nats_url, "router-c", fleet, stop)   # a router (re)started now
        await _converged(c, fleet)
        assert [c.lookup(p) for p in prompts] == [a.lookup(p) for p in prompts]
        stop.set()
        for f, bus in ((a, bus_a), (b, bus_b), (c, bus_c)):
            await f.close()
            await bus.close()
        await fleet.close()
        await fleet.bus.close()

    asyncio.run(run())


def test_the_memory_index_answers_as_the_redis_script_for_random_fleets(redis_url):
    """The same caches written to Redis by the workers' publishers and to a memory index: every
    prompt gets the same leading blocks per worker from `_LOOKUP` and from `MemoryIndex.lookup`."""
    async def run() -> None:
        rng = random.Random(11)
        state = State.connect(redis_url)
        await state.r.flushdb()
        chains = [[rng.getrandbits(64) for _ in range(rng.randint(2, 30))] for _ in range(8)]
        index, pubs = MemoryIndex(), {}
        for i in range(24):
            cache = set()
            for chain in rng.sample(chains, rng.randint(1, 4)):
                cache.update(chain[:rng.randint(1, len(chain))])
            if rng.random() < 0.3:
                cache.discard(rng.choice(sorted(cache)))
            w = f"w{i}"
            pubs[w] = PrefixPublisher(state, w, lease_s=30)
            await pubs[w].start()
            pubs[w].publish([CacheChange("stored", h) for h in sorted(cache)])
            index.apply(index.holder(w), sorted(cache), [])
        for _ in range(200):
            if all(p.size == index.sizes[k] for k, p in enumerate(pubs.values())):
                break
            await asyncio.sleep(0.02)
        slots = {p.slot: w for w, p in pubs.items()}
        for _ in range(100):
            chain = rng.choice(chains)
            prompt = chain[:rng.randint(1, len(chain))] + [rng.getrandbits(64) for _ in range(rng.randint(0, 2))]
            by_redis = {slots[s]: n for s, n in (await lookup(state, prompt)).items()}
            assert by_redis == index.lookup(prompt)
        for p in pubs.values():
            await p.close()
        await state.close()

    asyncio.run(run())


def test_a_router_set_to_events_places_from_its_memory_index(nats_url, redis_url):
    """Router(prefix_index=events): the workers' entries from the registry, their caches from the
    stream, `holding` answered by worker with no Redis lookup (the Redis index is empty here)."""
    async def run() -> None:
        state = State.connect(redis_url)
        await state.r.flushdb()
        fleet = Fleet(await Bus.connect(nats_url, "workers"))
        await fleet.start("prefill-0")
        hashes = block_hashes(list(range(64)), 16)
        fleet.step("prefill-0", stored=hashes[:3])
        for w in await fleet.registered():
            await state.registry.heartbeat(w.model_copy(update={"model": "m", "cached_blocks": 3}), 30)
        bus = await Bus.connect(nats_url, "router")
        router = Router(RouterSettings(prefix_index="events"), bus, state, trace.get_tracer("test"))
        assert isinstance(router.index, EventsIndex)
        await router.index.follower.start()
        pool = (await router.pools.read())["m"]
        await router.index.follower.tick()
        for _ in range(100):
            if (await router.index.holding(pool, hashes))[0]:
                break
            await asyncio.sleep(0.05)
        assert await router.index.holding(pool, hashes) == ({"prefill-0": (3, 3)}, [])
        assert await Router(RouterSettings(prefix_index="redis"), bus, state,
                            trace.get_tracer("test")).index.holding(pool, hashes) == ({}, [])
        # nothing read from Redis before deciding: no conversation, the index in memory
        req = RouteRequest(request_id="r", prompt_token_ids=list(range(64)), model="m", sampling=Sampling())
        ask, placed = await router.inputs.of_route(req)
        assert ask.session_worker is None and placed.cached == {"prefill-0": (3, 3)}
        await state.sessions.set_worker("s1", "decode-0", 60)
        ask, _ = await router.inputs.of_route(req.model_copy(update={"session_id": "s1"}))
        assert ask.session_worker == "decode-0"
        await router.index.close()
        await bus.close()
        await fleet.close()
        await fleet.bus.close()
        await state.close()

    asyncio.run(run())
