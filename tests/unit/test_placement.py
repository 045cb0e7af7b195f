"""Placement is decided in one place (services/router/placement.py): the router, the capacity
planner's simulator and the scale check's replay, fed the same fleet, decide alike; and the
pure module's own rules."""

from __future__ import annotations

import asyncio
import math
import time

from bench.scale.check import Placement as Placed
from bench.scale.check import Replay
from bench.scale.plan import Probe
from planner.cluster import Cluster, Layout
from planner.cost import DECODE_BATCHES, DECODE_CONTEXTS, Cost
from planner.worker import Knobs, Req
from services.router import placement
from services.router.main import Router, Waits
from services.router.placement import Ask, Books, Fleet, Rules
from shared.config import RouterSettings
from shared.messages import AdmitReply, KVOutcome, RouteRequest, Sampling, WorkerInfo

BS = 16
COST = Cost(prefill=(0.01, 0.001, 0.0, 0.0, 0.0), decode_batches=DECODE_BATCHES, decode_contexts=DECODE_CONTEXTS,
            decode_grid=tuple((0.02,) * len(DECODE_CONTEXTS) for _ in DECODE_BATCHES), kv_bytes_per_token=1000,
            layers=10, handoff_fixed_s=0.001, handoff_bytes_per_s=1e9)
KNOBS = Knobs(kv_blocks=4096, block_size=BS)
FIELDS = ("running", "waiting", "free_blocks", "growth_blocks", "queued_tokens", "prefill_tokens_per_s")


def worker(worker_id: str, **fields) -> WorkerInfo:
    role = "prefill" if worker_id.startswith("prefill") else "decode"
    return WorkerInfo(worker_id=worker_id, role=role, model="m", block_size=BS, total_blocks=4096,
                      **{"free_blocks": 4096, "prefill_tokens_per_s": 1000.0, **fields})


def fleet(prefills: int = 2, decodes: int = 2, **per_worker: dict) -> list[WorkerInfo]:
    ids = [f"prefill-{i}" for i in range(prefills)] + [f"decode-{i}" for i in range(decodes)]
    return [worker(w, **per_worker.get(w.replace("-", "_"), {})) for w in ids]


class _Placements:
    async def hold(self, *args) -> bool:
        return True


class _State:
    placements = _Placements()


def by_router(workers: list[WorkerInfo], prompts: list[int], settings: RouterSettings, outcomes=()):
    """The router's own path: its registry cache, breakers, ranking, prefill choice and bookings
    (the admits answered yes)."""
    router = Router(settings, None, _State(), None)  # type: ignore[arg-type]
    router.pools.registry.entries = {w.worker_id: (w, math.inf) for w in workers}
    router.pools.registry.read = lambda state: asyncio.sleep(0)  # type: ignore[method-assign]
    router.admit = lambda *a: asyncio.sleep(0, AdmitReply(request_id="r", ok=True))  # type: ignore[method-assign]
    for out in outcomes:
        router.breakers.record(out, time.monotonic())
    out = []
    for i, n in enumerate(prompts):
        req = RouteRequest(request_id=f"r{i}", prompt_token_ids=list(range(n)), model="m",
                           sampling=Sampling(max_tokens=32))
        pool = asyncio.run(router.pools.pool("m"))
        reply = asyncio.run(router.place(req, f"k{i}", 10.0, Ask.of(req), Fleet.of(pool, {}), Waits()))
        out.append((reply.decode_worker, reply.prefill_worker))
    return out


def by_sim(workers: list[WorkerInfo], prompts: list[int], settings: RouterSettings):
    """The simulator's path: its workers given the registry's fields, each request placed (and
    acted on) in turn."""
    layout = Layout("disaggregated", decode=sum(w.role == "decode" for w in workers), decode_cost=COST,
                    prefill=sum(w.role == "prefill" for w in workers), prefill_cost=COST, decode_knobs=KNOBS,
                    prefill_knobs=KNOBS, local_below=settings.local_prefill_below,
                    placement=settings.placement, prefill_choice=settings.prefill_choice)
    cluster = Cluster(layout)
    live = {w.worker_id for w in placement.live(workers, settings.stall_s)}
    for sim in cluster.prefills + cluster.decodes:
        info = next(w for w in workers if w.worker_id == sim.worker_id)
        for f in FIELDS:
            setattr(sim, f, getattr(info, f))
    cluster.prefills = [w for w in cluster.prefills if w.worker_id in live]
    cluster.room = {w: None for w in cluster.decodes if w.worker_id in live}
    out = []
    for i, n in enumerate(prompts):
        r = Req(i, 0.0, n, 32)
        chosen = cluster.decide(r)
        assert chosen is not None and cluster._place(r, 0.0)
        out.append((chosen.decode.worker_id, chosen.prefill.worker_id if chosen.prefill else None))
    return out


def by_replay(workers: list[WorkerInfo], prompts: list[int], settings: RouterSettings, cached=None):
    """The scale check's replay, its bookings as the router's own (each prompt sent, each admit)."""
    cached = cached or {}
    held = {h: [w] for w, hs in cached.items() for h in hs}
    replay = Replay(workers, {w.worker_id: len(cached.get(w.worker_id, ())) for w in workers}, held, settings)
    sent: dict[str, int] = {}
    admitted: dict[str, int] = {}
    turn, out = 0, []
    for i, n in enumerate(prompts):
        hashes = sorted(h for hs in cached.values() for h in hs)
        p = Placed(f"r{i}", Probe(i, list(range(n)), hashes), 32, "x", 0, 0, None, None)
        decode, prefill = replay.decide(p, dict(sent), dict(admitted), turn)
        out.append((decode, prefill))
        turn = placement.next_turn(turn, prefill is not None)
        if prefill:
            sent[prefill] = sent.get(prefill, 0) + n - replay.cached(p.probe).get(prefill, 0) * BS
        if decode:
            admitted[decode] = admitted.get(decode, 0) + 1
    return out


