"""One prepared check of the GPU path (run on a CUDA machine: `make gpu-check`).

1. Triton gather / scatter equal the torch reference bit for bit (bf16 pool).
2. Triton paged decode attention matches the torch reference (bf16, realistic shapes).
3. SmolLM2 on CUDA (bf16): the engine with Triton kernels vs the same engine with torch
   kernels, greedy; and a KV export/import between two CUDA engines continues exactly.
4. Decode step time at batch 1, 8, 32 with each kernel backend, side by side, beside the HBM
   bandwidth limit for the weights' and the batch's KV bytes (a measured device copy rate).
5. The KV path (scripts/gpu_kv.py): streamed layers to pinned host memory on the engine's KV
   stream and received blocks back to the device, GB/s against pinned cudaMemcpy, and the
   exposed part of a 2k-token prefill's KV reaching the host.
6. The services (scripts/gpu_services.py): one prefill and one decode worker on CUDA (bf16)
   behind the router and gateway, requests handed off between them.
Writes bench/results/gpu_check.json; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.kernels import torch_ref, triton_kernels
from pdserve.shared.engine.kv_io import KVPiece
from pdserve.shared.engine.loader import LoadedModel, load
from pdserve.shared.engine.sequence import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
import gpu_kv  # noqa: E402 - beside this script
from gpu_services import drain, services  # noqa: E402

RESULTS = Path(__file__).parents[1] / "bench" / "results" / "gpu_check.json"

FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}")
    if not ok:
        FAILURES.append(name)


def kernels() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn(4096, 2, 16, 3, 64, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randperm(4096, device="cuda")[:300]
    buf = triton_kernels.gather_blocks(pool, ids)
    check("triton gather == torch", torch.equal(buf, torch_ref.gather_blocks(pool, ids)))
    a, b = torch.zeros_like(pool), torch.zeros_like(pool)
    triton_kernels.scatter_blocks(a, ids, buf)
    torch_ref.scatter_blocks(b, ids, buf)
    check("triton scatter == torch", torch.equal(a, b))
    for batch in (1, 8, 32):
        lens = torch.randint(1, 2048, (batch,), device="cuda")
        tables = torch.randint(0, 4096, (batch, 128), device="cuda")
        q = torch.randn(batch, 9, 64, device="cuda", generator=g).to(torch.bfloat16)
        out = triton_kernels.paged_decode_attention(q, pool, tables, lens, 0.125)
        ref = torch_ref.paged_decode_attention(q.float(), pool.float(), tables, lens, 0.125)
        err = (out.float() - ref).abs().max().item()
        check(f"triton paged decode attention, batch {batch}", err < 2e-2, f"max abs err {err:.2e}")


def generate(engine: Engine, prompt: list[int], n: int) -> list[int]:
    engine.add_request("g", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return drain(engine)



def engine_on_cuda() -> dict:
    loaded = load("smollm2", dtype=torch.bfloat16, device="cuda")
    tok = loaded.tokenizer
    assert tok is not None
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    tri = Engine(loaded, EngineConfig(num_blocks=4096, device="cuda", kernels="triton"))
    ref = Engine(loaded, EngineConfig(num_blocks=4096, device="cuda", kernels="torch"))
    a, b = generate(tri, prompt, 32), generate(ref, prompt, 32)
    same = sum(x == y for x, y in zip(a, b))
    check("engine triton vs torch kernels (greedy, 32 tokens)", same >= 24, f"{same}/32 equal; "
          f"text: {tok.decode(a)!r}")
    check("answer names Paris", "Paris" in tok.decode(a))

    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    src = Engine(loaded, EngineConfig(num_blocks=4096, device="cuda"))
    dst = Engine(loaded, EngineConfig(num_blocks=4096, device="cuda"))
    long_prompt = prompt * 8
    whole = generate(Engine(loaded, EngineConfig(num_blocks=4096, device="cuda")), long_prompt, 32)
    res = dst.reserve("x", long_prompt, params)
    src.add_request("x", long_prompt, params, prefill_only=True)
    first = next(o for o in src.step() if o.request_id == "x")
    export = src.export_kv("x", res.first_block)
    for layer in range(export.num_layers):
        dst.import_layer("x", layer, export.layer_bytes(layer), res.first_block)
    src.free("x")
    dst.commit_import("x", first.new_token_ids[0])
    moved = first.new_token_ids + drain(dst)
    check("export/import on CUDA continues exactly", moved == whole)
    check("no block leaks", src.num_free_blocks == src.num_blocks and dst.num_free_blocks == dst.num_blocks)

    # streamed, as the services do it: pieces from the layer hook (CUDA events), each encoded
    # on the host (native and int8) and written into the reservation on the device
    from pdserve.shared.kv import codec

    for encoding in ("native", "int8"):
        src = Engine(loaded, EngineConfig(num_blocks=4096, device="cuda", prefill_chunk=64))
        dst = Engine(loaded, EngineConfig(num_blocks=4096, device="cuda"))
        res = dst.reserve("s", long_prompt, params)
        pieces: list[KVPiece] = []
        src.add_request("s", long_prompt, params, prefill_only=True)
        src.stream_kv("s", res.first_block, pieces.append)
        while not (outs := src.step()):
            pass
        shape, dtype = tuple(dst.runner.kv.shape[2:]), dst.runner.kv.dtype
        for piece in pieces:
            assert piece.ready is not None  # (on CUDA: an event)
            piece.ready.synchronize()
            rows = codec.encode(encoding, piece.data)
            start = piece.first_block - res.first_block
            dst.write_kv(piece.layer, list(res.block_ids[start:start + piece.num_blocks]),
                         codec.decode(encoding, rows, shape, dtype))
        src.free("s")
        dst.commit_import("s", outs[0].new_token_ids[0])
        streamed = outs[0].new_token_ids + drain(dst)
        same = sum(x == y for x, y in zip(streamed, whole))
        check(f"streamed handoff on CUDA ({encoding})", streamed == whole if encoding == "native" else same >= 24,
              f"{same}/32 tokens equal, {len(pieces)} pieces")

    return decode_steps(loaded, prompt)


def hbm_gbps() -> float:
    """Device-to-device copy of 1 GiB: bytes read plus written per second."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - start) / 1e9


