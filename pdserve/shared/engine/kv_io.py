"""What crosses the prefill → decode boundary: a sequence's KV blocks, layer by layer.

Streaming (what the services do): the sender registers `Engine.stream_kv(rid, first_block,
sink)`; during every forward pass that computes part of the prompt, once layer i is in the
pool, the engine hands `sink` a KVPiece: layer i of the blocks that pass completed (from the
receiver's `first_block` on). Its `data` is (n_blocks, 2, block_size, kv_heads, head_dim): a
view of the pool when the blocks are adjacent (no copy), else one gather; on CUDA, a copy of
that in pinned host memory made on the engine's KV stream (kv_copies.py), there once `ready`
has passed — unless the sink is `OnDevice` (a device-direct handoff, kv_device.py: the receiver
reads the pool itself, by the piece's `block_ids`): then `data` stays on the device.

Whole (tests, tools): `export_kv` gathers every layer after the prefill (KVExport).

The receiver reserves the blocks (Reservation: which of its blocks to fill), writes each
verified piece with `Engine.write_kv` and finishes with `Engine.commit_import`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Reservation:
    """The receiver's answer to "can you take this sequence": the blocks it set aside."""

    request_id: str
    num_blocks: int          # blocks for the whole prompt
    first_block: int         # blocks before this one are already in the receiver's prefix cache
    block_ids: tuple[int, ...] = ()  # the receiver's blocks to fill, for prompt blocks first_block..


@dataclass
class KVPiece:
    """One layer of a run of a sequence's blocks, ready for a transport (streaming)."""

    request_id: str
    layer: int
    first_block: int         # index among the prompt's blocks
    data: torch.Tensor       # (n_blocks, 2, block_size, kv_heads, head_dim)
    ready: torch.cuda.Event | None = None  # to wait on before reading `data` (None on CPU): its copy to the host
    last: bool = False       # the pass's last layer: nothing more of this pass follows
    block_ids: tuple[int, ...] = ()  # the pool's blocks `data` holds (streamed pieces; a re-read names none)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]


@dataclass(frozen=True)
class OnDevice:
    """A sink that takes its pieces where the pool is: `data` a view or gather of the pool, never copied to the host."""

    sink: Callable[[KVPiece], None]

    def __call__(self, piece: KVPiece) -> None:
        self.sink(piece)


@dataclass
class KVExport:
    request_id: str
    fingerprint: str
    token_ids: list[int]     # the prompt whose KV this is
    block_hashes: list[int]  # chained hashes of its full blocks (pdserve/shared/hashing.py)
    first_block: int
    num_blocks: int          # blocks sent, from first_block
    num_layers: int
    _gather: Callable[[int], torch.Tensor]

    def layer(self, i: int) -> torch.Tensor:
        return self._gather(i)

    def layer_bytes(self, i: int) -> torch.Tensor:
        """Layer i as a flat uint8 tensor viewing the gathered buffer (no copy)."""
        return self._gather(i).view(-1).view(torch.uint8)
