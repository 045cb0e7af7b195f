"""A forward pass's integer inputs in buffers made once: written on the host, sent to the device in one
asynchronous copy (no pageable copy, so no host-device synchronization), read there as views.

`Staging` is the pair: a host buffer (pinned on CUDA) and a device buffer of the same size; on CPU they are
one tensor and nothing is copied. `StepBuffers` lays a pass's inputs out in two of them:

- decode passes (every row a sequence's next token, or a draft's: speculative.py) at fixed places, what a
  captured CUDA graph reads (cuda_graphs.py): ids, positions, slots, context lengths, the output rows (0..R-1,
  written once) and the block tables as (rows, width), `rows` and `width` up to the pool's `max_rows` and
  `max_width`. A padded pass (a graph's bucket) fills the rows past the batch with a scratch slot and block;
  an unpadded one has exactly the batch's rows and the widest table's width, the tensors today's code made;
- any other pass (prompt chunks, or more decode rows than `max_rows`) packed one after another, the buffer
  growing (to the next power of two) when a pass needs more.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from pdserve.shared.engine.batch import ForwardBatch

DECODE_FIELDS = ("ids", "pos", "slots", "lens", "out")  # each max_rows long, then the tables


class Staging:
    """`size` int64 on the host (pinned on CUDA) and on the device; `send(n)` copies the first n without
    waiting, and the host side is written again only once that copy is done (`writable`)."""

    def __init__(self, size: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=cuda)
        self.view = self.host.numpy()  # (writes from Python lists go through numpy: no tensor made per list)
        self.dev = torch.zeros(size, dtype=torch.long, device=device) if cuda else self.host
        self.sent = torch.cuda.Event() if cuda else None

    def writable(self) -> np.ndarray:
        """The host buffer as numpy, once the last copy out of it has completed (at once: each step waits for
        its sampled tokens, which the device computes after the copy)."""
        if self.sent is not None:
            self.sent.synchronize()
        return self.view

    def send(self, n: int) -> None:
        if self.sent is not None:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
            self.sent.record()


class StepBuffers:
    def __init__(self, device: torch.device, max_rows: int, max_width: int, scratch_block: int, block_size: int):
        self.device, self.max_rows, self.max_width, self.block_size = device, max_rows, max_width, block_size
        self.scratch_block = scratch_block  # a pool block no sequence holds (CUDA graphs' padding), or -1
        self.decode_buf = Staging(len(DECODE_FIELDS) * max_rows + max_rows * max_width, device)
        self.decode_buf.writable()[4 * max_rows:5 * max_rows] = np.arange(max_rows)
        self.decode_buf.send(5 * max_rows)
        self.packed = Staging(4096, device)

    def _field(self, name: str, rows: int) -> torch.Tensor:
        at = DECODE_FIELDS.index(name) * self.max_rows
        return self.decode_buf.dev[at:at + rows]

    def decode(self, ids: list[int], pos: list[int], slots: list[int], tables: list[list[int]],
               pad_to: int | None = None) -> ForwardBatch | None:
        """A decode pass's batch in the fixed places (None where it does not fit them): exactly its rows, or
        `pad_to` rows with every table `max_width` wide (a graph's bucket)."""
        rows, width = len(ids), max(map(len, tables))
        if rows > self.max_rows or width > self.max_width or (pad_to is not None and self.scratch_block < 0):
            return None
        n, w = rows if pad_to is None else pad_to, width if pad_to is None else self.max_width
        r, buf = self.max_rows, self.decode_buf.writable()
        for f, values in enumerate((ids, pos, slots, [p + 1 for p in pos])):
            buf[f * r:f * r + rows] = values
        table = buf[5 * r:5 * r + n * w].reshape(n, w)
        table[:] = 0  # (padding entries: any valid block id; none is read past a row's length)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        if n > rows:  # padding rows: one token at the scratch block's first slot, reading only it
            buf[rows:n] = 0
            buf[r + rows:r + n] = 0
            buf[2 * r + rows:2 * r + n] = self.scratch_block * self.block_size
            buf[3 * r + rows:3 * r + n] = 1
            table[rows:, 0] = self.scratch_block
        self.decode_buf.send(5 * r + n * w)
        return self.decode_views(n, w)

    def decode_views(self, rows: int, width: int) -> ForwardBatch:
        """The fixed places as a decode pass of `rows` rows and tables `width` wide."""
        at = 5 * self.max_rows
        tables = self.decode_buf.dev[at:at + rows * width].view(rows, width)
        return ForwardBatch(self._field("ids", rows), self._field("pos", rows), self._field("slots", rows),
                            self._field("out", rows), num_decode=rows, block_tables=tables,
                            context_lens=self._field("lens", rows))

    def holds(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is in the fixed places (what a graph reads), not a packed upload."""
        return batch.input_ids.data_ptr() == self.decode_buf.dev.data_ptr()

    def pad_all(self) -> None:
        """Every row a padding row (what a graph is captured with: it writes only the scratch block)."""
        self.decode([0], [0], [self.scratch_block * self.block_size], [[self.scratch_block]], self.max_rows)

    def upload(self, parts: Seq[Seq[int]]) -> list[torch.Tensor]:
        """Each list as a 1-D int64 tensor on the device, all in one copy (views valid until the next upload)."""
        total = sum(map(len, parts))
        if total > self.packed.host.numel():
            self.packed.writable()
            self.packed = Staging(1 << (total - 1).bit_length(), self.device)
        buf, at, spans = self.packed.writable(), 0, []
        for values in parts:
            buf[at:at + len(values)] = values
            spans.append((at, len(values)))
            at += len(values)
        self.packed.send(total)
        return [self.packed.dev[a:a + n] for a, n in spans]
