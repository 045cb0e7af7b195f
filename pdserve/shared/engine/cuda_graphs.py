"""Decode passes replayed as CUDA graphs: the whole forward pass of a decode batch (every layer's kernels,
~1,000 launches for a 1.5B model) launched as one graph, so that a step is not bound by the host's launch rate.

A graph is captured per padded batch size (a bucket: 1, 2, 4, 8, then every 8 up to the engine's
max_num_seqs), all at the first decode pass that can take one (that step takes a moment longer), largest
first, in one memory pool. Each reads its inputs from step_buffers.py's fixed places (a bucket's rows, tables
as wide as the longest context) and writes its logits into one persistent (max rows, vocab) buffer; the rows
past the batch are padding that writes only a scratch KV block the pool keeps beside the blocks the engine
hands out (runner.py).

Which passes: decode rows only (no prompt chunk), at most the largest bucket, no layer hook (a KV stream's
hook runs Python between layers). Others run eagerly with the same buffers. The setting: EngineConfig's
`cuda_graphs`; where it is None, PD_CUDA_GRAPHS (0/false/off: off; default on), read here because the
services' settings module has no room left for it. On a CPU there are no graphs. A fallback says why once.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import torch

from pdserve.shared.engine.batch import LayerHook
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.fake import FakeModel
from pdserve.shared.engine.model import DecoderModel
from pdserve.shared.engine.step_buffers import StepBuffers

log = logging.getLogger(__name__)
OFF = ("0", "false", "off", "no")


def wanted(cfg: EngineConfig) -> bool:
    """Whether the engine should capture graphs: asked for (or not refused) and on CUDA."""
    setting = cfg.cuda_graphs
    if setting is None:
        setting = os.environ.get("PD_CUDA_GRAPHS", "1").strip().lower() not in OFF
    if setting and not cfg.device.startswith("cuda"):
        if cfg.cuda_graphs:
            log.info("CUDA graphs asked for on %s: passes run eagerly (graphs need a CUDA device)", cfg.device)
        return False
    return setting


def buckets(max_rows: int) -> list[int]:
    """Padded batch sizes, ascending: 1, 2, 4, 8, 16, 24, ... and max_rows itself."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8))
    return sorted({*sizes, max_rows})


class DecodeGraphs:
    """Capture (lazily, once) and replay of the decode forward pass per bucket."""

    def __init__(self, model: DecoderModel | FakeModel, ops: SimpleNamespace, pool: torch.Tensor,
                 buffers: StepBuffers, vocab: int):
        self.model, self.ops, self.pool, self.buffers = model, ops, pool, buffers
        self.sizes = buckets(buffers.max_rows)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits = torch.empty((buffers.max_rows, vocab), dtype=torch.float32, device=pool.device)
        self.off: str | None = self._refusal()  # why no pass is replayed (None: they are)
        self.told: set[str] = set()
        if self.off:
            log.warning("CUDA graphs off: %s; decode passes run eagerly", self.off)

    def _refusal(self) -> str | None:
        if not isinstance(self.model, DecoderModel):
            return "the fake model computes on the host"
        if self.ops.name != "triton":
            return (f"the {self.ops.name} decode attention reads every block a table lists, and a graph's tables "
                    "are as wide as the longest context (the Triton kernel reads only each row's context)")
        return None

    def bucket(self, rows: int, has_prompts: bool, hook: LayerHook | None) -> int | None:
        """The bucket a pass of `rows` decode rows replays (capturing them all first, once), or None: eager."""
        if self.off or has_prompts or not rows:
            return None
        if hook is not None:
            self._fallback("a layer hook (a KV stream) runs between layers")
            return None
        size = next((b for b in self.sizes if b >= rows), None)
        if size is None:
            self._fallback(f"more decode rows than the largest bucket ({self.sizes[-1]})")
            return None
        if not self.graphs:
            self._capture()
        return size if self.graphs else None

    def replay(self, size: int, rows: int) -> torch.Tensor:
        """The bucket's graph over the inputs already sent: logits (rows, vocab), valid until the next replay."""
        self.graphs[size].replay()
        return self.logits[:rows]

    def _fallback(self, reason: str) -> None:
        if reason not in self.told:
            self.told.add(reason)
            log.info("a decode pass runs eagerly, not as a CUDA graph: %s (said once)", reason)

    def _forward(self, size: int) -> None:
        batch = self.buffers.decode_views(size, self.buffers.max_width)
        self.logits[:size].copy_(self.model(batch, self.pool, self.ops, None))

    def _capture(self) -> None:
        """Every bucket, largest first (the smaller reuse its memory), each run once eagerly before (Triton
        compiles, cuBLAS sets up) on a side stream, inputs all padding. A failure turns graphs off, saying why."""
        self.buffers.pad_all()
        side, pool = torch.cuda.Stream(self.pool.device), torch.cuda.graph_pool_handle()
        try:
            for size in reversed(self.sizes):
                side.wait_stream(torch.cuda.current_stream(self.pool.device))
                with torch.cuda.stream(side):
                    self._forward(size)
                torch.cuda.current_stream(self.pool.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # (thread_local: a KV write on another thread's stream meanwhile is neither captured nor refused)
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                    self._forward(size)
                self.graphs[size] = graph
        except Exception as e:  # noqa: BLE001 (any capture failure: the passes run eagerly, and say why)
            self.graphs.clear()
            self.off = f"capture failed: {type(e).__name__}: {e}"
            log.warning("CUDA graphs off: %s; decode passes run eagerly", self.off)
            return
        log.info("captured CUDA graphs of the decode pass for %d batch sizes up to %d", len(self.sizes),
                 self.sizes[-1])
