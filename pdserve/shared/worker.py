"""What prefill and decode workers share: their core (id, engine on its thread, prefix-cache
changes published, registry entry, draining), how the engine is built, and start-up."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Literal, Protocol

import torch

from pdserve.shared import identity, metrics, metrics_vllm, tracing
from pdserve.shared.batches import Batches
from pdserve.shared.bus import Bus
from pdserve.shared.config import WorkerSettings
from pdserve.shared.cores import Share
from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.engine.config import DEVICE_DEFAULTS, EngineConfig, ModelConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.fake import FakeModel
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.runner import blocks_in_memory
from pdserve.shared.engine_host import EngineHost
from pdserve.shared.kv import Faults, KVTransport, create_transport
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.prefix_events import PrefixEventPublisher
from pdserve.shared.prefix_index import PrefixPublisher
from pdserve.shared.service import connect, stop_event
from pdserve.shared.state import State

log = logging.getLogger(__name__)


def worker_id(settings: WorkerSettings, role: str) -> str:
    return identity.instance_id(role, settings.enroll_token, settings.worker_id, f"{role}-{uuid.uuid4().hex[:8]}")


def torch_dtype(name: str, device: str) -> torch.dtype:
    """PD_DTYPE as torch's: `auto` is bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def build_engine(settings: WorkerSettings) -> Engine:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    dtype = torch_dtype(settings.dtype, settings.device)
    loaded = load(settings.model, dtype=dtype, device=settings.device, weights=settings.weights)
    if isinstance(loaded.model, FakeModel):
        log.warning("the fake model (%s): no weights, its tokens are no model's (tests only)", settings.model)
        loaded.model.step_s = settings.fake_step_s
    engine = Engine(loaded, engine_config(settings, loaded.config, dtype))
    if engine.tokenizer is not None and settings.grammar_preload:  # structured output's tables, built beside
        # the start (a few seconds, mostly the library's import), not on a structured request's first token
        threading.Thread(target=lambda: engine.grammars, name="grammars", daemon=True).start()
    return engine


def engine_config(settings: WorkerSettings, model: ModelConfig, dtype: torch.dtype) -> EngineConfig:
    """The worker's settings, and for those it leaves unset its device kind's (DEVICE_DEFAULTS); on CUDA the KV
    pool from the device's memory, the weights loaded (runner.blocks_in_memory)."""
    kind = "cuda" if settings.device.startswith("cuda") else "cpu"
    unset = DEVICE_DEFAULTS[kind]
    cfg = EngineConfig(num_blocks=settings.kv_blocks or DEVICE_DEFAULTS["cpu"]["kv_blocks"], dtype=dtype,
                       max_num_seqs=settings.max_num_seqs or unset["max_num_seqs"],
                       max_batched_tokens=settings.max_batched_tokens or unset["max_batched_tokens"],
                       prefill_chunk=settings.prefill_chunk or unset["prefill_chunk"],
                       mixed_batches=settings.mixed_batches, device=settings.device, kernels=settings.kernels,
                       pair_any_weights=settings.pair_any_weights, speculative_tokens=settings.speculative_tokens,
                       grammar_compile_threads=settings.grammar_compile_threads,
                       grammar_compile_timeout_s=settings.grammar_compile_timeout_s,
                       grammar_compiles_per_tenant=settings.grammar_compiles_per_tenant,
                       pass_target_ms=settings.pass_target_ms)
    if kind == "cuda" and settings.kv_blocks is None:
        cfg = replace(cfg, num_blocks=blocks_in_memory(model, cfg, settings.kv_memory_fraction))
    return cfg


class CachePublisher(Protocol):
    """Where a worker's prefix-cache changes go for the routers' prefix index (PD_PREFIX_INDEX,
    `PUBLISHERS`): `events` on NATS (pdserve/shared/prefix_events.py: the routers keep the index in
    memory), `redis` into Redis under the worker's slot (pdserve/shared/prefix_index.py)."""

    def registry_fields(self) -> Mapping[str, str | int]: ...
    async def start(self) -> None: ...
    def publish(self, changes: list[CacheChange]) -> None: ...
    async def close(self) -> None: ...


