"""The engine part of `make gpu-check` (scripts/gpu_check.py): random-weight models of real shapes, built by
transformers and held to its forward on the same device, then timed.

Each shape (Qwen2.5-1.5B, Llama-3.2-1B, Gemma-3-1B; `tiny`: the same architectures a few layers wide, for a
CPU) is made with `from_config` from a fixed seed and written with `save_pretrained` (safetensors, no
download: HF_HUB_OFFLINE=1); the engine loads that directory as it loads any checkpoint. Checked:

- greedy: the engine's first NEW tokens against transformers' in fp32 on the device. Equal, or, where they
  part, each side's token among the other's TOP most likely there (vLLM's check_logprobs_close: random
  weights give flat distributions, and bf16 turns a near tie either way); the engine's plain greedy batch
  path and its per-row path (a request with log probabilities) give the same tokens;
- log probabilities: the engine's, at its own tokens and their TOP alternatives, against transformers' fp32
  ones; in fp32 within FP32_TOL, in a lower precision within LOW_SLACK times transformers' own error in it;
- the decode step at each batch size with a context of `context` tokens, beside the bound the device's
  memory bandwidth sets (the weights' and the batch's KV bytes read once a step at the measured copy rate),
  and prefill tokens per second over the batch's prompts.

Imports torch, transformers and the engine only (scripts/gpu_check.py's test holds it to that).
"""

from __future__ import annotations

import copy
import gc
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import LoadedModel, load
from pdserve.shared.engine.sequence import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
NEW, TOP = 16, 5
FP32_TOL = 1e-3  # max abs log-probability difference, fp32 engine vs fp32 transformers
LOW_SLACK = 2.0  # bf16 engine vs fp32 transformers: at most this x transformers' own bf16 error
SEED = 0
Check = Callable[..., None]

# name -> (transformers config class, the real model's settings, the tiny model's)
TINY: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                            initializer_range=0.25, bos_token_id=1, eos_token_id=2)
SHAPES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen2.5-1.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=False,
        bos_token_id=151643, eos_token_id=151643), dict(tie_word_embeddings=True)),
    "llama-3.2-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        dict(tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "gemma-3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, sliding_window=512, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        dict(num_hidden_layers=6, num_key_value_heads=1, sliding_window=24, query_pre_attn_scalar=16)),
}


def hf_config(name: str, tiny: bool) -> Any:
    import transformers

    cls, real, small = SHAPES[name]
    return getattr(transformers, cls)(**({**real, **TINY, **small} if tiny else real))


