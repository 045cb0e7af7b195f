"""The step-time objective (pdserve/shared/engine/pass_time.py): a pass's prompt tokens beside
running streams follow the worker's measured pass times; alone, a prompt takes the whole chunk."""

from __future__ import annotations

from helpers import run_all, tokens

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.pass_time import PassTimes
from pdserve.shared.engine.sequence import SamplingParams

PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def test_the_budget_follows_the_measured_times():
    times = PassTimes(target_s=0.05, floor=16)
    assert times.prompt_budget(4) is None  # nothing measured: no bound
    times.observe(0, 100, 0.2)             # a prefill pass alone: 2 ms a prompt token
    assert times.prompt_budget(4) is None  # no decode pass measured yet
    times.observe(4, 0, 0.01)              # a decode pass: 10 ms
    assert times.prompt_budget(4) == 20    # (50 - 10) / 2
    assert times.prompt_budget(0) is None  # nothing runs beside the prompt
    for _ in range(30):                    # the worker slows down: 20 ms decode passes
        times.observe(4, 0, 0.02)
    assert times.prompt_budget(4) == 15 or times.prompt_budget(4) == 16
    assert PassTimes(target_s=0.001, floor=16).prompt_budget(1) is None
    slow = PassTimes(target_s=0.001, floor=16)
    slow.observe(1, 0, 0.01)
    slow.observe(1, 10, 0.11)
    assert slow.prompt_budget(1) == 16     # never below the floor: a prompt moves on


def _engine(fake, target_ms: float) -> Engine:
    eng = Engine(fake, EngineConfig(num_blocks=256, prefill_chunk=256, max_batched_tokens=512,
                                    pass_target_ms=target_ms))
    eng.pass_times.decode_s, eng.pass_times.token_s = 0.010, 0.001  # a worker measured so: 20 tokens fit 30 ms
    eng.pass_times.observe = lambda *_: None  # (held still: the fake model's passes take no time)
    return eng


def test_a_prompt_beside_a_running_stream_goes_in_chunks_of_the_objective(fake):
    eng = _engine(fake, 30)
    eng.add_request("stream", list(range(300, 320)), PARAMS)
    eng.step()
    eng.add_request("prompt", list(range(400, 600)), PARAMS)
    passes = []
    while eng.seqs["prompt"].num_computed < 200:
        eng.step()
        passes.append(eng.last_pass)
    assert all(p.decode_tokens == 1 and 16 <= p.prefill_tokens <= 20 for p in passes[:-1]), passes
    assert len(passes) in (10, 11)

    alone = _engine(fake, 30)  # with no stream running, the prompt takes the whole chunk
    alone.add_request("prompt", list(range(400, 600)), PARAMS)
    alone.step()
    assert alone.last_pass.prefill_tokens == 200


def test_chunks_change_no_token(fake):
    outs = {}
    for target in (0, 30):
        eng = _engine(fake, target)
        eng.add_request("stream", list(range(300, 320)), PARAMS)
        eng.step()
        eng.add_request("prompt", list(range(400, 600)), PARAMS)
        outs[target] = {rid: tokens(o) for rid, o in run_all(eng).items()}
        assert eng.num_free_blocks == eng.num_blocks
    assert outs[0] == outs[30]
