"""RoPE frequencies for each scaling a checkpoint's `rope_parameters` (or `rope_scaling`) names:
default, linear, dynamic, llama3 and yarn, computed as transformers' `modeling_rope_utils` does
(tests/engine/test_architectures.py holds each to it); and `factors`, a divisor per frequency as
a GGUF file's `rope_freqs.weight` stores one (llama.cpp's converter writes Llama 3.1's `llama3`
scaling so).

`Rope` is what the model config keeps; `frequencies` gives the inverse frequencies of the
rotated dimensions and the factor cos and sin are multiplied by (yarn's attention factor, 1
elsewhere). `dynamic` (NTK) changes nothing within the model's trained context, and the engine
serves no longer context than that (`ModelConfig.max_position`), so it is plain RoPE here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where the frequencies are computed: a config is read without it)
    import torch

SCALINGS = ("default", "linear", "dynamic", "llama3", "yarn", "factors")


@dataclass(frozen=True)
class Rope:
    theta: float = 10000.0
    kind: str = "default"  # one of SCALINGS
    # the scaling's own keys (`factors`: ("factors", one divisor per frequency))
    params: tuple[tuple[str, float | int | bool | tuple[float, ...] | None], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.kind not in SCALINGS:
            raise ValueError(f"RoPE scaling {self.kind!r} is not supported (supported: {', '.join(SCALINGS)})")

    @classmethod
    def of(cls, hf: dict, default_theta: float = 10000.0) -> Rope:
        """From a Hugging Face `rope_parameters` / `rope_scaling` dict (type under `rope_type` or `type`)."""
        kind = hf.get("rope_type", hf.get("type", "default")) or "default"
        keep = {k: v for k, v in hf.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")
                and isinstance(v, int | float | bool | None)}
        return cls(float(hf.get("rope_theta") or default_theta), kind, tuple(sorted(keep.items())))

    def frequencies(self, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
        """(inverse frequencies (dim/2,) fp32, attention factor) for `dim` rotated dimensions."""
        import torch

        p: dict = dict(self.params)
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.kind == "linear":
            return inv / p["factor"], 1.0
        if self.kind == "llama3":
            return _llama3(inv, p), 1.0
        if self.kind == "yarn":
            return _yarn(self.theta, dim, p, max_position)
        if self.kind == "factors":
            if len(p["factors"]) != len(inv):
                raise ValueError(f"{len(p['factors'])} RoPE frequency factors for {len(inv)} frequencies")
            return inv / torch.tensor(p["factors"], dtype=torch.float32), 1.0
        return inv, 1.0  # default, dynamic (within the trained context)


def _llama3(inv: torch.Tensor, p: dict) -> torch.Tensor:
    import torch

    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, p: dict, max_position: int) -> tuple[torch.Tensor, float]:
    import torch

    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction(p.get("beta_fast") or 32), correction(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv, float(attention)
