"""Engine behaviour on the tiny random-weight model (same code paths as the real one)."""

import random

import pytest
from helpers import GREEDY, generate, run_all, tokens, transfer

from pdserve.shared.engine.block_manager import OutOfBlocks
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.quarantine import ALONE_STEPS


def prompts(n, lo=5, hi=70, seed=0):
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for i in range(n)}


def test_batched_decode_equals_each_sequence_alone(tiny):
    ps = prompts(8)
    together = generate(tiny, ps)
    for rid, ids in ps.items():
        assert generate(tiny, {rid: ids})[rid] == together[rid]
    assert len({tuple(v) for v in together.values()}) == 8


def test_chunked_prefill_equals_unchunked(tiny):
    ps = prompts(3, lo=100, hi=150)
    whole = generate(tiny, ps, max_batched_tokens=512, prefill_chunk=512)
    chunked = generate(tiny, ps, max_batched_tokens=64, prefill_chunk=32)
    assert chunked == whole


def test_preemption_under_a_small_pool_keeps_tokens_and_frees_blocks(tiny):
    ps = prompts(6, lo=20, hi=40)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = generate(tiny, ps, params)
    small = Engine(tiny, EngineConfig(num_blocks=14))  # 6 x ~5 blocks do not fit at once
    assert generate(tiny, ps, params, engine=small) == roomy
    assert small.scheduler.num_preemptions > 0


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_export_import_continues_exactly(tiny, shared_prefix):
    prompt = prompts(1, lo=70, hi=70, seed=3)["r0"]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reference = generate(tiny, {"x": prompt}, params)["x"]
    src = Engine(tiny, EngineConfig(num_blocks=64))
    dst = Engine(tiny, EngineConfig(num_blocks=64))
    if shared_prefix:  # the receiver already holds the first 48 tokens in its prefix cache
        dst.add_request("warm", prompt[:48] + [7, 7, 7], params)
        run_all(dst)
    first = transfer(src, dst, "x", prompt, params)
    assert dst.seqs["x"].num_cached == (48 if shared_prefix else 0)
    assert src.num_free_blocks == 64  # sender released its blocks after the handoff
    got = first.new_token_ids + tokens(run_all(dst)["x"])
    assert got == reference
    assert dst.num_free_blocks == 64


def test_seeded_sampling_is_reproducible_across_a_transfer(tiny):
    prompt = prompts(1, lo=40, hi=40, seed=5)["r0"]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    colocated = generate(tiny, {"s": prompt}, params)["s"]
    assert generate(tiny, {"s": prompt}, params)["s"] == colocated
    other = generate(tiny, {"s": prompt}, SamplingParams(**{**params.__dict__, "seed": 8}))["s"]
    assert other != colocated
    src, dst = Engine(tiny, EngineConfig(num_blocks=32)), Engine(tiny, EngineConfig(num_blocks=32))
    first = transfer(src, dst, "s", prompt, params)
    assert first.new_token_ids + tokens(run_all(dst)["s"]) == colocated


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)],
    ids=["greedy", "seeded"])
def test_a_failover_prefilled_on_another_engine_continues_exactly(tiny, params):
    """A stream moved after 9 tokens: another engine prefills prompt + those tokens, its KV goes
    to a third, which continues — the first token at index 9, the rest as if never moved."""
    prompt = prompts(1, lo=40, hi=40, seed=5)["r0"]
    reference = generate(tiny, {"s": prompt}, params)["s"]
    src, dst = Engine(tiny, EngineConfig(num_blocks=32)), Engine(tiny, EngineConfig(num_blocks=32))
    first = transfer(src, dst, "s", prompt, params, generated=reference[:9])
    assert first.num_generated_tokens == 10  # the tokens before count as generated
    rest = run_all(dst)["s"]
    assert first.new_token_ids + tokens(rest) == reference[9:]
    assert rest[-1].finished and rest[-1].num_generated_tokens == params.max_tokens
    assert src.num_free_blocks == dst.num_free_blocks == 32


def test_top_k_one_is_greedy(tiny):
    p = prompts(1, seed=9)
    greedy = generate(tiny, p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert generate(tiny, p, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True)) == greedy