def decode_steps(loaded: LoadedModel, prompt: list[int]) -> dict:
    """Decode step time at batch 1, 8, 32 with each kernel backend, beside the HBM bandwidth
    limit: the weights' bytes and the batch's KV bytes read once per step at the copy rate."""
    gbps, cfg = hbm_gbps(), loaded.config
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.decoder.parameters())
    out: dict = {"hbm_copy_gbps": gbps, "weight_bytes": weight_bytes, "steps": []}
    for backend in ("triton", "torch"):
        eng = Engine(loaded, EngineConfig(num_blocks=8192, device="cuda", kernels=backend, max_num_seqs=64))
        for batch in (1, 8, 32):
            for i in range(batch):
                eng.add_request(f"b{i}", prompt * 4, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            while any(s.status.value == "waiting" for s in eng.seqs.values()):
                eng.step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(16):
                eng.step()
            torch.cuda.synchronize()
            step_ms = (time.perf_counter() - start) / 16 * 1e3
            kv_bytes = (batch * (len(prompt) * 4 + 24) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
                        * eng.runner.kv.element_size())
            bound_ms = (weight_bytes + kv_bytes) / (gbps * 1e9) * 1e3
            print(f"      decode step, {backend:6} kernels, batch {batch:2}: {step_ms:.2f} ms "
                  f"(HBM bound {bound_ms:.3f} ms: {bound_ms / step_ms:.1%} of it)")
            out["steps"].append({"kernels": backend, "batch": batch, "step_ms": step_ms, "hbm_bound_ms": bound_ms,
                                 "fraction_of_hbm_bound": bound_ms / step_ms})
            for i in range(batch):
                eng.abort(f"b{i}")
    return out


def kv_on_cuda() -> dict:
    loaded = load("smollm2", dtype=torch.bfloat16, device="cuda")
    text = " ".join(f"Entry {i}: the valve on line {i % 17} read {i * 13 % 97} bar." for i in range(400))
    assert loaded.tokenizer is not None
    prompt = loaded.tokenizer.encode(text)[:2000]
    copies = gpu_kv.memcpy_gbps()
    kv = gpu_kv.kv_path(loaded, prompt, check)
    summary = {**copies, **{k: v for k, v in kv.items() if not isinstance(v, list)},
               "kv_d2h_over_pinned": kv["kv_d2h_gbps"] / copies["d2h_pinned_gbps"],
               "kv_h2d_over_pinned": kv["kv_h2d_gbps"] / copies["h2d_pinned_gbps"]}
    for k, v in summary.items():
        print(f"      {k:32} {v:.4g}")
    return {"summary": summary, "exposed_per_round": kv["exposed_per_round"]}


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this script checks the GPU path")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    kernels()
    steps = engine_on_cuda()
    kv = kv_on_cuda()
    stack = services("cuda", check)
    RESULTS.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **kv,
                                   "decode_steps": steps, "services": stack, "failed": FAILURES}, indent=2))
    print(f"wrote {RESULTS}")
    print(f"\n{len(FAILURES)} failed: {FAILURES}" if FAILURES else "\nall GPU checks passed")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
