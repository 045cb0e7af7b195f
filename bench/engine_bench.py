"""Engine vs transformers on the same model, same threads, measured side by side in one run.

    python -m bench.engine_bench [--threads 2] [--rounds 3] [--decode-steps 16]

Prints prefill throughput (tokens/s) at 512 and 2048 prompt tokens and the decode step time at
batch 1, 8 and 32, for both implementations, each the median of interleaved rounds, and our
figure as a ratio of theirs. Targets: decode at batch 8 and 32 at least as fast as
transformers; prefill within 1.2x of it. transformers runs its own KV cache (DynamicCache)
and computes only the last position's logits in prefill, as its generate() does.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.loader import load, smollm2_path
from shared.engine.sequence import SamplingParams

PROMPT_FOR_DECODE = 128


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def ours_prefill(engine: Engine, n: int, seed: int) -> float:
    engine.add_request("p", random_prompt(n, seed), SamplingParams(max_tokens=1, temperature=0),
                       prefill_only=True)
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    engine.abort("p")
    return elapsed


def hf_prefill(model, n: int, seed: int) -> float:
    ids = torch.tensor([random_prompt(n, seed)])
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def ours_decode(engine: Engine, batch: int, steps: int, seed: int) -> float:
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", random_prompt(PROMPT_FOR_DECODE, seed + i), params)
    while any(s.status.value == "waiting" for s in engine.seqs.values()):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    for i in range(batch):
        engine.abort(f"d{i}")
    return elapsed


def hf_decode(model, batch: int, steps: int, seed: int) -> float:
    ids = torch.tensor([random_prompt(PROMPT_FOR_DECODE, seed + i) for i in range(batch)])
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    engine = Engine(load("smollm2"), EngineConfig(num_blocks=2048, max_batched_tokens=2048,
                                                  prefill_chunk=2048, max_num_seqs=64))
    hf_prefill(hf, 64, 0), ours_prefill(engine, 64, 0)  # warm both up

    rows = []
    for n in (512, 2048):
        o = statistics.median(ours_prefill(engine, n, r) for r in range(args.rounds))
        h = statistics.median(hf_prefill(hf, n, r) for r in range(args.rounds))
        rows.append((f"prefill {n} tok (tok/s)", n / o, n / h, h / o, "ours/theirs tok/s, target >= 0.83"))
    for b in (1, 8, 32):
        o_t, h_t = [], []
        for r in range(args.rounds):  # interleaved so drift on a shared machine hits both
            o_t.append(ours_decode(engine, b, args.decode_steps, 100 * r))
            h_t.append(hf_decode(hf, b, args.decode_steps, 100 * r))
        o, h = statistics.median(o_t), statistics.median(h_t)
        rows.append((f"decode batch {b} (ms/step)", 1e3 * o, 1e3 * h, h / o, "speedup, target >= 1.0"
                     if b > 1 else "speedup"))
    assert engine.num_free_blocks == engine.num_blocks

    print(f"\nSmolLM2-135M fp32, CPU, {args.threads} threads, {args.rounds} rounds (median), "
          f"decode prompts {PROMPT_FOR_DECODE} tok, {args.decode_steps} steps")
    print(f"{'measure':28} {'pdserve':>10} {'transformers':>13} {'ratio':>7}  meaning")
    for name, ours, theirs, ratio, meaning in rows:
        print(f"{name:28} {ours:10.1f} {theirs:13.1f} {ratio:7.2f}  {meaning}")


if __name__ == "__main__":
    main()
