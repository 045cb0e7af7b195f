"""Triton kernels (interpreted on CPU), C and torch kernels against plain attention."""

import math

import pytest
import torch

from pdserve.shared.engine.kernels import cpu_attention, torch_ref

triton_kernels = pytest.importorskip("pdserve.shared.engine.kernels.triton_kernels")


def _pool(num_blocks=12, bs=4, kvh=2, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, 2, bs, kvh, hd, generator=g)


def _naive_attention(q, k, v, scale, window=0, softcap=0.0):
    """q (H, hd) against k, v (L, kvh, hd) with repeated KV heads: the last `window` of them
    when set, scores soft-capped when `softcap` is."""
    if window:
        k, v = k[-window:], v[-window:]
    rep = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    w = torch.einsum("hd,lhd->hl", q, k) * scale
    if softcap:
        w = softcap * torch.tanh(w / softcap)
    return torch.einsum("hl,lhd->hd", w.softmax(-1), v)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gather_scatter_round_trip(impl):
    mod = torch_ref if impl == "torch" else triton_kernels
    pool = _pool()
    ids = torch.tensor([7, 2, 11, 0])
    buf = mod.gather_blocks(pool, ids)
    assert buf.shape == (4, *pool.shape[1:]) and buf.is_contiguous()
    assert torch.equal(buf[1], pool[2])
    dst = torch.zeros_like(pool)
    mod.scatter_blocks(dst, torch.tensor([1, 3, 5, 9]), buf.view(torch.uint8).view(pool.dtype))
    assert torch.equal(dst[5], pool[11]) and torch.equal(dst[0], torch.zeros_like(pool[0]))


@pytest.mark.parametrize("impl", ["torch", "triton", "c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_matches_naive(impl, dtype):
    mod = {"torch": torch_ref, "triton": triton_kernels, "c": cpu_attention}[impl]
    bs, kvh, hd, h = 4, 2, 8, 6
    pool = _pool(bs=bs, kvh=kvh, hd=hd).to(dtype)
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [11, 2, 4, 9]])
    lens = torch.tensor([10, 3, 16])
    q = torch.randn(3, h, hd, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = 1 / math.sqrt(hd)
    out = mod.paged_decode_attention(q, pool, tables, lens, scale)
    for b in range(3):
        kv = pool[tables[b]].float()  # (nb, 2, bs, kvh, hd)
        k = kv[:, 0].reshape(-1, kvh, hd)[:lens[b]]
        v = kv[:, 1].reshape(-1, kvh, hd)[:lens[b]]
        ref = _naive_attention(q[b].float(), k, v, scale)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", ["torch", "triton", "c"])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (0, 2.0), (6, 1.5)])
def test_paged_decode_attention_with_a_sliding_window_and_soft_capping(impl, window, softcap):
    """Mistral's and Gemma's attention: the context's last `window` tokens (a window smaller
    than a sequence's context, one larger than another's), scores soft-capped."""
    mod = {"torch": torch_ref, "triton": triton_kernels, "c": cpu_attention}[impl]
    bs, kvh, hd, h = 4, 2, 8, 4
    pool = _pool(bs=bs, kvh=kvh, hd=hd)
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [11, 2, 4, 9]])
    lens = torch.tensor([10, 3, 16])
    q = 3 * torch.randn(3, h, hd, generator=torch.Generator().manual_seed(1))
    out = mod.paged_decode_attention(q, pool, tables, lens, 0.4, window, softcap)
    for b in range(3):
        kv = pool[tables[b]]
        k, v = kv[:, 0].reshape(-1, kvh, hd)[:lens[b]], kv[:, 1].reshape(-1, kvh, hd)[:lens[b]]
        torch.testing.assert_close(out[b], _naive_attention(q[b], k, v, 0.4, window, softcap), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (4, 0.0), (0, 2.0), (5, 1.5)])
def test_prefill_attention_with_a_sliding_window_and_soft_capping(window, softcap):
    """A prompt chunk after a cached prefix, and one with none: each position sees its own last
    `window` tokens."""
    kvh, hd, h = 2, 8, 4
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(12, kvh, hd, generator=g), torch.randn(12, kvh, hd, generator=g)
    q = 3 * torch.randn(12, h, hd, generator=g)
    for n in (5, 12):  # the last 5 of a 12-token context; the whole context at once
        out = torch_ref.causal_attention(q[-n:], k, v, 0.4, window, softcap)
        for i in range(n):
            end = 12 - n + i + 1
            ref = _naive_attention(q[12 - n + i], k[:end], v[:end], 0.4, window, softcap)
            torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


def test_write_kv_and_prefill_attention_with_cached_prefix():
    bs, kvh, hd, h = 4, 1, 8, 2
    pool = torch.zeros(6, 2, bs, kvh, hd)
    table = torch.tensor([4, 1, 3])
    k, v = torch.randn(10, kvh, hd), torch.randn(10, kvh, hd)
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(10)])
    torch_ref.write_kv(pool, torch_ref.kv_rows(slots, bs), k, v)
    assert torch.equal(pool[1, 0, 2], k[6]) and torch.equal(pool[3, 1, 1], v[9])
    q = torch.randn(3, h, hd)  # the last 3 positions of a 10-token context
    out = torch_ref.paged_prefill_attention(q, pool, table, 10, 0.5)
    for i in range(3):
        ref = _naive_attention(q[i], k[:8 + i], v[:8 + i], 0.5)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


def test_c_decode_attention_is_rope_kv_write_and_attention_in_one_call():
    """The C decode step (attention.c) against torch's ops one after another: same pool, same
    output."""
    from pdserve.shared.engine.attention import Rotary

    bs, kvh, hd, h, width = 4, 2, 8, 6, 4
    g = torch.Generator().manual_seed(2)
    pool = _pool(bs=bs, kvh=kvh, hd=hd)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0]])
    lens = torch.tensor([11, 6])  # each new token is the last of its context
    slots = torch.tensor([tables[b, (n - 1) // bs] * bs + (n - 1) % bs for b, n in enumerate(lens.tolist())])
    rows = torch_ref.kv_rows(slots, bs)
    qkv = torch.randn(2, (h + 2 * kvh) * hd, generator=g)
    cos, sin = torch.randn(2, 1, hd, generator=g), torch.randn(2, 1, hd, generator=g)

    want_pool = pool.clone()
    qk = Rotary.rotate(qkv[:, :(h + kvh) * hd].view(2, h + kvh, hd), cos, sin)
    torch_ref.write_kv(want_pool, rows, qk[:, h:], qkv[:, (h + kvh) * hd:].view(2, kvh, hd))
    want = torch_ref.paged_decode_attention(qk[:, :h], want_pool, tables, lens, 0.3).reshape(2, h * hd)

    got = cpu_attention.decode_attention(qkv.clone(), cos, sin, pool, rows, tables[:, :width], lens, h, 0.3)
    torch.testing.assert_close(pool, want_pool, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
