"""On a CUDA device (skipped elsewhere): the engine's step issues no synchronizing operation, prefill and
decode, greedy and seeded rows (torch.cuda.set_sync_debug_mode("error") raises on one), and a decode pass
replayed as a CUDA graph gives the tokens the eager pass gives, at batch sizes that are buckets (no padding)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from helpers import run_all, tokens

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.sequence import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=3, ignore_eos=True)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(20, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    from pdserve.shared.engine.loader import load

    return load("tiny", dtype=torch.float32, device="cuda")


def engine(tiny, graphs: bool, kernels: str = "triton") -> Engine:
    return Engine(tiny, EngineConfig(num_blocks=64, device="cuda", dtype=torch.float32, kernels=kernels,
                                     cuda_graphs=graphs, max_num_seqs=8))


@contextmanager
def no_syncs() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_step_issues_no_synchronizing_operation(tiny):
    eng = engine(tiny, graphs=True)
    warm = prompts(1, tiny.config.vocab_size, 9)[0]
    eng.add_request("warm", warm, GREEDY)  # (first passes: Triton compiles, the graphs are captured)
    run_all(eng)
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs, eng.runner.graphs.off
    ps = prompts(3, tiny.config.vocab_size)
    with no_syncs():
        eng.add_request("g", ps[0], GREEDY)
        eng.add_request("s", ps[1], SEEDED)
        eng.add_request("t", ps[2], SamplingParams(max_tokens=12, temperature=1.1, min_p=0.05, ignore_eos=True))
        outs = run_all(eng)
    assert all(len(tokens(outs[r])) == 12 for r in "gst")


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_graph_replay_gives_the_eager_tokens(tiny, batch, params):
    ps = prompts(batch, tiny.config.vocab_size, batch)
    got = {}
    for graphs in (True, False):
        eng = engine(tiny, graphs)
        for i, p in enumerate(ps):
            eng.add_request(f"r{i}", p, params)
        got[graphs] = {rid: tokens(o) for rid, o in run_all(eng).items()}
    assert got[True] == got[False]


def test_the_torch_backend_runs_eagerly_and_says_why(tiny, caplog):
    eng = engine(tiny, graphs=True, kernels="torch")
    assert eng.runner.graphs is not None and "reads every block" in (eng.runner.graphs.off or "")
    eng.add_request("a", prompts(1, tiny.config.vocab_size)[0], GREEDY)
    assert len(tokens(run_all(eng)["a"])) == 12