def build(name: str, tiny: bool, device: str, dtype: torch.dtype, root: Path) -> tuple[Any, Any, Path]:
    """(transformers' model in fp32, the same in `dtype` (None when fp32), the directory the engine loads:
    the `dtype` weights), on `device`."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(name, tiny)
    cfg._attn_implementation = "eager"  # (the reference every implementation is held to)
    torch.manual_seed(SEED)
    with torch.device(device):
        ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from their init (Gemma's start at 0, i.e. 1 + 0)
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    low = None if dtype == torch.float32 else copy.deepcopy(ref).to(dtype)
    path = root / name
    (ref if low is None else low).save_pretrained(path)
    return ref, low, path


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, each token from a whole forward pass (no cache: the same call in
    every transformers version)."""
    dev, ids = next(model.parameters()).device, list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=dev)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_logprobs(model: Any, ids: list[int], start: int) -> torch.Tensor:
    """log-softmax (fp32) of the next-token logits at positions start.. of `ids`, (n, vocab)."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=dev)).logits[0, start:]
    return torch.log_softmax(logits.float(), dim=-1)


def drain(engine: Engine) -> dict[str, list]:
    """request id -> its outputs, stepping until the engine has no work."""
    outs: dict[str, list] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def engine_greedy(loaded: LoadedModel, prompt: list[int], cfg: EngineConfig) -> tuple[list[int], list, list[int]]:
    """(the engine's greedy tokens with log probabilities, their Logprobs, its tokens without them: from another
    engine, the same passes)."""
    engine = Engine(loaded, cfg)
    engine.add_request("lp", prompt, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=TOP))
    outs = drain(engine)["lp"]
    engine = Engine(loaded, cfg)
    engine.add_request("plain", prompt, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    plain = [t for o in drain(engine)["plain"] for t in o.new_token_ids]
    return [t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in o.logprobs or []], plain


def compare(name: str, ref: Any, low: Any, loaded: LoadedModel, prompt: list[int], cfg: EngineConfig,
            check: Check) -> dict:
    """The engine against transformers: greedy tokens and log probabilities (the module's docstring)."""
    want = hf_greedy(ref, prompt, NEW)
    got, lps, plain = engine_greedy(loaded, prompt, cfg)
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), NEW)
    lp32 = hf_logprobs(ref, prompt + got[:-1], len(prompt) - 1)
    close = same == NEW or (want[same] in [t for t, _ in lps[same].top]
                            and got[same] in lp32[same].topk(TOP).indices.tolist())
    check(f"{name}: greedy tokens equal transformers' (or part at a near tie)", close and len(got) == NEW,
          f"{same}/{NEW} equal before they part")
    check(f"{name}: plain greedy batch path == per-row path", plain == got)
    pairs = [(i, t, v) for i, lp in enumerate(lps) for t, v in lp.top]
    err = max(abs(v - float(lp32[i, t])) for i, t, v in pairs)
    out = {"tokens_equal": same, "tokens": NEW, "logprob_max_abs_err": err}
    if low is None:
        check(f"{name}: log probabilities within {FP32_TOL} of transformers' (fp32)", err < FP32_TOL, f"{err:.2e}")
        return out
    lp_low = hf_logprobs(low, prompt + got[:-1], len(prompt) - 1)
    own = max(abs(float(lp_low[i, t]) - float(lp32[i, t])) for i, t, _ in pairs)
    check(f"{name}: log probabilities as close to fp32 transformers' as its own {cfg.torch_dtype} ones",
          err <= LOW_SLACK * own, f"{err:.3f} vs transformers' {own:.3f}")
    return {**out, "transformers_low_precision_err": own}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def copy_gbps(device: str) -> float | None:
    """The device's memory bandwidth as a copy of 1 GiB measures it (bytes read plus written per second);
    None on a CPU (no bound is given there)."""
    if not device.startswith("cuda"):
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - start) / 1e9


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def kv_bytes_read(loaded: LoadedModel, engine: Engine) -> int:
    """The KV bytes a decode step reads: each running sequence's context in each layer (a windowed
    layer's window at most)."""
    mcfg, elem = loaded.config, engine.runner.kv.element_size()
    per_token = 2 * mcfg.num_kv_heads * mcfg.head_dim * elem
    lens = [len(s.token_ids) for s in engine.seqs.values()]
    return sum(min(n, mcfg.window(layer) or n) for layer in range(mcfg.num_layers) for n in lens) * per_token


