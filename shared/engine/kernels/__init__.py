"""Paged-KV kernels behind one small interface, with a torch and a Triton backend.

`select(backend, device)` returns a namespace with gather_blocks, scatter_blocks,
write_kv, paged_decode_attention and paged_prefill_attention. "auto" takes Triton on CUDA
(when importable) and torch elsewhere; writes and prefill attention always use torch
(index_copy_ and SDPA are already the fast path there).
"""

from __future__ import annotations

from types import SimpleNamespace

from shared.engine.kernels import torch_ref


def select(backend: str, device: str) -> SimpleNamespace:
    use_triton = backend == "triton" or (backend == "auto" and device.startswith("cuda")
                                         and _triton_available())
    ops = SimpleNamespace(name="torch", gather_blocks=torch_ref.gather_blocks,
                          scatter_blocks=torch_ref.scatter_blocks, write_kv=torch_ref.write_kv,
                          paged_decode_attention=torch_ref.paged_decode_attention,
                          paged_prefill_attention=torch_ref.paged_prefill_attention,
                          causal_attention=torch_ref.causal_attention)
    if use_triton:
        from shared.engine.kernels import triton_kernels as tk
        ops.name = "triton"
        ops.gather_blocks = tk.gather_blocks
        ops.scatter_blocks = tk.scatter_blocks
        ops.paged_decode_attention = tk.paged_decode_attention
    return ops


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
