"""What the engine checks and sets about its device at start: cuda:N becomes the current CUDA device
(torch.cuda.set_device, here monkeypatched: no GPU), and a KV block size the Triton decode kernel
cannot take (not a power of two: `tl.arange`) is refused at start, naming the setting."""

from __future__ import annotations

import pytest
import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.kernels import triton_kernels
from pdserve.shared.engine.runner import ModelRunner, use_device


class SetDevice(Exception):
    """Raised by the stand-in for torch.cuda.set_device: the runner stops there, before any CUDA memory."""


def test_an_engine_on_cuda_n_makes_n_the_current_device_before_it_allocates(tiny, monkeypatch):
    def set_device(device: torch.device) -> None:
        raise SetDevice(device)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(SetDevice) as raised:
        ModelRunner(tiny.model, tiny.config, EngineConfig(num_blocks=8, device="cuda:1", kernels="torch"), 8)
    assert raised.value.args[0] == torch.device("cuda", 1)


def test_cpu_and_plain_cuda_leave_the_current_device_alone(monkeypatch):
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    use_device(torch.device("cpu"))
    use_device(torch.device("cuda"))
    use_device(torch.device("cuda:3"))
    assert calls == [torch.device("cuda", 3)]


def test_the_triton_path_refuses_a_block_size_not_a_power_of_two_at_start(tiny):
    with pytest.raises(ValueError, match="block_size 24.*power of two"):
        ModelRunner(tiny.model, tiny.config, EngineConfig(num_blocks=8, block_size=24, kernels="triton"), 8)
    ModelRunner(tiny.model, tiny.config, EngineConfig(num_blocks=8, block_size=24, kernels="torch"), 8)
    ModelRunner(tiny.model, tiny.config, EngineConfig(num_blocks=8, block_size=32, kernels="triton"), 8)


def test_the_triton_decode_kernel_refuses_it_too():
    """(The interpreter would run it: on a GPU, compiling `tl.arange(0, 24)` fails.)"""
    pool = torch.zeros(4, 2, 24, 1, 16)
    with pytest.raises(ValueError, match="block size 24"):
        triton_kernels.paged_decode_attention(torch.zeros(1, 2, 16), pool, torch.zeros(1, 1, dtype=torch.long),
                                              torch.tensor([3]), 0.25)