def decode_steps(loaded: LoadedModel, base: EngineConfig, batches: list[int], context: int, steps: int,
                 gbps: float | None) -> dict:
    """Every batch's prompts of `context` tokens prefilled at once (prefill tokens per second), then the decode
    step timed at each batch size, largest first (the others aborted between sizes)."""
    batches, device = sorted(batches, reverse=True), base.device
    extra = batches[0] * context // base.max_batched_tokens + steps * (len(batches) + 1) + 64  # tokens decoded
    cfg = replace(base, num_blocks=batches[0] * -(-(context + extra) // base.block_size) + 16, kv_cache_gib=None)
    engine = Engine(loaded, cfg)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.decoder.parameters())
    params = SamplingParams(max_tokens=extra, temperature=0, ignore_eos=True)
    live = [f"b{i}" for i in range(batches[0])]
    for rid, ids in zip(live, prompts(batches[0], context, loaded.config.vocab_size, SEED + 1)):
        engine.add_request(rid, ids, params)
    sync(device)
    start = time.perf_counter()
    while any(s.status.value == "waiting" for s in engine.seqs.values()):
        engine.step()
    sync(device)
    out: dict = {"prefill_tokens_per_s": batches[0] * context / (time.perf_counter() - start),
                 "weight_bytes": weight_bytes, "context": context, "steps": []}
    for batch in batches:
        for rid in live[batch:]:
            engine.abort(rid)
        live = live[:batch]
        engine.step()  # (a step at this size first)
        kv_bytes = kv_bytes_read(loaded, engine)
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        step_ms = (time.perf_counter() - start) / steps * 1e3
        row: dict = {"batch": batch, "step_ms": step_ms, "tokens_per_s": batch / step_ms * 1e3}
        if gbps:
            bound_ms = (weight_bytes + kv_bytes) / (gbps * 1e9) * 1e3
            row |= {"hbm_bound_ms": bound_ms, "over_bound": step_ms / bound_ms}
        out["steps"].append(row)
        print(f"      decode step, batch {batch:2}: {step_ms:8.2f} ms" +
              (f"  ({row['over_bound']:.2f}x the HBM bound {row['hbm_bound_ms']:.3f} ms)" if gbps else ""))
    return out


def handoff(loaded: LoadedModel, base: EngineConfig, prompt: list[int], check: Check) -> None:
    """A prompt prefilled in one engine, its KV exported whole or streamed layer by layer (as the services
    stream it) into another, decodes there exactly as one engine does."""
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    whole = Engine(loaded, base)
    whole.add_request("w", prompt, params)
    want = [t for o in drain(whole)["w"] for t in o.new_token_ids]
    for streamed in (False, True):
        src = Engine(loaded, replace(base, prefill_chunk=64) if streamed else base)
        dst = Engine(loaded, base)
        res = dst.reserve("x", prompt, params)
        pieces: list = []
        src.add_request("x", prompt, params, prefill_only=True)
        if streamed:
            src.stream_kv("x", res.first_block, pieces.append)
        while not (outs := src.step()):
            pass
        if streamed:
            for p in pieces:
                if p.ready is not None:  # (on CUDA: an event)
                    p.ready.synchronize()
                start = p.first_block - res.first_block
                dst.write_kv(p.layer, list(res.block_ids[start:start + p.num_blocks]), p.data)
        else:
            export = src.export_kv("x", res.first_block)
            for layer in range(export.num_layers):
                dst.import_layer("x", layer, export.layer_bytes(layer), res.first_block)
        src.free("x")
        first = outs[0].new_token_ids
        dst.commit_import("x", first[0])
        got = first + [t for o in drain(dst).get("x", []) for t in o.new_token_ids]
        how = f"streamed in {len(pieces)} pieces" if streamed else "exported whole"
        check(f"{loaded.name}: KV {how} continues exactly in another engine", got == want,
              f"{sum(a == b for a, b in zip(got, want))}/{len(want)} tokens equal")
        check(f"{loaded.name}: no block leaks ({how})", src.num_free_blocks == src.num_blocks
              and dst.num_free_blocks == dst.num_blocks)


def run(name: str, tiny: bool, base: EngineConfig, root: Path, timing: dict, check: Check) -> dict:
    """One shape: built, compared with transformers, handed off, then timed with each kernel backend
    (`timing`: batches, context, steps, gbps, kernels)."""
    device, dtype = base.device, base.torch_dtype
    start = time.perf_counter()
    ref, low, path = build(name, tiny, device, dtype, root)
    loaded = load(str(path), dtype=dtype, device=device)
    built_s = time.perf_counter() - start
    prompt = prompts(1, 64 if tiny else 640, loaded.config.vocab_size, SEED + 2)[0]  # (past Gemma's windows)
    out: dict = {"config": {k: v for k, v in vars(loaded.config).items() if isinstance(v, int | float | str)},
                 "built_s": built_s, **compare(name, ref, low, loaded, prompt, base, check)}
    del ref, low
    free(device)
    loaded.name = name
    handoff(loaded, base, prompt, check)
    out["decode"] = {}
    for kernels in timing["kernels"]:
        print(f"    {name}, {kernels} kernels:")
        out["decode"][kernels] = decode_steps(loaded, replace(base, kernels=kernels), timing["batches"],
                                              timing["context"], timing["steps"], timing["gbps"])
        free(device)
    return out


def free(device: str) -> None:
    """What the last step left (engines, transformers' models) given back before the next is made."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
