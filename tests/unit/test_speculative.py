"""Speculative decoding (pdserve/shared/engine/speculative.py) behind the real Engine on the fake model, whose
logits are a function of each row alone: drafts kept or refused change no token (greedy or seeded sampling), a
stop inside a kept draft ends the sequence there, the prefix cache holds only kept tokens, a handoff continues
the same stream, a grammar cuts the drafts it refuses; the prompt-lookup drafter; the accept rule keeps the
sampler's distribution."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import run_all, tokens, transfer

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.grammar import Grammar, Grammars
from pdserve.shared.engine.sampler import sample
from pdserve.shared.engine.sequence import SamplingParams, Sequence
from pdserve.shared.engine.speculative import PromptLookup, best_length, lookup, rows, runs
from pdserve.shared.hashing import block_hashes

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=11, ignore_eos=True)
PROMPTS = {"a": list(range(300, 337)), "b": [410, 411, 412] * 9, "c": list(range(500, 580))}


class Oracle:
    """Drafts the tokens a run without speculation gave (`wrong_every`: every n-th position's drafted wrong)."""

    def __init__(self, outputs: dict[str, list[int]], wrong_every: int = 0):
        self.outputs, self.wrong_every = outputs, wrong_every

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, limits):
            at = seq.num_generated
            draft = self.outputs.get(seq.request_id, [])[at:at + k]
            if self.wrong_every:
                draft = [t + 1 if (at + j) % self.wrong_every == 0 else t for j, t in enumerate(draft)]
            drafts.append(draft)
        return drafts


def _run(loaded, params: SamplingParams, k: int = 0, drafter=None, ascii_grammars: bool = False,
         **cfg) -> tuple[Engine, dict[str, list[int]]]:
    """PROMPTS through an engine drafting k tokens (with `drafter`); `ascii_grammars`: grammars read tokens 0-127
    as their byte, the others as nothing."""
    eng = Engine(loaded, EngineConfig(**{"num_blocks": 256, "speculative_tokens": k, **cfg}))
    if ascii_grammars:
        eng.grammars = Grammars([bytes([i]) if i < 128 else b"" for i in range(eng.model_config.vocab_size)],
                                eng.eos_token_ids)
    if drafter is not None:
        eng.speculator.drafter = drafter
    for rid, ids in PROMPTS.items():
        eng.add_request(rid, ids, params)
    outs = run_all(eng)
    assert eng.num_free_blocks == eng.num_blocks
    return eng, {rid: tokens(outs[rid]) for rid in PROMPTS}


@pytest.fixture(scope="module")
def reference(fake):
    return {name: _run(fake, params)[1] for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


@pytest.mark.parametrize("name", ["greedy", "seeded"])
@pytest.mark.parametrize("wrong_every", [0, 3])
def test_drafts_kept_or_refused_change_no_token(fake, reference, name, wrong_every):
    params = GREEDY if name == "greedy" else SEEDED
    eng, got = _run(fake, params, 4, Oracle(reference[name], wrong_every))
    assert got == reference[name]
    stats = eng.speculator.stats
    assert stats.accepted > 0 and (stats.accepted < stats.drafted) == bool(wrong_every)
    if not wrong_every:  # 4 drafts kept a pass: about 30 / 5 passes a request, not 30
        assert stats.passes <= 12


class Refused(Oracle):
    """The oracle's drafts with their second token one the grammar refuses."""

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [d[:1] + [ord("z")] + d[2:] if len(d) > 1 else d for d in super().propose(seqs, limits)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_under_a_grammar_follow_its_mask_and_are_cut_where_it_refuses(fake, params):
    """Each draft row is masked as the grammar stands after the draft before it, so the tokens are those without
    speculation; a draft token the grammar refuses is cut before the pass (never computed, never scored)."""
    params = dataclasses.replace(params, grammar=Grammar("regex", r"[0-9a-f]{24}"), ignore_eos=False)

    want = _run(fake, params, ascii_grammars=True)[1]
    assert all(bytes(t for t in out if t < 128).decode()[:24].isalnum() for out in want.values()), want
    for drafter, cut in ((Oracle(want), False), (Oracle(want, wrong_every=3), False), (Refused(want), True)):
        eng, got = _run(fake, params, 4, drafter, ascii_grammars=True)
        assert got == want
        stats = eng.speculator.stats
        assert stats.accepted > 0
        if cut:  # only each draft's first token reached the pass, and it was right
            assert stats.drafted == stats.accepted


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_prompt_lookup_changes_no_token(fake, reference, name):
    """(The fake model's words seldom repeat: its drafts are few; the real model's are in tests/engine.)"""
    assert _run(fake, GREEDY if name == "greedy" else SEEDED, 3)[1] == reference[name]


def test_a_stop_inside_a_kept_draft_ends_the_sequence_there(fake, reference):
    ref = reference["greedy"]["a"]
    stop = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(ref[6],))
    expected = ref[:ref.index(ref[6]) + 1]
    _, got = _run(fake, stop, 5, Oracle(reference["greedy"]))
    assert got["a"] == expected
    short = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)  # max_tokens inside a draft
    _, got = _run(fake, short, 5, Oracle(reference["greedy"]))
    assert got["a"] == ref[:7]