def test_stop_conditions(tiny):
    p = prompts(1, seed=11)["r0"]
    free_run = generate(tiny, {"a": p}, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))["a"]
    stop_tok = free_run[5]
    eng = Engine(tiny, EngineConfig(num_blocks=64))
    eng.add_request("stop", p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                             stop_token_ids=(stop_tok,)))
    eng.add_request("len", p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    # eos made likely by banning nothing and asking for at least 10 tokens: min_tokens bans eos
    eng.add_request("min", p, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop_tok,),
                                            min_tokens=10, ignore_eos=True))
    outs = run_all(eng)
    assert tokens(outs["stop"]) == free_run[:free_run.index(stop_tok) + 1]
    assert outs["stop"][-1].finish_reason == "stop"
    assert len(tokens(outs["len"])) == 4 and outs["len"][-1].finish_reason == "length"
    assert stop_tok not in tokens(outs["min"])[:10] and len(tokens(outs["min"])) >= 10
    assert eng.num_free_blocks == 64


def test_abort_in_every_state_frees_blocks(tiny):
    eng = Engine(tiny, EngineConfig(num_blocks=64, max_batched_tokens=32, prefill_chunk=16))
    ps = prompts(3, lo=60, hi=60, seed=2)
    eng.add_request("waiting", ps["r0"], GREEDY)
    eng.add_request("running", ps["r1"], GREEDY)
    eng.add_request("parked", ps["r2"], GREEDY, prefill_only=True)
    eng.step()  # the first chunk of "waiting"
    assert eng.num_free_blocks < 64
    eng.abort("waiting")
    while "parked" in eng.seqs and eng.seqs["parked"].status.value != "parked":
        eng.step()
    eng.reserve("importing", ps["r0"], GREEDY)
    for rid in ("running", "parked", "importing", "unknown"):
        eng.abort(rid)
    assert eng.num_free_blocks == 64 and not eng.seqs and not eng.has_work()


def test_layer_hook_sees_each_layer_once_its_kv_is_written(tiny):
    eng = Engine(tiny, EngineConfig(num_blocks=32))
    prompt = prompts(1, lo=40, hi=40)["r0"]
    seen = []
    eng.layer_hook = lambda layer: seen.append((layer, eng.runner.kv[layer].clone()))
    eng.add_request("h", prompt, GREEDY, prefill_only=True)
    eng.step()
    assert [layer for layer, _ in seen] == list(range(tiny.config.num_layers))
    export = eng.export_kv("h")
    table = eng.seqs["h"].block_table
    for layer, snapshot in seen:  # a layer's KV was final when its hook ran
        assert (snapshot[table[:export.num_blocks]] == export.layer(layer)).all()
    eng.free("h")