def all_three(workers, prompts, settings=None):
    settings = settings or RouterSettings()
    router, sim, replay = (f(workers, prompts, settings) for f in (by_router, by_sim, by_replay))
    assert router == sim == replay
    return router


def test_the_pool_takes_a_long_prompt_and_the_least_loaded_workers_get_it():
    workers = fleet(prefill_0={"queued_tokens": 3000}, decode_0={"running": 3})
    assert all_three(workers, [400]) == [("decode-1", "prefill-1")]


def test_a_short_prompt_behind_a_long_queue_is_prefilled_by_its_decode_worker():
    workers = fleet(1, 1, prefill_0={"queued_tokens": 20000})
    assert all_three(workers, [40]) == [("decode-0", None)]
    remote = RouterSettings(placement="remote")
    assert all_three(workers, [40], remote) == [("decode-0", "prefill-0")]


def test_below_the_local_threshold_and_without_a_live_prefill_worker_the_decode_worker_prefills():
    assert all_three(fleet(), [40], RouterSettings(local_prefill_below=64)) == [("decode-0", None)]
    hung = fleet(1, 1, prefill_0={"step_s": 600.0})          # a step running for ten minutes: not live
    assert all_three(hung, [400]) == [("decode-0", None)]
    draining = fleet(1, 2, decode_0={"draining": True})
    assert all_three(draining, [400]) == [("decode-1", "prefill-0")]


def test_round_robin_takes_the_prefill_workers_in_turn():
    settings = RouterSettings(prefill_choice="round_robin", placement="remote")
    chosen = all_three(fleet(3, 1), [400] * 4, settings)
    assert [p for _, p in chosen] == ["prefill-0", "prefill-1", "prefill-2", "prefill-0"]


def test_the_bookings_spread_a_burst_over_both_pools():
    chosen = all_three(fleet(), [400] * 4)
    assert {d for d, _ in chosen} == {"decode-0", "decode-1"} and {p for _, p in chosen} == {"prefill-0", "prefill-1"}


def test_router_and_replay_send_a_prompt_where_its_prefix_is_cached():
    settings, workers = RouterSettings(), fleet(prefill_1={"queued_tokens": 500})
    replay = by_replay(workers, [400], settings, cached={"prefill-1": [11, 12, 13, 14]})
    assert replay == [("decode-0", "prefill-1")]
    pure = placement.decide(Ask(400, 32), Fleet([w for w in workers if w.role == "decode"],
                                                [w for w in workers if w.role == "prefill"], BS,
                                                {"prefill-1": (4, 4)}), Books(), Rules.of(settings))
    assert pure is not None and pure.prefill is not None and pure.prefill.worker_id == "prefill-1"
    assert pure.kind == "cached_prefix" and pure.prefill.cached_tokens == 4 * BS


def test_a_failing_kv_path_is_skipped_and_all_failing_means_local():
    settings = RouterSettings(breaker_failures=2)
    fail = [KVOutcome(request_id="x", prefill_worker="prefill-0", decode_worker="decode-0", ok=False)] * 2
    workers = fleet(2, 1, prefill_1={"queued_tokens": 300})
    assert by_router(workers, [400], settings) == [("decode-0", "prefill-0")]
    assert by_router(workers, [400], settings, fail) == [("decode-0", "prefill-1")]
    both = fail + [fail[0].model_copy(update={"prefill_worker": "prefill-1"})] * 2
    assert by_router(workers, [400], settings, both) == [("decode-0", None)]
    pure = placement.place_prefill(Ask(400, 32), workers[2], Fleet([workers[2]], workers[:2], BS),
                                   Books(blocked={"decode-0": {"prefill-0", "prefill-1"}}), Rules())
    assert (pure.mode, pure.kind) == ("local", "breaker_open")


def test_rank_puts_avoided_workers_last_and_a_takeovers_worker_first():
    decodes = [w for w in fleet(0, 3, decode_0={"running": 1}, decode_1={"running": 2}) if w.role == "decode"]
    order = lambda **kw: [w.worker_id for w in placement.rank(Ask(100, 16, **kw), Fleet(decodes, []), Books(),  # noqa: E731
                                                               Rules())]
    assert order() == ["decode-2", "decode-0", "decode-1"]
    assert order(avoid=["decode-2"]) == ["decode-0", "decode-1", "decode-2"]
    assert order(chosen_before="decode-1") == ["decode-1", "decode-2", "decode-0"]
    assert placement.first(Ask(100, 16, avoid=["decode-2"]), Fleet(decodes, []), Books(), Rules()).worker_id \
        == "decode-0"
    assert placement.decide(Ask(10**6, 16), Fleet(decodes, []), Books(), Rules()) is None  # no room anywhere


def test_a_failover_is_placed_like_a_new_request_and_says_it_resumed():
    workers = fleet(1, 1)
    chosen = placement.plan(Ask(300, 16, generated=100, attempt=1), workers[1], Fleet(workers[1:], workers[:1], BS),
                            Books(), Rules())
    assert chosen.kind == "resumed" and chosen.reason.startswith("resumed after 100 tokens (attempt 1): ")
    assert chosen.prefill is not None and chosen.prefill.worker_id == "prefill-0"


def test_the_cursor_moves_with_each_remote_placement_only():
    assert placement.next_turn(3, True) == 4 and placement.next_turn(3, False) == 3