def test_the_prefix_cache_holds_only_kept_tokens(fake, reference):
    """Wrong drafts wrote KV past each sequence's end: no block holding it is indexed, and a prompt that shares a
    finished sequence's tokens reuses its blocks and continues as a fresh engine does."""
    eng, got = _run(fake, GREEDY, 4, Oracle(reference["greedy"], wrong_every=2))
    final = {rid: PROMPTS[rid] + got[rid] for rid in PROMPTS}
    allowed = {h for ids in final.values() for h in block_hashes(ids, eng.cfg.block_size)}
    assert eng.cached_hashes() and set(eng.cached_hashes()) <= allowed
    follow = final["a"][:60] + [321, 322]
    eng.add_request("f", follow, GREEDY)
    outs = run_all(eng)["f"]
    cached, again = outs[-1].num_cached_tokens, tokens(outs)
    fresh = Engine(fake, EngineConfig(num_blocks=256))
    fresh.add_request("f", follow, GREEDY)
    assert cached >= 48 and again == tokens(run_all(fresh)["f"])


def test_a_handoff_to_a_speculating_decode_engine_continues_the_same_stream(fake, reference):
    for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        src, dst = Engine(fake, EngineConfig(num_blocks=64)), Engine(fake, EngineConfig(num_blocks=64,
                                                                                           speculative_tokens=4))
        dst.speculator.drafter = Oracle(reference[name], wrong_every=3)
        first = transfer(src, dst, "c", PROMPTS["c"], params)
        assert first.new_token_ids + tokens(run_all(dst)["c"]) == reference[name]["c"]
        assert dst.speculator.stats.accepted > 0


def test_drafts_stay_within_the_token_budget_and_the_free_blocks(fake, reference):
    """max_batched_tokens 16: two sequences' tokens and 14 draft tokens at most a pass (of their 16); a pool with no
    block to spare: drafts shortened to the blocks each sequence holds, nothing preempted for them."""
    eng = Engine(fake, EngineConfig(num_blocks=256, speculative_tokens=8, max_batched_tokens=16, prefill_chunk=16))
    eng.speculator.drafter = Oracle(reference["greedy"])
    rows_seen = []
    real = eng.runner.run
    eng.runner.run = lambda sched, hook=None: (rows_seen.append(sched.decode_rows), real(sched, hook))[1]
    for rid, ids in PROMPTS.items():
        eng.add_request(rid, ids, GREEDY)
    assert {rid: tokens(o) for rid, o in run_all(eng).items()} == reference["greedy"]
    assert max(rows_seen) == 16
    tight = Engine(fake, EngineConfig(num_blocks=18, speculative_tokens=8, prefill_chunk=16))
    tight.speculator.drafter = Oracle(reference["greedy"])
    for rid, ids in PROMPTS.items():
        tight.add_request(rid, ids, GREEDY)
    assert {rid: tokens(o) for rid, o in run_all(tight).items()} == reference["greedy"]
    assert tight.speculator.stats.accepted > 0 and tight.scheduler.num_preemptions == 0


