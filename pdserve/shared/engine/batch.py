"""What one forward pass is given: its tensors (`ForwardBatch`, built by runner.py) and the
hook called once each layer's KV is in the pool (`LayerHook`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    """Tensors of one forward pass. T = new tokens in the batch: first `num_decode` decode
    tokens (one per running sequence, D of them), then prompt chunks."""

    input_ids: torch.Tensor        # (T,)
    positions: torch.Tensor        # (T,)
    slots: torch.Tensor            # (T,) block * block_size + offset where each new KV goes
    logits_index: torch.Tensor     # (B_out,) rows of T whose next-token logits are wanted
    num_decode: int = 0
    # the decode tokens' sequences
    block_tables: torch.Tensor | None = None  # (D, max_blocks)
    context_lens: torch.Tensor | None = None  # (D,)
    # prompt chunks: (query start among the rows after the decode ones, query length, context
    # length, block table)
    chunks: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)
    kv_rows: torch.Tensor | None = None  # (T,) slots as rows of a layer's pool: set by the forward pass


LayerHook = Callable[[int], None]  # called with the layer index once its KV is in the pool
