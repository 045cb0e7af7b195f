"""The engine's token choice for a pass, kept on the device where it can be: on CUDA a batch whose rows change
no logit (no penalty, bias, min_tokens ban or grammar) and ask for no log probabilities is chosen in a few
batched kernels (argmax for greedy rows; seeded_draw.py's filters and keyed draw for the others, their settings
sent in one asynchronous copy from a persistent buffer), and the ids come back in one asynchronous copy into
pinned memory, the step waiting on that copy's event only: no synchronizing operation.

Any other batch, and every batch on a CPU, is sampler.py's (`sample`): a CPU engine's tokens are those it
always gave for a seed (torch.Generator per row); a CUDA engine's per-row path draws with seeded_draw.py too,
so its tokens for a seed do not depend on which path a step took. `batched=True` takes the batched path on a
CPU as well (the tests).
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.shared.engine.logprobs import Logprob
from pdserve.shared.engine.sampler import plain, sample, step_seed
from pdserve.shared.engine.seeded_draw import Rows
from pdserve.shared.engine.seeded_draw import sample as draw
from pdserve.shared.engine.sequence import Sequence
from pdserve.shared.engine.step_buffers import Staging


class DeviceSampler:
    def __init__(self, device: torch.device, max_rows: int, batched: bool | None = None):
        self.device, self.max_rows = device, max_rows
        self.batched = device.type == "cuda" if batched is None else batched
        # per drawn row: its row, top_k, key (int64), then temperature, top_p, min_p (float32, two to an int64)
        self.params = Staging(5 * max_rows, device)
        cuda = device.type == "cuda"
        self.ids = torch.zeros(max_rows, dtype=torch.long, pin_memory=cuda)  # the sampled ids, on the host
        self.copied = torch.cuda.Event() if cuda else None

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...],
               ahead: list[int] | None = None) -> tuple[list[int], list[Logprob | None]]:
        """sampler.sample's contract: logits (B, vocab) fp32, one row per sequence; B ids and their Logprobs."""
        if not (self.batched and seqs and len(seqs) <= self.max_rows and all(map(plain, seqs))):
            return sample(logits, seqs, eos_ids, ahead)
        with torch.inference_mode():
            tokens = logits.argmax(dim=-1)
            drawn = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
            if drawn:
                rows, settings = self._send([seqs[r] for r in drawn], [ahead[r] if ahead else 0 for r in drawn],
                                            drawn)
                tokens.index_copy_(0, rows, draw(logits.index_select(0, rows), settings))
            return self._to_host(tokens), [None] * len(seqs)

    def _send(self, seqs: list[Sequence], ahead: list[int], rows: list[int]) -> tuple[torch.Tensor, Rows]:
        """The drawn rows' indices and settings on the device, in one copy."""
        n, m = len(seqs), self.max_rows
        buf = self.params.writable()
        buf[:n] = rows
        buf[m:m + n] = [s.params.top_k for s in seqs]
        buf[2 * m:2 * m + n] = [step_seed(s.seed, s.num_generated + a) for s, a in zip(seqs, ahead)]
        floats = buf[3 * m:5 * m].view(np.float32)  # (2m,) float32 over the last 2m int64
        for f, values in enumerate(([s.params.temperature for s in seqs], [s.params.top_p for s in seqs],
                                    [s.params.min_p for s in seqs])):
            floats[f * m:f * m + n] = values
        self.params.send(5 * m)
        dev, fdev = self.params.dev, self.params.dev[3 * m:5 * m].view(torch.float32)
        p = [s.params for s in seqs]
        return dev[:n], Rows(fdev[:n], dev[m:m + n], fdev[m:m + n], fdev[2 * m:2 * m + n], dev[2 * m:2 * m + n],
                             any(q.top_k > 0 for q in p), any(q.top_p < 1 for q in p), any(q.min_p > 0 for q in p))

    def _to_host(self, tokens: torch.Tensor) -> list[int]:
        """The ids in one asynchronous copy into pinned memory, waited for on its event."""
        n = tokens.shape[0]
        if self.copied is None:
            return tokens.tolist()
        self.ids[:n].copy_(tokens, non_blocking=True)
        self.copied.record()
        self.copied.synchronize()
        return self.ids[:n].tolist()