def test_off_where_the_request_cannot_take_it(fake):
    eng = Engine(fake, EngineConfig(num_blocks=64, speculative_tokens=4))
    spec = eng.speculator

    def limit(params: SamplingParams, generated: int = 0) -> int:
        return spec.limit(Sequence("s", [5] * (10 + generated), 10, params))

    assert limit(GREEDY) == 4 and limit(SamplingParams(temperature=0, speculative_tokens=2)) == 2
    assert limit(SamplingParams(temperature=0, speculative_tokens=0)) == 0
    assert limit(SamplingParams(temperature=0, repetition_penalty=1.2)) == 0
    assert limit(SamplingParams(temperature=0, logit_bias=((3, 1.0),))) == 0
    assert limit(SamplingParams(max_tokens=20, min_tokens=5), 4) == 0 < limit(SamplingParams(max_tokens=20,
                                                                                         min_tokens=5), 5)
    assert limit(SamplingParams(max_tokens=3), 1) == 1  # the bonus token is the last one
    with pytest.raises(ValueError, match="speculative_tokens"):
        SamplingParams(speculative_tokens=17)
    with pytest.raises(ValueError, match="speculative_tokens"):
        EngineConfig(num_blocks=8, speculative_tokens=-1)


def test_a_sequence_whose_drafts_miss_stops_drafting_and_starts_again_when_its_guesses_hit(fake, reference):
    ref = reference["greedy"]["a"]
    eng = Engine(fake, EngineConfig(num_blocks=64, speculative_tokens=4))
    eng.speculator.drafter = Oracle({"a": ref}, wrong_every=1)  # every token wrong
    eng.add_request("a", PROMPTS["a"], GREEDY)
    assert tokens(run_all(eng)["a"]) == ref
    assert eng.speculator.stats.accepted == 0 and eng.speculator.stats.passes <= 12  # of 29
    seq = Sequence("s", [1, 2, 1], 2, GREEDY)
    seq.drafting.hit_rate = 0.1
    spec = eng.speculator
    spec.drafter = PromptLookup()
    assert spec.drafts([seq], 10, eng.blocks) == [[]] and seq.drafting.guess is not None
    for _ in range(5):
        seq.drafting.guess = 7
        spec.settle(seq, [], [7])
    assert spec.drafts([seq], 10, eng.blocks) != [[]]


def test_the_draft_length_follows_the_hit_rate():
    """A draft row costs about half a pass for the first two, little in a tile of 8 (PASS_COST): at a low hit
    rate no draft pays, at a middling one a short draft, at a high one a whole tile."""
    lengths = [best_length(rate, 8) for rate in (0.0, 0.15, 0.3, 0.5, 0.6, 0.9, 1.0)]
    assert lengths[:4] == [0] * 4 and lengths == sorted(lengths) and lengths[-1] == 8 and 0 < lengths[4] < 4
    assert best_length(1.0, 3) == 3 and best_length(0.9, 0) == 0


def test_prompt_lookup_takes_the_longest_most_recent_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3], 2) == [8, 5]   # "2 3": most recent earlier one
    assert lookup([1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3], 3) == [9, 4, 2]  # "1 2 3" beats the later "2 3"
    assert lookup([7, 1, 2, 3, 4], 3) == [] and lookup([5], 3) == []
    assert lookup([4, 6, 4], 5) == [6, 4]                              # up to the end of what there is
    # a byte-level hit across tokens is no match: 256 = 00 01 00 00, 512 = 00 02 00 00, 1 = 01 00 00 00
    assert lookup([256, 512, 1], 2) == [] and lookup([1, 7, 256, 512, 1], 2) == [7, 256]


