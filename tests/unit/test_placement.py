"""Placement is decided in one place (pdserve/services/router/placement.py): the router, the capacity
planner's simulator and the scale check's replay, fed the same fleet, decide alike; and the
pure module's own rules."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from bench.scale.check import Placement as Placed
from bench.scale.check import Replay
from bench.scale.plan import Probe
from pdserve.planner.cluster import Cluster, Layout
from pdserve.planner.cost import DECODE_BATCHES, DECODE_CONTEXTS, Cost
from pdserve.planner.worker import Knobs, Req
from pdserve.services.router import placement
from pdserve.services.router.main import Router
from pdserve.services.router.placement import Ask, Books, Fleet, Placement, Refusal, Rules
from pdserve.shared.config import RouterSettings
from pdserve.shared.messages import AdmitReply, KVOutcome, RouteRequest, Sampling, WorkerInfo

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
    async def begin(self, *args) -> tuple[bool, dict]:
        return True, {}

    async def renew(self, *args) -> bool:
        return True


class _Requests:
    def note(self, *args, **kwargs) -> None:
        pass


class _State:
    placements, requests = _Placements(), _Requests()


def by_router(workers: list[WorkerInfo], prompts: list[int], settings: RouterSettings, outcomes=()):
    """The router's own path (Router.route): its registry cache, breakers, the decision, its
    claim and bookings (the claims granted, the admits answered yes)."""
    router = Router(settings, None, _State(), None)  # type: ignore[arg-type]
    router.pools.registry.entries = {w.worker_id: (w, math.inf) for w in workers}
    router.pools.registry.read = lambda state: asyncio.sleep(0)  # type: ignore[method-assign]
    router.admits.admit = lambda *a: asyncio.sleep(0, AdmitReply(request_id="r", ok=True))  # type: ignore
    for out in outcomes:
        router.breakers.record(out, time.monotonic())
    out = []
    for i, n in enumerate(prompts):
        req = RouteRequest(request_id=f"r{i}", prompt_token_ids=list(range(n)), model="m",
                           sampling=Sampling(max_tokens=32))
        reply = asyncio.run(router.route(req))
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
                                                {"prefill-1": (4, 4)}), Books(), Rules.of(settings)).placement
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
    pure = placement.decide(Ask(400, 32), Fleet([workers[2]], workers[:2], BS),
                            Books(blocked={"decode-0": {"prefill-0", "prefill-1"}}), Rules()).placement
    assert pure is not None and (pure.mode, pure.kind) == ("local", "breaker_open")


def order(ask: Ask, decodes: list[WorkerInfo], prefills=(), rules: Rules | None = None) -> list:
    """A plan's steps: each placement's (decode, prefill) in turn, then the refusal's kind."""
    return [(p.decode.worker_id, p.prefill.worker_id if p.prefill else None) if isinstance(p, Placement) else p.kind
            for p in placement.decide(ask, Fleet(decodes, list(prefills), BS), Books(), rules or Rules())]


def test_a_plan_lists_every_worker_best_first_avoided_last_a_takeovers_first_then_refuses():
    decodes = [w for w in fleet(0, 3, decode_0={"running": 1}, decode_1={"running": 2}) if w.role == "decode"]
    names = lambda **kw: [d for d, _ in order(Ask(100, 16, **kw), decodes)[:-1]]  # noqa: E731
    assert names() == ["decode-2", "decode-0", "decode-1"]
    assert names(avoid=["decode-2"]) == ["decode-0", "decode-1", "decode-2"]
    assert names(chosen_before="decode-1") == ["decode-1", "decode-2", "decode-0"]
    assert order(Ask(100, 16), decodes)[-1] == "no_room"          # every one asked and refused
    assert order(Ask(10**6, 16), decodes) == ["no_room"]          # no room anywhere: nobody is asked
    assert order(Ask(100, 16), []) == ["no_decode_worker"]


def test_a_plan_ranks_the_pool_only_when_its_first_placement_is_refused(monkeypatch):
    decodes = [w for w in fleet(0, 2) if w.role == "decode"]
    ranked = []
    real = placement.policy.decode_candidates
    monkeypatch.setattr(placement.policy, "decode_candidates", lambda *a: ranked.append(1) or real(*a))
    plan = placement.decide(Ask(100, 16), Fleet(decodes, [], BS), Books(), Rules())
    assert plan.placement is not None and plan.placement.decode.worker_id == "decode-0" and not ranked
    steps = list(plan)
    assert len(steps) == 3 and isinstance(steps[-1], Refusal) and ranked == [1]


