"""Paged-KV kernels behind one small interface, with torch, Triton and C backends.

`select(backend, device)` returns a namespace with gather_blocks, scatter_blocks,
write_kv, paged_decode_attention and paged_prefill_attention, and decode_attention (RoPE, KV
write and attention of a decode step in one call; C only, else None). "auto" takes Triton on CUDA
(when importable; its decode attention split-KV, triton_decode.py, and with "triton-unsplit" one
program per sequence and head, triton_kernels.py, for comparison) and, on CPU, C decode attention
(cpu_attention.py, when the machine has a C compiler; torch's otherwise, with a warning); writes
and prefill attention always use torch (index_copy_ and SDPA are already the fast path there).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

from pdserve.shared.engine.kernels import torch_ref

log = logging.getLogger(__name__)


def select(backend: str, device: str) -> SimpleNamespace:
    use_triton = backend in ("triton", "triton-unsplit") or (backend == "auto" and device.startswith("cuda")
                                         and _triton_available())
    ops = SimpleNamespace(name="torch", gather_blocks=torch_ref.gather_blocks,
                          scatter_blocks=torch_ref.scatter_blocks, write_kv=torch_ref.write_kv,
                          paged_decode_attention=torch_ref.paged_decode_attention,
                          paged_prefill_attention=torch_ref.paged_prefill_attention,
                          causal_attention=torch_ref.causal_attention, decode_attention=None)
    if use_triton:
        from pdserve.shared.engine.kernels import triton_decode
        from pdserve.shared.engine.kernels import triton_kernels as tk
        ops.name = "triton"
        ops.gather_blocks = tk.gather_blocks
        ops.scatter_blocks = tk.scatter_blocks
        unsplit = backend == "triton-unsplit"
        ops.paged_decode_attention = tk.paged_decode_attention if unsplit else triton_decode.paged_decode_attention
    elif backend in ("auto", "c") and device == "cpu":
        from pdserve.shared.engine.kernels import cpu_attention
        try:
            cpu_attention.library()
        except RuntimeError as e:
            if backend == "c":
                raise
            log.warning("decode attention in torch, not C: %s", e)
        else:
            ops.name = "c"
            ops.paged_decode_attention = cpu_attention.paged_decode_attention
            ops.decode_attention = cpu_attention.decode_attention
    return ops


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