def test_rows_and_runs():
    a, b = Sequence("a", [1, 2], 1, GREEDY), Sequence("b", [3], 1, GREEDY)
    owners, ahead = rows([a, b], [[5, 6], []])
    assert owners == [a, a, a, b] and ahead == [0, 1, 2, 0]
    assert runs([5, 7, 9, 4], [[5, 6], []], [5, 7, 9, 4]) == [[5, 7], [4]]
    assert runs([5, 6, 9, 4], [[5, 6], []], [5, 6, 9, 4]) == [[5, 6, 9], [4]]
    assert runs([8, 6, 9, 4], [[5, 6], []], [8, 6, 9, 4]) == [[8], [4]]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_accept_rule_keeps_the_target_distribution():
    """A point-mass draft d checked against sampled rows (temperature 1, logits log p, 5 tokens, 6000 seeds):
    d kept about p(d) of the time, the token given it was refused distributed as p without d, renormalized, and
    every first token as p. Chi-square bounds at p = 0.001 (18.47 for 4 degrees of freedom, 16.27 for 3); the seeds
    are fixed, so the test gives one answer."""
    p, d, n = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]), 1, 6000
    seqs = [Sequence(f"s{i}", [0, 1], 1, SamplingParams(temperature=1.0)) for i in range(n)]
    for i, seq in enumerate(seqs):
        seq.seed = i  # (as the engine sets it)
    owners, ahead = rows(seqs, [[d]] * n)
    chosen, _ = sample(p.log().repeat(len(owners), 1), owners, eos_ids=(), ahead=ahead)
    first = torch.tensor([run[0] for run in runs(chosen, [[d]] * n, chosen)])
    kept = first == d
    assert abs(float(kept.float().mean()) - float(p[d])) < 0.03
    refused = torch.bincount(first[~kept], minlength=5).float()
    others = p.clone()
    others[d] = 0
    assert refused[d] == 0 and _chi_square(refused[others > 0], (others / others.sum())[others > 0]) < 16.27
    assert _chi_square(torch.bincount(first, minlength=5).float(), p) < 18.47


def test_the_api_field_and_the_worker_setting_reach_the_engine():
    from pydantic import ValidationError

    from pdserve.services.gateway.errors import describe, plain
    from pdserve.services.gateway.responses_request import ResponsesRequest
    from pdserve.services.gateway.schemas import ChatCompletionRequest, CompletionRequest
    from pdserve.shared.config import WorkerSettings
    from pdserve.shared.engine.config import ModelConfig
    from pdserve.shared.messages import Sampling
    from pdserve.shared.worker import engine_config

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for model, body in ((ChatCompletionRequest, chat), (CompletionRequest, {"model": "m", "prompt": "hi"})):
        wire = model.model_validate({**body, "speculative_tokens": 5}).sampling(8)
        assert Sampling.decode(wire.encode()).to_engine().speculative_tokens == 5
        assert model.model_validate(body).sampling(8).to_engine().speculative_tokens is None
        for bad in (17, -1):
            with pytest.raises(ValidationError) as e:
                model.model_validate({**body, "speculative_tokens": bad})
            assert describe(plain(e.value.errors()))[1] == "speculative_tokens"
    responses = ResponsesRequest.model_validate({"model": "m", "input": "hi", "speculative_tokens": 4})
    assert responses.as_chat().sampling(8).to_engine().speculative_tokens == 4
    with pytest.raises(ValidationError) as e:
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "speculative_tokens": 17})
    assert describe(plain(e.value.errors()))[1] == "speculative_tokens"
    cfg = engine_config(WorkerSettings(speculative_tokens=3), ModelConfig.tiny(), torch.float32)
    assert cfg.speculative_tokens == 3 and engine_config(WorkerSettings(), ModelConfig.tiny(),
                                                         torch.float32).speculative_tokens == 0
