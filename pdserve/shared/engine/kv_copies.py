"""KV copies between the device and the host, off the compute stream (CUDA only; on CPU the
pool is host memory and nothing is copied).

The engine queues a pass's layers on the compute stream one after another. A copy of layer
i to the host queued on that stream too — what `.cpu()` from the sender did — waits behind
every layer queued after it, so the KV of a pass reached the host only once the pass was
over. `KVCopies` gives the KV path a stream of its own:

- `to_host(data, after)`: the prefill side's streamed layer, once `after` (recorded on the
  compute stream right after that layer) has passed, into pinned host memory (PyTorch's
  caching host allocator: reused, never freed while a copy uses it); returns the host tensor
  and the event that says it is there. A gathered `data` is kept from reuse until then.
- `to_device(write, data, device)`: the decode side's received blocks into the pool, on the
  KV stream; `join()` before a committed import's first decode step makes the compute stream
  wait for every such write (and `abort` of an import, before its blocks go to anyone else).
  The caller waits for its own write to finish (not for the compute stream): the staging
  buffer it came from is reused at once.
- Pinned host memory comes from PyTorch's caching host allocator, which keeps what it
  allocated: about the KV of the handoffs under way at once.

Not yet run on a GPU: `make gpu-check` exercises both directions and measures them against
pinned cudaMemcpy (scripts/gpu_check.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class KVCopies:
    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_host(self, data: torch.Tensor,
                after: torch.cuda.Event | None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self.stream is None or data.device.type != "cuda":
            return data, after
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        data.record_stream(self.stream)
        return host, done

    def to_device(self, write: Callable[[torch.Tensor], None], data: torch.Tensor, device: torch.device) -> None:
        """`write(data on the device)`, both the copy and the write on the KV stream."""
        if self.stream is None:
            write(data.to(device))
            return
        if data.device.type == "cuda":  # made on the compute stream (an export): after it, and kept till used
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            data.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            write(data.to(device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # this write only (not the compute stream): then its source may be reused

    def join(self) -> None:
        """Work queued on the current (compute) stream from now on waits for the KV stream's."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
