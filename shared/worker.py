"""What prefill and decode workers share: their id, their engine, their registry entry."""

from __future__ import annotations

import uuid

import torch

from shared.config import WorkerSettings
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.loader import load
from shared.messages import WorkerInfo


def worker_id(settings: WorkerSettings, role: str) -> str:
    return settings.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"


def build_engine(settings: WorkerSettings) -> Engine:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    loaded = load(settings.model, device=settings.device)
    cfg = EngineConfig(num_blocks=settings.kv_blocks, max_num_seqs=settings.max_num_seqs,
                       max_batched_tokens=settings.max_batched_tokens,
                       prefill_chunk=settings.prefill_chunk, device=settings.device)
    return Engine(loaded, cfg)


def worker_info(engine: Engine, wid: str, role: str, settings: WorkerSettings, ucx_address: str = "") -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role=role, model=settings.model_name, fingerprint=engine.fingerprint,
                      ucx_address=ucx_address, total_blocks=engine.num_blocks,
                      free_blocks=engine.num_free_blocks, running=len(engine.scheduler.running),
                      waiting=len(engine.scheduler.waiting))
