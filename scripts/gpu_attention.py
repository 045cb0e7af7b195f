"""Paged decode attention on the device (a step of gpu_check.py): the split-KV Triton kernel
(kernels/triton_decode.py, what `auto` takes on CUDA) against the one-program-per-(sequence, head)
kernel (kernels/triton_kernels.py, PD_KERNELS=triton-unsplit) and torch's, at the head layouts of
gpu_models.SHAPES, batch 1, 8 and 32, every sequence CONTEXT tokens long.

Each shape's pool has one layer per model layer (as the runner's), so a step's layers read HBM, not
L2. A layer's time is measured two ways: `graph_us`, the GPU time of one layer within a CUDA graph
of every layer's call (no launch cost: the kernels alone); `eager_us`, wall time per layer launched
from Python (what a step without graphs pays). `gbps`: the K/V bytes one layer reads over graph_us.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import gpu_models
import torch

from pdserve.shared.engine.kernels import torch_ref, triton_decode, triton_kernels

BATCHES = (1, 8, 32)
CONTEXT = 2048
BLOCK = 16
KERNELS: dict[str, Callable[..., torch.Tensor]] = {"split": triton_decode.paged_decode_attention,
                                                   "unsplit": triton_kernels.paged_decode_attention}


def heads(name: str) -> dict[str, int]:
    """A shape's attention layout from its transformers config (gpu_models.SHAPES)."""
    real = gpu_models.SHAPES[name][1]
    h = real["num_attention_heads"]
    return {"h": h, "kvh": real["num_key_value_heads"], "hd": real.get("head_dim") or real["hidden_size"] // h,
            "layers": real["num_hidden_layers"], "window": real.get("sliding_window") or 0}


def inputs(shape: dict[str, int], batch: int, context: int, device: str, layers: int) -> dict[str, Any]:
    """A bf16 pool of `layers` layers, each sequence `context` tokens in blocks of its own, and q."""
    per_seq = -(-context // BLOCK)
    g = torch.Generator(device=device).manual_seed(0)
    kv = torch.randn(layers, batch * per_seq, 2, BLOCK, shape["kvh"], shape["hd"], device=device,
                     generator=g, dtype=torch.bfloat16)
    tables = torch.randperm(batch * per_seq, device=device, generator=g).view(batch, per_seq).to(torch.int32)
    return {"kv": kv, "tables": tables, "lens": torch.full((batch,), context, dtype=torch.int32, device=device),
            "q": torch.randn(batch, shape["h"], shape["hd"], device=device, generator=g, dtype=torch.bfloat16)}


def agree(name: str, shape: dict[str, int], x: dict[str, Any], check: Callable[..., None]) -> None:
    """Both kernels against torch's on layer 0: full attention, then the shape's window (if any) with
    scores soft-capped at 50."""
    scale = shape["hd"] ** -0.5
    for window, softcap in ((0, 0.0), (shape["window"], 50.0)) if shape["window"] else ((0, 0.0),):
        args = (x["q"], x["kv"][0], x["tables"], x["lens"], scale, window, softcap)
        ref = torch_ref.paged_decode_attention(x["q"].float(), x["kv"][0].float(), *args[2:])
        for kernel, fn in KERNELS.items():
            err = (fn(*args).float() - ref).abs().max().item()
            check(f"{name}: {kernel} paged decode attention, batch {x['q'].shape[0]}, window {window}",
                  err < 2e-2, f"max abs err {err:.2e}")


def timed(fn: Callable[..., torch.Tensor], q: torch.Tensor, kv: torch.Tensor, rest: tuple, device: str,
          reps: int) -> dict[str, float]:
    """Per-layer microseconds of fn(q, kv[layer], *rest) over every layer: eager, and replayed in a CUDA
    graph."""
    layers = kv.shape[0]
    fn(q, kv[0], *rest)  # (compiles)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        for layer in range(layers):
            fn(q, kv[layer], *rest)
    sync()
    out = {"eager_us": (time.perf_counter() - t0) / (reps * layers) * 1e6}
    if device.startswith("cuda"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for layer in range(layers):
                fn(q, kv[layer], *rest)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        out["graph_us"] = start.elapsed_time(end) * 1e3 / (reps * layers)
    return out


def decode_attention(device: str, check: Callable[..., None], names: list[str] | None = None,
                     batches: tuple[int, ...] = BATCHES, context: int = CONTEXT, reps: int = 20) -> dict:
    """{shape: {"batch N": {kernel: timings, "splits": n}}}, the kernels checked against torch's first."""
    out: dict = {"context": context, "block_size": BLOCK}
    for name in names or list(gpu_models.SHAPES):
        shape = heads(name)
        rows: dict[str, dict] = {}
        for batch in batches:
            x = inputs(shape, batch, context, device, shape["layers"] if device.startswith("cuda") else 1)
            agree(name, shape, x, check)
            scale = shape["hd"] ** -0.5
            row: dict = {"splits": triton_decode.num_splits(batch, shape["kvh"], context,
                                                            triton_decode.sm_count(x["q"].device))}
            for kernel, fn in KERNELS.items():
                row[kernel] = timed(fn, x["q"], x["kv"], (x["tables"], x["lens"], scale), device, reps)
                if "graph_us" in row[kernel]:
                    read = batch * context * shape["kvh"] * shape["hd"] * 2 * x["kv"].element_size()
                    row[kernel]["gbps"] = read / row[kernel]["graph_us"] / 1e3
            rows[f"batch {batch}"] = row
            del x
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        out[name] = rows
    return out


def speedups(result: dict) -> dict[str, dict[str, float]]:
    """unsplit / split time per shape and batch (graph_us where measured, else eager_us): the summary's."""
    out = {}
    for name, rows in result.items():
        if not isinstance(rows, dict):
            continue
        key = "graph_us" if "graph_us" in next(iter(rows.values()))["split"] else "eager_us"
        out[name] = {b: round(r["unsplit"][key] / r["split"][key], 2) for b, r in rows.items()}
    return out
