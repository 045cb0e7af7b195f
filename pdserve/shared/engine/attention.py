"""The attention block: q/k/v from one fused projection, q and k normed where the model does
and rotated (`Rotary`: RoPE's cos/sin tables, looked up once per pass), the new K/V written
into the pool, then decode rows and prompt chunks each attending over their paged context
(kernels: the C decode attention for Llama's layer on CPU, torch or Triton otherwise), and
one o_proj product.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from pdserve.shared.engine.batch import ForwardBatch
from pdserve.shared.engine.config import ModelConfig
from pdserve.shared.engine.kernels import cpu_attention
from pdserve.shared.engine.projection import Projection, RMSNorm, product
from pdserve.shared.engine.rope import Rope


class Rotary(nn.Module):
    cos: torch.Tensor  # (max_pos, rotary dims) buffers, times the scaling's attention factor
    sin: torch.Tensor  # its first half negated: rotate-half's sign, so a rotation is 4 ops

    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        dim = cfg.rotary_dim or cfg.head_dim
        inv_freq, factor = rope.frequencies(dim, cfg.max_position)
        freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                   # (max_pos, dim)
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        sin = emb.sin() * factor
        sin[:, :dim // 2].neg_()
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, hd) for the batch's positions: looked up once per forward pass."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, heads, hd), rotate-half convention: x·cos + (−x2, x1)·sin, with the sign in the
        table (−x2·sin and x2·(−sin) are the same float)."""
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1)
        return x * cos + swapped * sin


RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin (T, 1, rotary dims) at the batch's positions


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.h, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Projection(cfg.hidden_size, (self.h + 2 * self.kvh) * self.hd, cfg.qkv_bias)
        self.o_proj = Projection(self.h * self.hd, cfg.hidden_size, cfg.o_bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.norm_plus_one) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.norm_plus_one) if cfg.qk_norm else None
        self.scale, self.softcap, self.window = cfg.scale, cfg.attn_softcap, cfg.window(layer)
        self.rotary_dim = cfg.rotary_dim or self.hd
        self.local = bool(self.window) and cfg.local_rope is not None  # takes the local RoPE tables
        self.plain = cfg.plain  # what the C decode attention computes

    def forward(self, x: torch.Tensor, norm: RMSNorm, batch: ForwardBatch, pool: torch.Tensor,
                rope: RopeTables, ops: SimpleNamespace, post_norm: RMSNorm | None = None) -> torch.Tensor:
        """x + post_norm(attention(norm(x))): the residual stream after this block. Decode rows
        and prompt rows (a mixed pass has both) each take their own attention, then one o_proj
        product."""
        qkv = product(x, self.qkv_proj, norm=norm)
        d, rows = batch.num_decode, batch.kv_rows
        assert rows is not None  # (set by the model's forward)
        parts = []
        if d:
            parts.append(self._decode(qkv[:d], batch, pool, rows[:d], rope[0][:d], rope[1][:d], ops))
        if d < x.shape[0]:
            parts.append(self._prefill(qkv[d:], batch, pool, rows[d:], rope[0][d:], rope[1][d:], ops))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if post_norm is None:
            return product(out, self.o_proj, residual=x)
        return x + post_norm(product(out, self.o_proj))

    def _split(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, h, hd), k and v (T, kvh, hd), q and k normed (where the model does) and rotated
        (their first rotary_dim dimensions)."""
        t, qk = qkv.shape[0], (self.h + self.kvh) * self.hd
        heads = qkv[:, :qk].view(t, self.h + self.kvh, self.hd)
        if self.q_norm is not None and self.k_norm is not None:
            heads = torch.cat([self.q_norm(heads[:, :self.h]), self.k_norm(heads[:, self.h:])], dim=1)
        if self.rotary_dim == self.hd:
            rotated = Rotary.rotate(heads, cos, sin)
        else:
            rd = self.rotary_dim
            rotated = torch.cat([Rotary.rotate(heads[..., :rd], cos, sin), heads[..., rd:]], dim=-1)
        return rotated[:, :self.h], rotated[:, self.h:], qkv[:, qk:].view(t, self.kvh, self.hd)

    def _decode(self, qkv: torch.Tensor, batch: ForwardBatch, pool: torch.Tensor, rows: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        """One token per sequence against its paged context: (D, h·hd)."""
        if ops.decode_attention is not None and self.plain and cpu_attention.usable(pool, qkv, cos, sin):
            return ops.decode_attention(qkv, cos, sin, pool, rows, batch.block_tables, batch.context_lens,
                                        self.h, self.scale)
        q, k, v = self._split(qkv, cos, sin)
        ops.write_kv(pool, rows, k, v)
        out = ops.paged_decode_attention(q, pool, batch.block_tables, batch.context_lens, self.scale,
                                         self.window, self.softcap)
        return out.reshape(qkv.shape[0], self.h * self.hd)

    def _prefill(self, qkv: torch.Tensor, batch: ForwardBatch, pool: torch.Tensor, rows: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        """Prompt chunks, each causal over its cached prefix and itself: (P, h·hd)."""
        q, k, v = self._split(qkv, cos, sin)
        ops.write_kv(pool, rows, k, v)
        out = torch.empty_like(q)
        for start, n, ctx, table in batch.chunks:
            if ctx == n:  # no cached prefix: attend over the fresh K/V directly
                out[start:start + n] = ops.causal_attention(
                    q[start:start + n], k[start:start + n], v[start:start + n], self.scale, self.window, self.softcap)
            else:
                out[start:start + n] = ops.paged_prefill_attention(q[start:start + n], pool, table, ctx, self.scale,
                                                                   self.window, self.softcap)
        return out.view(qkv.shape[0], self.h * self.hd)