def test_admission_refuses_what_cannot_fit_and_bad_input(tiny):
    eng = Engine(tiny, EngineConfig(num_blocks=8, max_num_seqs=2))
    with pytest.raises(ValueError, match="does not fit"):
        eng.add_request("big", [5] * 200, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("e", [], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("v", [1, 99999], GREEDY)
    eng.reserve("a", [5] * 60, GREEDY)
    with pytest.raises(OutOfBlocks):
        eng.reserve("b", [6] * 70, GREEDY)  # 5 blocks wanted, 4 free
    assert "b" not in eng.seqs
    eng.reserve("c", [7] * 10, GREEDY)  # max_num_seqs=2 reached
    with pytest.raises(OutOfBlocks, match="at most 2"):
        eng.reserve("d", [8] * 10, GREEDY)
    eng.reserve("d", [8] * 10, GREEDY, max_seqs=3)  # a moved stream may be let in beyond it
    with pytest.raises(OutOfBlocks, match="at most 3"):
        eng.reserve("e", [9] * 10, GREEDY, max_seqs=3)
    for rid in "acd":
        eng.abort(rid)
    assert eng.num_free_blocks == 8


def test_fingerprint_and_cache_changes(tiny):
    a = Engine(tiny, EngineConfig(num_blocks=16))
    assert a.fingerprint == Engine(tiny, EngineConfig(num_blocks=32)).fingerprint
    assert a.fingerprint != Engine(tiny, EngineConfig(num_blocks=16, block_size=32, prefill_chunk=32)).fingerprint
    a.add_request("k", list(range(3, 40)), SamplingParams(max_tokens=1, temperature=0))
    run_all(a)
    events = a.drain_cache_changes()
    assert [e.kind for e in events] == ["stored", "stored"]  # 37 tokens: 2 full blocks


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_resume_with_generated_tokens_continues_the_same_stream(tiny, temperature):
    """Failover: a fresh engine given prompt + tokens so far produces the rest unchanged."""
    prompt = prompts(1, lo=30, hi=30, seed=21)["r0"]
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=3, ignore_eos=True)
    whole = generate(tiny, {"r": prompt}, params)["r"]
    eng = Engine(tiny, EngineConfig(num_blocks=64))
    eng.add_request("r", prompt, params, generated_token_ids=whole[:10])
    outs = run_all(eng)["r"]
    assert whole[:10] + tokens(outs) == whole
    assert outs[-1].num_generated_tokens == 24 and outs[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("done", prompt, params, generated_token_ids=whole)


def test_a_lower_priority_value_is_prefilled_first_then_first_come(tiny):
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import Engine
    from pdserve.shared.engine.sequence import SamplingParams

    eng = Engine(tiny, EngineConfig(num_blocks=64, prefill_chunk=16, max_batched_tokens=16))
    for rid, prio in (("a", 0), ("b", 5), ("c", -1), ("d", 0)):
        eng.add_request(rid, list(range(3, 19)), SamplingParams(max_tokens=2, priority=prio), prefill_only=True)
    order = [o.request_id for _ in range(4) for o in eng.step()]
    assert order == ["c", "a", "d", "b"]


def test_a_short_prompt_is_not_stuck_behind_long_ones_and_the_oldest_long_one_keeps_moving(tiny):
    """Four long prompts would fill every pass's budget for three passes; a short one that
    comes after them is done in the first pass. Short prompts that fill the budget do not
    stop the oldest long prompt: it advances a chunk per pass."""
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import Engine
    from pdserve.shared.engine.scheduler import prefill_order
    from pdserve.shared.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=2)
    eng = Engine(tiny, EngineConfig(num_blocks=256, prefill_chunk=16, max_batched_tokens=64, enable_prefix_cache=False))
    for i in range(4):
        eng.add_request(f"long{i}", [3 + i] * 48, params, prefill_only=True)
    eng.add_request("short", [9] * 10, params, prefill_only=True)
    assert [o.request_id for o in eng.step()] == ["short"]

    eng = Engine(tiny, EngineConfig(num_blocks=256, prefill_chunk=16, max_batched_tokens=64, enable_prefix_cache=False))
    eng.add_request("long", [3] * 48, params, prefill_only=True)
    for i in range(12):
        eng.add_request(f"short{i}", [4 + i] * 16, params, prefill_only=True)
    done = [[o.request_id for o in eng.step()] for _ in range(3)]
    assert done == [["short0", "short1", "short2"], ["short3", "short4", "short5"],   # 3 beside it per pass
                    ["long", "short6", "short7", "short8"]]
    assert [q.request_id for q in prefill_order(eng.scheduler.waiting, 16)] == ["short9", "short10", "short11"]


def test_prompts_are_taken_round_robin_across_tenants(tiny):
    """Tenant a has eight prompts waiting when b's one comes: b's is in the first pass (four
    prompts fit one), not after all of a's; a's keep their order."""
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import Engine
    from pdserve.shared.engine.sequence import SamplingParams

    eng = Engine(tiny, EngineConfig(num_blocks=256, prefill_chunk=16, max_batched_tokens=64, enable_prefix_cache=False))
    for i in range(8):
        eng.add_request(f"a{i}", [3 + i] * 16, SamplingParams(max_tokens=2, tenant="key:a"), prefill_only=True)
    eng.add_request("b0", [20] * 16, SamplingParams(max_tokens=2, tenant="key:b"), prefill_only=True)
    assert [o.request_id for o in eng.step()] == ["a0", "b0", "a1", "a2"]
    assert [o.request_id for o in eng.step()] == ["a3", "a4", "a5", "a6"]


def test_growth_blocks_count_what_unfinished_sequences_may_still_take(tiny):
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import Engine
    from pdserve.shared.engine.sequence import SamplingParams

    eng = Engine(tiny, EngineConfig(num_blocks=64, block_size=16, prefill_chunk=16, max_batched_tokens=64))
    eng.add_request("a", [3] * 20, SamplingParams(max_tokens=30, ignore_eos=True))
    assert eng.growth_blocks == 4                          # 50 tokens in 16-token blocks, none taken yet
    eng.step()
    assert eng.growth_blocks == 4 - len(eng.seqs["a"].block_table) == 2
    while eng.has_work():
        eng.step()
    assert eng.growth_blocks == 0


def test_degenerate_sampling_parameters_neither_crash_nor_stall_the_batch(tiny):
    """Found by the API fuzzer: temperature 1e-300 overflowed the logits to inf (NaN
    probabilities) and the exception took the whole worker down. Now a temperature below
    1e-5 is greedy, and a row that still cannot be sampled falls back to its argmax alone."""
    prompt = list(range(3, 20))
    greedy = generate(tiny, {"g": prompt}, SamplingParams(max_tokens=4, temperature=0))["g"]
    for params in (SamplingParams(max_tokens=4, temperature=1e-300), SamplingParams(max_tokens=4, temperature=1e-6,
                                                                                    top_p=5e-324)):
        assert generate(tiny, {"x": prompt}, params)["x"] == greedy
    import torch

    from pdserve.shared.engine.sampler import sample
    from pdserve.shared.engine.sequence import Sequence
    seq = Sequence("n", prompt, len(prompt), SamplingParams(max_tokens=4, temperature=1.0))
    seq.seed = 1
    logits = torch.full((1, 512), float("nan"))
    logits[0, 7] = 1.0
    assert sample(logits, [seq], ())[0] in ([0], [7])   # argmax of a NaN row, no exception


def test_mixed_passes_hold_decode_tokens_and_prompt_chunks_and_change_no_token(tiny):
    """While a long prompt is prefilled in chunks, the running sequences' decode tokens go in
    the same passes (decode rows first, the chunk in what is left of the budget), and every
    sequence's tokens are those of the alternating form's."""
    ps = prompts(4, lo=20, hi=30)
    ps["long"] = prompts(1, lo=150, hi=150, seed=9)["r0"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cfg = {"max_batched_tokens": 36, "prefill_chunk": 32}
    alternating = generate(tiny, ps, params, mixed_batches=False, **cfg)

    eng = Engine(tiny, EngineConfig(num_blocks=512, **cfg))
    for rid, ids in ps.items():
        if rid != "long":
            eng.add_request(rid, ids, params)
    while len(eng.scheduler.running) < 4:  # the four short prompts in
        eng.step()
    eng.add_request("long", ps["long"], params)
    kinds = []
    outs: dict[str, list[int]] = {}
    while eng.has_work():
        sched_running = len(eng.scheduler.running)
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        kinds.append(eng.last_pass)
        if eng.last_pass.kind == "mixed":
            assert eng.last_pass.decode_tokens == sched_running
            assert eng.last_pass.prefill_tokens <= 36 - sched_running  # the chunk in the budget left
    # 150 tokens, 32 a pass (36 less the 4 decode tokens): every chunk beside the streams
    assert [k.prefill_tokens for k in kinds[:5]] == [32, 32, 32, 32, 22]
    assert [k.kind for k in kinds[:5]] == ["mixed"] * 5
    assert {rid: alternating[rid][-len(v):] for rid, v in outs.items()} == outs
    assert eng.num_free_blocks == eng.num_blocks



def test_a_cache_salt_partitions_the_prefix_cache(tiny):
    """Requests under another salt share no block (and learn nothing of each other's prompts);
    under one salt the cache serves them; a transfer keeps the salted hashes."""
    prompt = random.Random(5).choices(range(3, 200), k=70)
    eng = Engine(tiny, EngineConfig(num_blocks=64))

    def cached(rid: str, salt: str) -> int:
        eng.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0, cache_salt=salt))
        return run_all(eng)[rid][-1].num_cached_tokens

    assert cached("a1", "tenant-a") == 0
    assert cached("b1", "tenant-b") == 0 and cached("plain", "") == 0
    assert cached("a2", "tenant-a") == 64 and cached("b2", "tenant-b") == 64
    src, dst = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=4, temperature=0, cache_salt="tenant-a")
    first = transfer(src, dst, "t", prompt, params)
    assert first.new_token_ids + tokens(run_all(dst)["t"]) == generate(tiny, {"t": prompt}, params)["t"]


