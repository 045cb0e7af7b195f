"""The batched sampler a CUDA engine uses (seeded_draw.py, device_sampler.py), run here on the CPU: the keyed
noise is uniform and a function of (key, token) alone, the draw follows softmax(logits / T), the filters keep
the tokens sampler.py's per-row rules keep, greedy rows are the argmax, a row's token does not depend on its
batch, and an engine that samples this way keeps a seed's tokens across a handoff."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import run_all, tokens, transfer

from pdserve.shared.engine import seeded_draw
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.device_sampler import DeviceSampler
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.sampler import sample, step_seed
from pdserve.shared.engine.seeded_draw import Rows
from pdserve.shared.engine.sequence import SamplingParams, Sequence

CPU = torch.device("cpu")


def rows(n: int, keys: list[int], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
         min_p: float = 0.0) -> Rows:
    return Rows.of([temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n, keys, CPU)


def test_the_noise_is_uniform_and_a_function_of_key_and_token():
    keys = torch.tensor([0, 1, 2**62 + 5, step_seed(7, 3)])
    u = seeded_draw.uniform(keys, 50_000)
    assert u.dtype == torch.float32 and bool((u > 0).all() and (u < 1).all())
    assert torch.equal(u, seeded_draw.uniform(keys, 50_000))
    assert torch.equal(u[:, :100], seeded_draw.uniform(keys, 100))  # a token's noise is its own
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    hist = torch.histc(u[2], bins=10, min=0, max=1)
    assert float(hist.min()) > 4500 and float(hist.max()) < 5500
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[1], u[2])


def test_the_draw_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n, temperature = 20_000, 0.8
    picked = seeded_draw.sample(logits.expand(n, -1), rows(n, list(range(n)), temperature))
    counts = torch.bincount(picked, minlength=5).float()
    expected = (logits / temperature).softmax(-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 4 degrees of freedom: p = 0.0004


@pytest.mark.parametrize("settings", [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2),
                                      dict(top_k=4, top_p=0.5, temperature=0.7)])
def test_the_filters_keep_what_the_per_row_rules_keep(settings):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=g) * 2
    keep = torch.stack([reference_kept(row, **settings) for row in logits])
    n = 200
    picked = seeded_draw.sample(logits.repeat_interleave(n, 0), rows(6 * n, list(range(6 * n)), **settings))
    for r in range(6):
        seen = set(picked[r * n:(r + 1) * n].tolist())
        allowed = set(keep[r].nonzero().flatten().tolist())
        assert seen <= allowed and len(seen) >= min(len(allowed), 2)


def reference_kept(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> torch.Tensor:
    """sampler._sample_row's masking, step for step: the tokens it may draw."""
    logits = logits / temperature
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        cum = ordered.softmax(-1).cumsum(-1)
        drop = cum - ordered.softmax(-1) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits > float("-inf")


def seq(params: SamplingParams, seed: int, generated: int = 0) -> Sequence:
    s = Sequence("r", list(range(5 + generated)), 5, params)
    s.seed = seed
    return s


def test_the_batched_path_greedy_rows_argmax_and_a_row_independent_of_its_batch():
    sampler = DeviceSampler(CPU, 16, batched=True)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 64, generator=g)
    hot = SamplingParams(temperature=1.3, top_p=0.9, top_k=20)
    seqs = [seq(SamplingParams(temperature=0), 1), seq(hot, 11, 3), seq(SamplingParams(temperature=0.5), 12),
            seq(hot, 13, 1)]
    got, lps = sampler.sample(logits.clone(), seqs, (2,), [0, 2, 0, 0])
    assert lps == [None] * 4 and got[0] == int(logits[0].argmax())
    alone, _ = sampler.sample(logits[1:2].clone(), [seqs[1]], (2,), [2])
    assert alone[0] == got[1]
    key = step_seed(11, 3 + 2)  # its draft row's index: the seed's token 5
    assert got[1] == int(seeded_draw.sample(logits[1:2], Rows.of([1.3], [20], [0.9], [0.0], [key], CPU))[0])


def test_a_batch_with_logit_changes_takes_the_per_row_path():
    sampler = DeviceSampler(CPU, 16, batched=True)
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    seqs = [seq(SamplingParams(temperature=0.9, logit_bias=((4, 5.0),)), 5), seq(SamplingParams(temperature=0), 6)]
    assert sampler.sample(logits.clone(), seqs, (2,))[0] == sample(logits.clone(), seqs, (2,))[0]


def test_an_engine_sampling_on_the_batched_path_keeps_a_seed_across_a_handoff(tiny):
    rng = random.Random(5)
    prompt = [rng.randrange(3, tiny.config.vocab_size) for _ in range(40)]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)

    def engine() -> Engine:
        e = Engine(tiny, EngineConfig(num_blocks=32))
        e.runner.sampler.batched = True
        return e

    one = engine()
    one.add_request("s", prompt, params)
    colocated = tokens(run_all(one)["s"])
    src, dst = engine(), engine()
    first = transfer(src, dst, "s", prompt, params)
    assert first.new_token_ids + tokens(run_all(dst)["s"]) == colocated
    other = engine()
    other.add_request("s", prompt, SamplingParams(**{**params.__dict__, "seed": 8}))
    assert tokens(run_all(other)["s"]) != colocated
