"""A worker's engine settings where its own leave them unset: a CPU's as they have always been, a GPU's larger
batches and a KV pool sized from the device's memory once the weights are loaded (torch.cuda's memory
queries monkeypatched: no GPU here)."""

from __future__ import annotations

import pytest
import torch

from pdserve.shared.config import WorkerSettings
from pdserve.shared.engine.config import EngineConfig, ModelConfig
from pdserve.shared.engine.runner import blocks_in_memory
from pdserve.shared.worker import engine_config

MODEL = ModelConfig.tiny()
GIB = 2**30


def memory(monkeypatch: pytest.MonkeyPatch, free: int, total: int, reserved: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)


def test_a_cpu_worker_keeps_its_defaults():
    cfg = engine_config(WorkerSettings(device="cpu"), MODEL, torch.float32)
    assert (cfg.num_blocks, cfg.max_num_seqs, cfg.max_batched_tokens, cfg.prefill_chunk) == (2048, 64, 2048, 512)


def test_a_gpu_workers_pool_takes_its_share_of_the_device_less_what_it_holds(monkeypatch):
    memory(monkeypatch, free=60 * GIB, total=80 * GIB, reserved=4 * GIB)  # (weights loaded: 4 GiB)
    cfg = engine_config(WorkerSettings(device="cuda:1", kv_memory_fraction=0.5), MODEL, torch.bfloat16)
    per_block = EngineConfig(num_blocks=1, dtype=torch.bfloat16).block_bytes(MODEL)
    assert cfg.num_blocks == (40 - 4) * GIB // per_block  # half of 80, less the 4 held
    assert (cfg.max_num_seqs, cfg.max_batched_tokens, cfg.prefill_chunk) == (256, 8192, 2048)
    memory(monkeypatch, free=10 * GIB, total=80 * GIB, reserved=4 * GIB)  # (another process holds the rest)
    assert engine_config(WorkerSettings(device="cuda"), MODEL, torch.bfloat16).num_blocks == 10 * GIB // per_block


def test_settings_given_win_and_the_memory_is_not_asked(monkeypatch):
    def asked(device: object) -> tuple[int, int]:
        raise AssertionError("the device's memory was asked")

    monkeypatch.setattr(torch.cuda, "mem_get_info", asked)
    cfg = engine_config(WorkerSettings(device="cuda", kv_blocks=100, max_num_seqs=8, max_batched_tokens=1024,
                                       prefill_chunk=256), MODEL, torch.bfloat16)
    assert (cfg.num_blocks, cfg.max_num_seqs, cfg.max_batched_tokens, cfg.prefill_chunk) == (100, 8, 1024, 256)


def test_no_room_for_a_pool_says_which_setting(monkeypatch):
    memory(monkeypatch, free=1 * GIB, total=80 * GIB, reserved=79 * GIB)
    with pytest.raises(ValueError, match="kv_memory_fraction 0.9"):
        blocks_in_memory(MODEL, EngineConfig(num_blocks=1, device="cuda"), 0.9)