def test_round_robin_moves_its_cursor_within_a_plan_as_each_remote_placement_is_tried():
    workers = fleet(2, 2)
    rules = Rules(prefill_choice="round_robin", placement="remote")
    got = order(Ask(400, 16), [w for w in workers if w.role == "decode"], [w for w in workers if w.role == "prefill"],
                rules)
    assert got == [("decode-0", "prefill-0"), ("decode-1", "prefill-1"), "no_room"]


def test_the_ttft_objective_refuses_a_new_request_not_a_failover_nor_a_requeue():
    slow = fleet(1, 1, prefill_0={"queued_tokens": 30_000})   # 30 s queued at 1000 tokens/s
    decodes, prefills = slow[1:], slow[:1]
    rules = Rules(placement="remote", ttft_slo_s=5.0)
    refused = placement.decide(Ask(400, 16), Fleet(decodes, prefills, BS), Books(), rules).first
    assert isinstance(refused, Refusal) and refused.kind == "ttft_objective"
    assert refused.retry_after_s == pytest.approx(30.4 - 5.0) and "exceeds the 5 s objective" in refused.reason
    for ask in (Ask(400, 16, generated=10, attempt=1), Ask(400, 0, bound_to="decode-0")):
        chosen = placement.decide(ask, Fleet(decodes, prefills, BS), Books(), rules).placement
        assert chosen is not None and chosen.prefill is not None
        assert chosen.expected_prefill_s == pytest.approx((30_000 + ask.tokens) / 1000)
    assert placement.decide(Ask(400, 16), Fleet(decodes, prefills, BS), Books(), Rules(placement="remote")).placement


def test_a_requeue_is_bound_to_its_decode_worker_even_without_room_and_never_says_resumed():
    full = fleet(1, 2, decode_0={"free_blocks": 0})
    ask = Ask(400, 0, generated=50, attempt=1, bound_to="decode-0")
    got = placement.decide(ask, Fleet(full[1:], full[:1], BS), Books(), Rules()).placement
    assert got is not None and got.decode.worker_id == "decode-0" and got.kind != "resumed"
    assert got.prefill is not None and got.prefill.worker_id == "prefill-0"


def test_the_router_asks_the_next_decode_worker_when_one_refuses_and_books_only_the_taken_admit():
    settings = RouterSettings(placement="remote")
    router = Router(settings, None, _State(), None)  # type: ignore[arg-type]
    workers = fleet(1, 2)
    router.pools.registry.entries = {w.worker_id: (w, math.inf) for w in workers}
    router.pools.registry.read = lambda state: asyncio.sleep(0)  # type: ignore[method-assign]
    asked: list[str] = []

    async def admit(chosen, req):
        asked.append(chosen.decode.worker_id)
        return AdmitReply(request_id=req.request_id, ok=chosen.decode.worker_id != "decode-0")
    router.admits.admit = admit  # type: ignore[method-assign]
    req = RouteRequest(request_id="r", prompt_token_ids=list(range(400)), model="m", sampling=Sampling(max_tokens=8))
    reply = asyncio.run(router.route(req))
    assert asked == ["decode-0", "decode-1"] and reply.ok and reply.decode_worker == "decode-1"
    now = time.monotonic()
    assert router.bookings.admitted.totals(now) == {"decode-1": 1}
    assert router.bookings.sent.totals(now) == {"prefill-0": 400}  # the refused admit's booking taken back
    assert router.bookings.turn == 2


def test_a_failover_is_placed_like_a_new_request_and_says_it_resumed():
    workers = fleet(1, 1)
    chosen = placement.decide(Ask(300, 16, generated=100, attempt=1), Fleet(workers[1:], workers[:1], BS),
                              Books(), Rules()).placement
    assert chosen is not None and chosen.kind == "resumed"
    assert chosen.reason.startswith("resumed after 100 tokens (attempt 1): ")
    assert chosen.prefill is not None and chosen.prefill.worker_id == "prefill-0"


def test_the_cursor_moves_with_each_remote_placement_only():
    assert placement.next_turn(3, True) == 4 and placement.next_turn(3, False) == 3