def _passes_of(eng: Engine) -> list[set[str]]:
    """Each pass's requests, as the engine tells its recorder (pdserve/shared/batches.py)."""
    passes: list[set[str]] = []
    eng.before_pass = lambda seqs: passes.append({s.request_id for s in seqs})
    return passes


def _step_until_idle(eng: Engine, outs: dict[str, list[int]]) -> None:
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)


@pytest.mark.parametrize("mixed", [True, False])
def test_requests_charged_a_crash_run_their_first_passes_alone_while_the_others_are_served(tiny, mixed):
    """pdserve/shared/quarantine.py: the poison ("p") and a request charged with it ("i", which shared
    its pass) each run their prompt's chunks and first ALONE_STEPS decode steps in passes of their
    own — beside neither each other nor anyone — taking turns with the others' passes (running
    streams and new prompts, served every other pass); then they join the batch. No token changes."""
    ps = prompts(5, lo=20, hi=30)
    ps["p"] = prompts(1, lo=70, hi=70, seed=4)["r0"]  # three chunks of 32
    ps["i"] = prompts(1, lo=20, hi=20, seed=6)["r0"]
    cfg = {"max_batched_tokens": 64, "prefill_chunk": 32, "mixed_batches": mixed}
    expected = generate(tiny, ps, GREEDY, **cfg)
    eng = Engine(tiny, EngineConfig(num_blocks=512, **cfg))
    passes, outs = _passes_of(eng), {}
    for rid in ("r0", "r1"):
        eng.add_request(rid, ps[rid], GREEDY)
    while len(eng.scheduler.running) < 2:  # two streams running
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for rid in ("p", "i", "r2", "r3", "r4"):
        eng.add_request(rid, ps[rid], GREEDY, crashes=int(rid in ("p", "i")))
    _step_until_idle(eng, outs)
    assert outs == expected and eng.num_free_blocks == eng.num_blocks
    held = {rid: [n for n, ids in enumerate(passes) if rid in ids] for rid in "pi"}
    alone = {rid: held[rid][:chunks + ALONE_STEPS] for rid, chunks in (("p", 3), ("i", 1))}
    assert all(passes[n] == {rid} for rid, ns in alone.items() for n in ns)
    assert all(len(passes[n]) > 1 for rid in "pi" for n in held[rid][len(alone[rid]):][:1])  # then it joins
    suspects = sorted(alone["p"] + alone["i"])
    assert all(b - a > 1 for a, b in zip(suspects, suspects[1:]))  # another pass between any two of theirs


def test_an_imported_request_charged_a_crash_decodes_its_first_steps_alone(tiny):
    """The decode side of a handoff (commit_import's `crashes`): its first ALONE_STEPS decode steps
    run alone, taking turns with the running stream's; then it joins the batch."""
    src, dst = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=64))
    ps = prompts(2, lo=20, hi=30, seed=2)
    dst.add_request("r0", ps["r0"], GREEDY)
    dst.step()
    passes = _passes_of(dst)
    first = transfer(src, dst, "x", ps["r1"], GREEDY, crashes=1)
    outs = {"x": first.new_token_ids}
    _step_until_idle(dst, outs)
    assert outs["x"] == generate(tiny, {"x": ps["r1"]}, GREEDY)["x"]
    held = [n for n, ids in enumerate(passes) if "x" in ids]
    assert [passes[n] for n in held[:ALONE_STEPS + 1]] == [{"x"}] * ALONE_STEPS + [{"r0", "x"}]
