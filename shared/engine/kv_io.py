"""What crosses the prefill → decode boundary: a sequence's KV blocks, layer by layer.

The sender builds a KVExport for the blocks the receiver lacks (`first_block` onwards, as the
receiver's Reservation says); `layer(i)` gathers layer i of those blocks into one contiguous
buffer (n_blocks, 2, block_size, kv_heads, head_dim) and `layer_bytes(i)` views it as bytes
with no further copy, ready for a transport. The receiver writes each buffer with
`Engine.import_layer` and finishes with `Engine.commit_import`.
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


@dataclass
class KVExport:
    request_id: str
    fingerprint: str
    token_ids: list[int]     # the prompt whose KV this is
    block_hashes: list[int]  # chained hashes of its full blocks (shared/hashing.py)
    first_block: int
    num_blocks: int          # blocks sent, from first_block
    num_layers: int
    _gather: Callable[[int], torch.Tensor]

    def layer(self, i: int) -> torch.Tensor:
        return self._gather(i)

    def layer_bytes(self, i: int) -> torch.Tensor:
        """Layer i as a flat uint8 tensor viewing the gathered buffer (no copy)."""
        return self._gather(i).view(-1).view(torch.uint8)
