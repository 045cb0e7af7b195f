"""Where a layer's weights are applied: `product` (a norm or a gate, the matrix product, the
bias and the residual add) over a `Projection` whose weight is fp32, or kept `Packed` in the
file's own blocks (weights.py) and computed by their kernel; `linear` for a bare matrix (the
vocabulary projection). `RMSNorm` is the norm a product may start with.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.shared.engine.weights import Packed


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalized in fp32 whatever the weight dtype, as the reference implementations do;
        # Llama scales in x's dtype, Gemma (weights as offsets from 1) in fp32
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | Packed, min_rows: int = 16, max_rows: int = 256) -> torch.Tensor:
    """x (M, in) @ weight(out, in).T. On CPU, MKL runs skinny batches faster as (weight @ x.T).T
    (measured: 25% at M=32, 2x for the vocabulary projection at M=8, nothing from M=512 on,
    where the transposed copy then costs more than it saves). A `Packed` weight (the file's
    own blocks, weights.py) goes to its kernel."""
    if isinstance(weight, Packed):
        return weight.matmul(x)
    if x.device.type == "cpu" and min_rows <= x.shape[0] <= max_rows:
        return (weight @ x.t()).t().contiguous()
    return F.linear(x, weight)


class Projection(nn.Linear):
    """A linear layer whose weight may be kept `Packed` (weights.py) instead of fp32."""

    packed: Packed | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)

    @property
    def matrix(self) -> torch.Tensor | Packed:
        return self.weight if self.packed is None else self.packed

    def pack(self, packed: Packed) -> None:
        """Compute with `packed` from now on; the fp32 weight is let go (a bias stays)."""
        if packed.shape != tuple(self.weight.shape):
            raise ValueError(f"packed weight {packed.shape} for a {tuple(self.weight.shape)} projection")
        self.packed = packed
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)


_GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


def product(x: torch.Tensor, proj: Projection, norm: RMSNorm | None = None, gate: str = "",
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + f(x) @ proj.T (+ its bias), f the step before the product: `norm`, or a
    `gate` (x is (gate, up) side by side: act(gate)·up, act silu or gelu_tanh). A packed
    projection's kernel does f and the residual add itself, as one pass over the row, where it
    has no bias; other ones do them in torch."""
    w = proj.matrix
    if isinstance(w, Packed) and proj.bias is None:
        return w.matmul(x, residual, None if norm is None else (norm.weight, norm.eps), gate,
                        norm is not None and norm.plus_one)
    if norm is not None:
        x = norm(x)
    if gate:
        g, up = x.chunk(2, dim=-1)
        x = _GATES[gate](g) * up
    y = linear(x, w)
    if proj.bias is not None:
        y = y + proj.bias
    return y if residual is None else residual + y