class WorkerCore:
    """The parts both workers are made of (each holds one): its id, its engine run on one
    thread (EngineHost), the prefix-cache changes of each step published to the prefix index,
    and its registry entry, `draining` once it stops taking new work."""

    def __init__(self, role: Literal["prefill", "decode"], settings: WorkerSettings, engine: Engine,
                 state: State, transport: KVTransport, bus: Bus):
        self.role, self.settings, self.engine, self.state, self.transport = role, settings, engine, state, transport
        self.bus, self.id = bus, worker_id(settings, role)
        self.publisher = PUBLISHERS[settings.prefix_index](self)
        self.host = EngineHost(engine, self.on_cache_changes, settings.fault_engine_hang_after_steps, role,
                               settings.fault_engine_raise_after_steps)
        if settings.core_board:   # (a decode worker steps on idle prefill workers' threads too)
            self.host.cores = Share(settings.core_board, role, self.id, settings.threads or torch.get_num_threads())
        self.batches = Batches(self.id, state.crashes.record_batch, settings.fault_crash_on_prompt,
                               engine.tokenizer.decode if engine.tokenizer is not None else None)
        engine.before_pass = lambda seqs: self.batches.before_pass(seqs, engine.seqs.keys())
        try:
            self.batches.loop = asyncio.get_running_loop()
        except RuntimeError:  # (made outside a loop: a test's; no pass recorded)
            pass
        self.draining = False

    def on_cache_changes(self, changes: list[CacheChange]) -> None:
        self.publisher.publish(changes)

    async def start_prefix(self) -> None:
        """Start publishing the prefix cache's changes (before the first heartbeat names them)."""
        await self.publisher.start()

    async def close_prefix(self) -> None:
        await self.publisher.close()

    def info(self) -> WorkerInfo:
        """The registry entry as of now (each heartbeat writes it)."""
        engine, host = self.engine, self.host
        return WorkerInfo(worker_id=self.id, role=self.role, model=self.settings.model_name,
                          fingerprint=engine.fingerprint,
                          ucx_address=self.transport.address if self.role == "decode" else "",
                          block_size=engine.cfg.block_size, total_blocks=engine.num_blocks,
                          free_blocks=engine.num_free_blocks, growth_blocks=engine.growth_blocks,
                          running=len(engine.scheduler.running),
                          waiting=len(engine.scheduler.waiting) + len(engine.scheduler.held) + engine.num_importing,
                          queued_tokens=engine.queued_tokens, prefill_tokens_per_s=host.prefill_tokens_per_s,
                          draining=self.draining, step_s=host.step_s, slowest_step_s=round(host.slowest_step_s, 3),
                          cached_blocks=engine.num_cached_blocks,
                          **self.publisher.registry_fields())

    async def leave(self) -> None:
        """Out of the registry after draining: its last pass ended in order, no crash to charge."""
        await self.state.registry.deregister(self.id)
        try:
            await self.state.crashes.forget_batch(self.id)
        except Exception as e:  # noqa: BLE001 - Redis away: the record expires
            log.debug("pass record kept: %s", e)

    async def drain(self) -> None:
        """Take no new work: the registry entry says `draining` at once, not at the next heartbeat."""
        self.draining = True
        await self.state.registry.heartbeat(self.info(), lease_s=self.settings.lease_s)


PUBLISHERS: dict[str, Callable[[WorkerCore], CachePublisher]] = {
    "events": lambda core: PrefixEventPublisher(core.bus, core.id, lambda: core.host.cache_snapshot()),
    "redis": lambda core: PrefixPublisher(core.state, core.id, lease_s=core.settings.lease_s,
                                          snapshot=lambda: core.host.call(core.engine.cached_hashes)),
}


class Serving(Protocol):
    """A worker: serves until `stop`."""

    async def serve(self, stop: asyncio.Event) -> None: ...


async def serve_worker(role: str, settings: WorkerSettings, worker_cls: Callable[..., Serving]) -> None:
    """Build the engine, connect NATS, Redis and the UCX transport, run `worker_cls(...).serve`
    until SIGTERM/SIGINT, then unwind in reverse (transport closed, Redis closed, NATS drained)."""
    tracer = tracing.setup(role, settings.otlp_endpoint, settings.trace_baggage_keys)
    metrics.serve(settings.metrics_port, settings.metrics_host)
    metrics_vllm.register(settings.model_name)
    engine = build_engine(settings)
    async with AsyncExitStack() as stack:
        stop = stop_event()
        bus, state = await connect(stack, settings, role, role)
        transport = create_transport(settings.kv_transport, settings.ucx_progress_mode,
                                     Faults(settings.kv_fault_corrupt_rate, settings.kv_fault_corrupt_sends,
                                            settings.kv_fault_delay_s), settings.ucx_error_handling)
        stack.push_async_callback(transport.close)
        await worker_cls(settings, engine, bus, state, transport, tracer).serve(stop)
    tracing.shutdown()
