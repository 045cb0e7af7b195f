"""The engine's half of a KV handoff: a sequence's blocks read out of the pool (streamed pass
by pass, re-read for a re-send, exported whole) and received blocks written into it (kv_io.py
says what crosses). It checks a sequence's state and never changes it: `Engine.reserve` and
`Engine.commit_import` move a sequence through its import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.shared.engine.batch import LayerHook
from pdserve.shared.engine.block_manager import BlockManager
from pdserve.shared.engine.kv_copies import KVCopies
from pdserve.shared.engine.kv_io import KVExport, KVPiece, OnDevice
from pdserve.shared.engine.runner import ModelRunner
from pdserve.shared.engine.scheduler import Schedule
from pdserve.shared.engine.sequence import Sequence, Status


@dataclass
class _Stream:
    sent_upto: int            # prompt blocks before this one are streamed (or not wanted)
    sink: Callable[[KVPiece], None]


class KVHandoff:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, fingerprint: str) -> None:
        self.runner, self.blocks, self.fingerprint = runner, blocks, fingerprint
        self.copies = KVCopies(runner.device)  # KV to and from the host off the compute stream
        self.streams: dict[str, _Stream] = {}

    # -- prefill side ----------------------------------------------------------------------
    def stream(self, seq: Sequence, first_block: int, sink: Callable[[KVPiece], None]) -> None:
        """Hand `sink` each layer of the prompt's blocks from `first_block` on as soon as a
        forward pass has computed it (blocks already cached here go with the first pass)."""
        if not seq.prefill_only or seq.status is not Status.WAITING:
            raise ValueError(f"{seq.request_id}: only a queued prefill-only request can be streamed")
        self.streams[seq.request_id] = _Stream(first_block, sink)

    def forget(self, request_id: str) -> None:
        """The sequence is finished: nothing more is streamed for it."""
        self.streams.pop(request_id, None)

    def computed_blocks(self, seq: Sequence, layer: int, first_block: int, num_blocks: int) -> torch.Tensor:
        """Layer `layer` of prompt blocks [first_block, first_block + num_blocks) (a re-send)."""
        if first_block < 0 or first_block + num_blocks > self.blocks.blocks_needed(seq.num_computed):
            raise ValueError(f"{seq.request_id}: blocks {first_block}+{num_blocks} are not computed")
        return self.view(layer, seq.block_table[first_block:first_block + num_blocks])

    def export(self, seq: Sequence, first_block: int) -> KVExport:
        """The prompt's KV blocks from `first_block` on, of a parked (prefilled) sequence."""
        if seq.status is not Status.PARKED:
            raise ValueError(f"{seq.request_id}: only a parked sequence can be exported ({seq.status})")
        table = seq.block_table[:self.blocks.blocks_needed(seq.num_prefill)]
        hashes = seq.full_block_hashes(self.blocks.block_size, seq.num_prefill)
        ids = torch.tensor(table[first_block:], dtype=torch.long, device=self.runner.device)
        gather = lambda layer: self.runner.ops.gather_blocks(self.runner.kv[layer], ids)  # noqa: E731
        return KVExport(seq.request_id, self.fingerprint, seq.token_ids[:seq.num_prefill], hashes,
                        first_block, len(table) - first_block, self.runner.mcfg.num_layers, gather)

    def view(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """Layer `layer` of these blocks: a view of the pool when they are adjacent, else a gather."""
        pool = self.runner.kv[layer]
        if block_ids and all(b - a == 1 for a, b in zip(block_ids, block_ids[1:])):
            return pool[block_ids[0]:block_ids[-1] + 1]
        return self.runner.ops.gather_blocks(pool, torch.tensor(block_ids, dtype=torch.long, device=pool.device))

    def layer_hook(self, sched: Schedule, hook: LayerHook | None) -> LayerHook | None:
        """The pass's layer hook: `hook`, plus the KV pieces this pass completes."""
        bs, pieces = self.blocks.block_size, []
        for seq, n in sched.chunks:
            stream = self.streams.get(seq.request_id)
            if stream is None:
                continue
            end = seq.num_computed + n
            upto = -(-end // bs) if end == seq.num_prefill else end // bs  # full blocks, or the prefill's end
            if upto > stream.sent_upto:
                pieces.append((seq.request_id, stream.sent_upto, seq.block_table[stream.sent_upto:upto], stream.sink))
                stream.sent_upto = upto
        if not pieces:
            return hook
        cuda, last = self.runner.device.type == "cuda", self.runner.mcfg.num_layers - 1

        def with_pieces(layer: int) -> None:
            if hook is not None:
                hook(layer)
            for rid, first, ids, sink in pieces:
                data = self.view(layer, ids)
                ready = torch.cuda.Event() if cuda else None
                if ready is not None:  # (on the pool's device's stream, whichever device is the thread's)
                    ready.record(torch.cuda.current_stream(self.runner.device))
                    if not isinstance(sink, OnDevice):
                        data, ready = self.copies.to_host(data, ready)  # on the KV stream, into pinned memory
                sink(KVPiece(rid, layer, first, data, ready, layer == last, tuple(ids)))
        return with_pieces

    # -- decode side -----------------------------------------------------------------------
    def write(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        """Write received blocks (n, 2, bs, kvh, hd), or their bytes, into pool blocks (the pool
        only: safe off the engine thread for the blocks of a reservation)."""
        pool, device = self.runner.kv[layer], self.runner.device
        data = data.view(pool.dtype) if data.dtype == torch.uint8 else data
        data = data.reshape(-1, *pool.shape[1:])
        if data.shape[0] != len(block_ids):
            raise ValueError(f"{data.shape[0]} blocks of data for {len(block_ids)} block ids")
        ids = torch.tensor(block_ids, dtype=torch.long)
        self.copies.to_device(lambda d: self.runner.ops.scatter_blocks(pool, ids.to(device), d), data, device)

    def write_layer(self, seq: Sequence, layer: int, buffer: torch.Tensor, first_block: int) -> None:
        """Write one whole layer of an export (KVExport.layer) into a reserved sequence."""
        if seq.status is not Status.IMPORTING:
            raise ValueError(f"{seq.request_id}: not reserved for import ({seq.status})")
        n = buffer.numel() * buffer.element_size() // self.runner.kv[layer][0].nbytes
        if first_block + n > len(seq.block_table):
            raise ValueError(f"{seq.request_id}: {n} blocks received, {len(seq.block_table) - first_block} reserved")
        self.write(layer, seq.block_table[first_block:first_block + n], buffer)

    def join(self) -> None:
        """The next pass waits for every write queued so far (before the blocks are read)."""
        self.copies.join()
