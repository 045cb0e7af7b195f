"""The capacity planner's simulator (planner) against hand-computed timelines, with a made-up
cost model: prefill 10 ms + 1 ms per token, every decode step 20 ms."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pdserve.planner import workloads
from pdserve.planner.cluster import Layout, simulate
from pdserve.planner.cost import DECODE_BATCHES, DECODE_CONTEXTS, Cost, fit, level
from pdserve.planner.plan import search
from pdserve.planner.slo import Slo, relative, score, weighted_percentile
from pdserve.planner.worker import PARAMS, Knobs
from pdserve.shared.engine.scheduler import prefill_chunks, prefill_next, prefill_order

STEP = 0.02
COST = Cost(prefill=(0.01, 0.001, 0.0, 0.0, 0.0), decode_batches=DECODE_BATCHES, decode_contexts=DECODE_CONTEXTS,
            decode_grid=tuple((STEP,) * len(DECODE_CONTEXTS) for _ in DECODE_BATCHES), kv_bytes_per_token=1000,
            layers=10, handoff_fixed_s=0.001, handoff_bytes_per_s=1e9)
WHOLE = Knobs(prefill_chunk=2048, max_batched_tokens=4096)


def colocated(chunk: int = 2048, **knobs) -> Layout:
    return Layout("colocated", decode=1, decode_cost=COST,
                  decode_knobs=Knobs(prefill_chunk=chunk, max_batched_tokens=max(chunk, 256), **knobs))


def disaggregated(p: int = 1, d: int = 1) -> Layout:
    return Layout("disaggregated", prefill=p, decode=d, decode_cost=COST, prefill_cost=COST, decode_knobs=WHOLE,
                  prefill_knobs=WHOLE)


def gaps_of(out, kind: str = "request") -> dict[float, int]:
    return out.gap_counts(kind)


def test_one_request_colocated():
    out = simulate(colocated(), [(0.0, 100, 10, "request")])
    r = out.requests[0]
    assert r.first_at == pytest.approx(0.11)
    assert r.last_at == pytest.approx(0.11 + 9 * STEP)
    assert sum(gaps_of(out).values()) == 9
    assert weighted_percentile(gaps_of(out), 99) == pytest.approx(STEP)


def test_one_request_disaggregated_waits_for_its_kv():
    out = simulate(disaggregated(), [(0.0, 100, 10, "request")])
    r = out.requests[0]
    kv_ready = 0.11 + 0.001 + 100 * 1000 / 10 / 1e9   # the last layer after the prefill's last pass
    assert r.first_at == pytest.approx(0.11)          # published by the prefill worker
    assert r.last_at == pytest.approx(kv_ready + 9 * STEP)
    assert max(gaps_of(out)) == pytest.approx(kv_ready + STEP - 0.11)


def _interference(layout: Layout) -> float:
    """A victim streaming 200 tokens while a 1000-token prompt arrives: its longest token gap."""
    out = simulate(layout, [(0.0, 10, 200, "victim"), (1.0, 1000, 2, "aggressor")])
    assert all(r.last_at is not None for r in out.requests)
    return max(gaps_of(out, "victim"))


def test_a_long_prompt_stalls_colocated_streams_but_not_disaggregated_ones():
    whole, chunked, disagg = _interference(colocated()), _interference(colocated(chunk=128)), \
        _interference(disaggregated())
    assert whole == pytest.approx(0.01 + 1.0 + 0.001)        # the whole prompt's pass, its token in it
    assert chunked == pytest.approx(0.01 + 0.128 + 0.001)    # one chunk at a time
    assert disagg == pytest.approx(STEP + 0.001, abs=1e-5)  # its first step after its own KV came
    # passes that alternate: the pass, then the step
    assert _interference(colocated(mixed_batches=False)) == pytest.approx(STEP + 0.01 + 1.0)
    assert _interference(colocated(chunk=128, mixed_batches=False)) == pytest.approx(STEP + 0.01 + 0.128)


def test_a_mixed_pass_holds_a_chunk_and_the_running_sequences_tokens():
    out = simulate(colocated(chunk=128), [(0.0, 10, 200, "victim"), (1.005, 1000, 2, "aggressor")])
    victim, aggressor = out.requests
    # the step under way at 1.005 ends at 1.02; then 8 passes (7 x 128 + 104 tokens) with the victim's token in each
    assert aggressor.first_at == pytest.approx(1.02 + 8 * (0.01 + 0.001) + 1.0)
    # 8 of the victim's 199 tokens come from those passes, the others from steps
    assert victim.last_at == pytest.approx(0.02 + 191 * STEP + 8 * (0.01 + 0.001) + 1.0)
    assert sum(gaps_of(out, "victim").values()) == 199


def test_chunks_and_decode_steps_alternate():
    out = simulate(colocated(chunk=128, mixed_batches=False),
                   [(0.0, 10, 200, "victim"), (1.005, 1000, 2, "aggressor")])
    victim, aggressor = out.requests
    # the step under way at 1.005 ends at 1.02; then 8 chunks (7 x 128 + 104) with a decode step between each
    assert aggressor.first_at == pytest.approx(1.02 + 8 * 0.01 + 1.0 + 7 * STEP)
    # the victim's 199 steps, plus the chunk passes (the aggressor's one decode step is one of them)
    assert victim.last_at == pytest.approx(0.02 + 199 * STEP + 8 * 0.01 + 1.0)


def test_a_pass_fills_its_budget_in_the_schedulers_order():
    class P:
        def __init__(self, n: int, done: int = 0) -> None:
            self.token_ids, self.num_computed, self.params = range(n), done, PARAMS
    long, short, other = P(300), P(50), P(400, 100)
    order = prefill_order([long, short, other], 128)
    assert order == [long, short, other]        # the oldest long one, the short ones, the other long ones
    chunks = prefill_chunks(order, running=0, max_num_seqs=64, budget=256, chunk=128, admit=lambda q: True)
    assert chunks == [(long, 128), (short, 50), (other, 78)]
    assert prefill_chunks(order, running=63, max_num_seqs=64, budget=256, chunk=128, admit=lambda q: True) == \
        [(long, 128)]                            # one seat left in the batch
    assert prefill_chunks(order, 0, 64, 256, 128, admit=lambda q: q is not short) == [(long, 128)]  # no room: in order
    assert prefill_next(True, True, last_was_decode=True) and not prefill_next(True, True, last_was_decode=False)
    assert prefill_next(True, False, last_was_decode=False) and not prefill_next(False, True, True)


def test_a_pass_follows_the_engine_schedulers_order():
    # chunk 128, budget 256: the oldest long prompt takes a chunk, the short one finishes in the same pass
    layout = Layout("colocated", decode=1, decode_cost=COST, decode_knobs=Knobs(prefill_chunk=128,
                                                                                 max_batched_tokens=256,
                                                                                 mixed_batches=False))
    out = simulate(layout, [(0.0, 100, 1, "first"), (0.05, 300, 2, "long"), (0.06, 50, 2, "short")])
    first, long, short = out.requests
    assert first.first_at == pytest.approx(0.11)                  # both arrive during its pass, then share one
    assert short.first_at == pytest.approx(0.11 + 0.01 + 0.128 + 0.05)
    # the short one's decode step, then the long one's last 172 tokens, a chunk at a time
    assert long.first_at == pytest.approx(short.first_at + STEP + (0.01 + 0.128) + (0.01 + 0.044))


def test_every_request_finishes_and_every_block_comes_back():
    rng = random.Random(1)
    reqs = [(rng.uniform(0, 20), rng.randrange(1, 600), rng.randrange(1, 80), rng.choice("ab")) for _ in range(300)]
    layout = disaggregated(2, 2)
    layout.decode_knobs = Knobs(kv_blocks=64, max_num_seqs=8)  # little room: some wait at the router
    out = simulate(layout, reqs)
    assert all(r.first_at is not None and r.last_at is not None and r.last_at >= r.first_at for r in out.requests)
    for kind in "ab":
        assert sum(out.gap_counts(kind).values()) == sum(o - 1 for _, _, o, k in reqs if k == kind)
    for r in out.requests:
        assert r.decode is not None and r.decode.booked_blocks == 0 and not r.decode.queue
        assert r.decode.running == 0
        assert r.decode.peak <= 8  # max_num_seqs


def test_a_batch_never_passes_max_num_seqs():
    # prefill outpaces decode: KV lands while the decode worker's batch is full and a step is under way
    rng = random.Random(1)
    reqs = [(rng.uniform(0, 5), rng.randrange(1, 100), rng.randrange(2, 80), "a") for _ in range(300)]
    layout = disaggregated(3, 1)
    layout.decode_knobs = Knobs(kv_blocks=4096, max_num_seqs=4)
    out = simulate(layout, reqs)
    assert out.requests[0].decode.peak == 4    # a sequence about to join counts before it has joined


def test_a_full_worker_holds_new_requests_until_a_sequence_finishes():
    layout = colocated(max_num_seqs=2)
    out = simulate(layout, [(0.0, 10, 5, "request")] * 3)
    third = max(out.requests, key=lambda r: r.first_at)
    assert third.first_at > min(r.last_at for r in out.requests[:2])


def test_fit_recovers_the_costs_it_was_made_from():
    true = (0.05, 0.002, 1e-7, 3e-7, 0.004)
    grid = ((1,) * len(DECODE_CONTEXTS),) * len(DECODE_BATCHES)
    points = [{"new": new, "cached": cached, "s": Cost(true, DECODE_BATCHES, DECODE_CONTEXTS, grid,
                                                          0, 1, 0, 1).prefill_s(list(zip(new, cached)))}
              for new, cached in [([16], [0]), ([512], [0]), ([2000], [0]), ([128], [896]), ([256], [768]),
                                  ([64] * 4, [0] * 4), ([16] * 16, [0] * 16)]]
    decode = [{"batch": b, "context": n, "s": 0.05 + 0.001 * b * n ** 0.5} for b in DECODE_BATCHES
              for n in DECODE_CONTEXTS]
    model = fit({"prefill": points, "decode": decode})
    got = [model["prefill_model"][k] for k in ("fixed_s", "per_token_s", "self_attention_s",
                                               "context_attention_s", "per_seq_s")]
    assert got == pytest.approx(true, rel=1e-6)
    profile = {"shapes": {"x": {**model, "kv_bytes_per_token": 1, "layers": 1}}, "handoff": {"fixed_s": 0, "gbps": 1}}
    cost = Cost.of(profile, "x")
    assert cost.decode_s(16, 16 * 256) == pytest.approx(0.05 + 0.001 * 16 * 16)   # on the grid
    between = cost.decode_s(8, 8 * 256)                                              # linear in between
    assert between == pytest.approx((0.05 + 0.001 * 4 * 16) + (0.001 * 16 * 16 - 0.001 * 4 * 16) * (8 - 4) / 12)


def test_relative_slos_come_from_the_profile():
    slo = relative(COST, [100] * 9 + [1000], ttft_x=4, tpot_x=2)
    assert slo.ttft_s == pytest.approx(4 * (0.01 + 0.001 * int(__import__("numpy").percentile([100] * 9 + [1000], 90))))
    assert slo.tpot_s == pytest.approx(2 * STEP)


def test_goodput_search_ends_where_attainment_falls():
    trace = [workloads.Request(0.0, [1] * 50, 20) for _ in range(50)]
    layout = colocated()
    found = search(layout, trace, Slo(0.5, 0.1), seconds=20, seed=0)
    assert found["goodput_rate"] > 0
    at = {p["rate"]: p["slo_attainment"] for p in found["points"]}
    assert at[found["goodput_rate"]] >= 0.9
    assert min(at.values()) < 0.9 and max(r for r, a in at.items() if a < 0.9) > found["goodput_rate"]
    s = score(simulate(layout, [(0.0, 50, 20, "request")]), Slo(0.5, 0.1), 0.0)
    assert s["slo_attainment"] == 1.0


def test_a_prompt_waits_for_its_decode_workers_step_to_be_admitted():
    """The decode worker reserves the blocks on its engine thread, after the step under way:
    a prompt arriving at 1.005 mid-step is prefilled from that step's end."""
    out = simulate(disaggregated(), [(0.0, 10, 200, "victim"), (1.005, 100, 2, "aggressor")])
    steps_from = 0.02 + 0.001 + 10 * 1000 / 10 / 1e9      # the victim's KV landed: its steps begin
    assert out.requests[1].first_at == pytest.approx(steps_from + 50 * STEP + 0.01 + 0.1)


