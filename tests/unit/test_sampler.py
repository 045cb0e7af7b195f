"""The sampler's tensors live where the logits do, and a batch of plain greedy rows takes one argmax.

On a GPU the logits are on CUDA: a tensor the sampler makes on the CPU and adds to them raises there,
in `engine.step()`. Here the logits sit on the `meta` device, in bfloat16, under a dispatch mode that
records every op whose tensors are on two devices or whose floating tensors have two dtypes (meta
itself lets a CPU operand through, so the mode is what sees it)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pdserve.shared.engine import sampler
from pdserve.shared.engine.sampler import adjust, sample
from pdserve.shared.engine.sequence import SamplingParams, Sequence

VOCAB = 50


class Mixed(TorchDispatchMode):
    """Records each op that mixes devices (among tensors of one or more elements: a 0-dim CPU
    tensor is a scalar CUDA takes) or floating dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor) and t.dim() > 0]
        devices = {t.device.type for t in tensors}
        dtypes = {t.dtype for t in tensors if t.is_floating_point()}
        if len(devices) > 1 or len(dtypes) > 1:
            self.found.append(f"{func}: {sorted(devices)} {sorted(map(str, dtypes))}")
        return func(*args, **(kwargs or {}))


CHANGES = {
    "logit_bias": SamplingParams(logit_bias=((3, 2.0), (7, -1.5))),
    "min_tokens": SamplingParams(min_tokens=5, stop_token_ids=(4,)),
    "repetition": SamplingParams(repetition_penalty=1.3),
    "presence and frequency": SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_every_logit_change_makes_its_tensors_on_the_logits_device_and_dtype(name):
    seq = Sequence("s", [1, 2, 3, 9, 9, 4], num_prompt=3, params=CHANGES[name])
    logits = torch.zeros(VOCAB, dtype=torch.bfloat16, device="meta")
    with Mixed() as mode:
        adjust(logits, seq, eos_ids=(2,))
    assert mode.found == []


def _plain(n: int) -> list[Sequence]:
    return [Sequence(f"s{i}", [1, 2, 3], num_prompt=3, params=SamplingParams(temperature=0)) for i in range(n)]


def test_plain_greedy_rows_take_one_argmax_equal_to_each_rows_first_maximum(monkeypatch):
    """Logits of a few distinct values: ties in every row, broken as a row's own argmax breaks them
    (the first maximal index), as the general path (a row asking for log probabilities beside
    them) does."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (33, VOCAB), generator=g).float()
    per_row = [int(row.argmax()) for row in logits]
    assert per_row == [row.tolist().index(max(row.tolist())) for row in logits]

    def no_row_work(*args: object) -> None:
        raise AssertionError("a plain greedy batch changed a row")

    with monkeypatch.context() as m:
        m.setattr(sampler, "adjust", no_row_work)
        fast, lps = sample(logits.clone(), _plain(33), eos_ids=(2,))
    assert fast == per_row and lps == [None] * 33

    seqs = _plain(33)
    seqs[5] = Sequence("lp", [1, 2, 3], num_prompt=3, params=SamplingParams(temperature=0, logprobs=2))
    general, lps = sample(logits.clone(), seqs, eos_ids=(2,))
    assert general == per_row and lps[5] is not None and lps[5].token_id == per_row[5]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, logit_bias=((1, 1.0),)),
                                    SamplingParams(temperature=0, min_tokens=2),
                                    SamplingParams(temperature=0.7, seed=1)])
def test_a_row_with_changes_or_a_draw_is_not_plain_greedy(params):
    assert not sampler.plain_greedy(Sequence("s", [1, 2, 3], num_prompt=3, params=params))
