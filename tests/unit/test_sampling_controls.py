"""Penalties, biases, min-p and log probabilities in the engine (tiny random-weight model)."""

import math

import torch
from helpers import run_all, tokens

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.logprobs import logprobs_of
from pdserve.shared.engine.sampler import adjust
from pdserve.shared.engine.sequence import SamplingParams, Sequence

PROMPT = list(range(5, 75))


def run(tiny, params, prompt=PROMPT, **cfg):
    engine = Engine(tiny, EngineConfig(**{"num_blocks": 64, **cfg}))
    engine.add_request("a", prompt, params)
    outs = run_all(engine)["a"]
    assert engine.num_free_blocks == engine.num_blocks
    return outs


def test_penalties_and_bias_change_the_logits_as_defined():
    seq = Sequence("s", [1, 2, 3, 4, 4, 4], num_prompt=3,
                   params=SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                                         logit_bias=((9, 3.0),)))
    logits = torch.tensor([1.0, -1.0, 2.0, 4.0, 6.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    adjust(logits, seq, eos_ids=())
    # repetition over prompt and output (1, 2, 3, 4): positive / 2, negative x 2; then the output's
    # counts (4 three times): - 0.25 x 3 - 0.5; the bias on 9
    assert logits.tolist() == [1.0, -2.0, 1.0, 2.0, 3.0 - 0.75 - 0.5, 0.0, 0.0, 0.0, 0.0, 3.0]


def test_frequency_penalty_stops_greedy_repetition(tiny):
    plain = tokens(run(tiny, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
    penalized = tokens(run(tiny, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                frequency_penalty=2.0, presence_penalty=2.0)))
    assert penalized != plain
    assert max(penalized.count(t) for t in penalized) < max(plain.count(t) for t in plain)


def test_logit_bias_forces_a_token_and_min_p_one_is_greedy(tiny):
    forced = tokens(run(tiny, SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                                             logit_bias=((77, 100.0),))))
    assert forced == [77] * 6
    greedy = tokens(run(tiny, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
    assert tokens(run(tiny, SamplingParams(max_tokens=12, temperature=1.5, min_p=1.0, seed=5,
                                           ignore_eos=True))) == greedy


def test_stop_token_ids_end_the_sequence(tiny):
    free = tokens(run(tiny, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
    outs = run(tiny, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(free[4],)))
    assert tokens(outs) == free[:free.index(free[4]) + 1] and outs[-1].finish_reason == "stop"


def test_logprobs_are_the_models_log_softmax_and_sum_to_one(tiny):
    outs = run(tiny, SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True, logprobs=4,
                                    repetition_penalty=1.3))
    for out in outs:
        (lp,) = out.logprobs
        assert lp.token_id == out.new_token_ids[0] and lp.logprob <= 0
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True) and len(lp.top) == 4
    # greedy: the chosen token is the most likely one, by the raw distribution
    for out in run(tiny, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)):
        (lp,) = out.logprobs
        assert lp.top[0] == (lp.token_id, lp.logprob)
    full = logprobs_of(torch.randn(3, 50), [1, 2, 3], 50)
    assert all(math.isclose(sum(math.exp(v) for _, v in lp.top), 1.0, rel_tol=1e-5) for lp in full)


def test_prompt_logprobs_equal_one_unchunked_forward_and_skip_the_prefix_cache(tiny):
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=2)
    whole = run(tiny, params, prefill_chunk=512, max_batched_tokens=512)[0].prompt_logprobs
    engine = Engine(tiny, EngineConfig(num_blocks=64, prefill_chunk=16, max_batched_tokens=32))
    engine.add_request("warm", PROMPT, SamplingParams(max_tokens=1))  # the whole prompt cached
    run_all(engine)
    engine.add_request("a", PROMPT, params)
    outs = run_all(engine)["a"]
    chunked = outs[0].prompt_logprobs
    assert len(whole) == len(chunked) == len(PROMPT) and whole[0] is None and chunked[0] is None
    assert [lp.token_id for lp in chunked[1:]] == PROMPT[1:] and outs[0].num_cached_tokens == 0
    for a, b in zip(whole[1:], chunked[1:]):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4) and [i for i, _ in a.top] == [i for i, _ in b.top]


def test_log_probabilities_cross_a_transfer_and_seeded_penalized_sampling_continues_exactly(tiny):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True, logprobs=2, prompt_logprobs=0,
                            frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2, min_p=0.05)
    alone = run(tiny, params)
    src, dst = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=64))
    reservation = dst.reserve("a", PROMPT, params)
    src.add_request("a", PROMPT, params, prefill_only=True)
    out = next(o for o in src.step() if o.request_id == "a")  # the first token, as the prefill worker has it
    export = src.export_kv("a", reservation.first_block)
    for layer in range(export.num_layers):
        dst.import_layer("a", layer, export.layer_bytes(layer), reservation.first_block)
    src.free("a")
    committed = dst.commit_import("a", out.new_token_ids[0], out.logprobs[0], out.prompt_logprobs)
    moved = [committed] + run_all(dst)["a"]
    assert tokens(moved) == tokens(alone)
    assert committed.prompt_logprobs == out.prompt_logprobs and committed.logprobs == out.logprobs
    for a, b in zip(alone, moved):
        assert math.isclose(a.logprobs[0].logprob, b.logprobs[0].logprob, abs_tol=1e-4)
    assert len(alone[0].prompt_logprobs) == len(PROMPT)