def test_workers_sharing_a_core_share_its_time():
    """Two decode workers on one core: a stream alone there steps at full speed; two streams,
    one on each, step at half."""
    def median_gap(share: int, streams: int) -> float:
        layout = Layout("colocated", decode=2, decode_cost=COST, decode_knobs=WHOLE, decode_per_core=share)
        return weighted_percentile(gaps_of(simulate(layout, [(0.0, 10, 100, "request")] * streams)), 50)

    assert median_gap(2, 1) == pytest.approx(STEP)
    assert median_gap(1, 2) == pytest.approx(STEP)
    assert median_gap(2, 2) == pytest.approx(2 * STEP)


def test_a_prefill_worker_counts_prompts_booked_while_their_admission_waits():
    """Four prompts placed within a decode step all wait for its end to be admitted; the
    router booked each on a prefill worker as it placed it, so they spread over both."""
    reqs = [(0.0, 10, 200, "victim")] + [(1.0 + i / 1000, 100, 2, "request") for i in range(4)]
    first = [r.first_at for r in simulate(disaggregated(p=2), reqs).requests[1:]]
    assert first[0] == first[1] and first[2] == first[3] and first[2] == pytest.approx(first[0] + 0.11)


def test_a_probe_rescales_the_profile_by_the_machines_drift():
    """A machine 1.5x slower at prefill and 2x at decode since its profile: `level` says so from
    the probe's points alone, and the rescaled cost predicts the slower passes and steps."""
    shape = {"prefill": [{"new": [64], "cached": [0], "s": 0.1}, {"new": [256], "cached": [0], "s": 0.4},
                         {"new": [512], "cached": [0], "s": 0.8}],
             "decode": [{"batch": 1, "context": 256, "s": 0.02}, {"batch": 4, "context": 256, "s": 0.03}]}
    probe = {"prefill": [{"new": [64], "cached": [0], "s": 0.15}, {"new": [256], "cached": [0], "s": 0.6}],
             "decode": [{"batch": 1, "context": 256, "s": 0.04}, {"batch": 4, "context": 256, "s": 0.06},
                        {"batch": 8, "context": 256, "s": 1.0}]}   # (a point the profile lacks: not compared)
    drift = level(shape, probe)
    assert drift == pytest.approx({"prefill": 1.5, "decode": 2.0})
    slower = dataclasses.replace(COST, service_step_s=(0.01, 0.001)).scaled(**drift)
    assert slower.prefill_s([(100, 0)]) == pytest.approx(1.5 * COST.prefill_s([(100, 0)]))
    assert slower.step_s(4, 400) == pytest.approx(2 * (STEP + 0.01 + 0.004))
    assert level(shape, {"prefill": [], "decode": []}) == {"prefill": 1.0, "decode": 1.0}


def test_a_short_prompt_behind_a_long_one_is_prefilled_on_the_decode_worker():
    """PD_PLACEMENT=cheapest (the router's default): the prefill worker is 1 s into a 1000-token
    prompt, so a 10-token one goes to the decode worker, as the router would place it."""
    reqs = [(0.0, 1000, 2, "aggressor"), (0.1, 10, 5, "victim")]
    victim = simulate(disaggregated(), reqs).requests[1]
    assert victim.first_at == pytest.approx(0.1 + 0.01 + 0.01)    # its own pass there, at once
    remote = dataclasses.replace(disaggregated(), placement="remote")
    assert simulate(remote, reqs).requests[1].first_at == pytest.approx(1.01 + 0.01 + 0.01)  # behind it
