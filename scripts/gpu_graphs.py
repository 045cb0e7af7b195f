"""The decode step with and without CUDA graphs (scripts/gpu_check.py, CUDA only): the first shape's saved
weights, the Triton kernels, batch 1, 8 and 32 at the check's context, each timed eagerly and replayed as graphs
(pdserve/shared/engine/cuda_graphs.py), and the greedy tokens of a batch of 8 both ways.

A graph's block tables are as wide as the longest context, an eager pass's as its longest sequence, so the
split-KV attention may cut the contexts differently: the sums differ in their last bits, and with random
weights' flat distributions a near tie may go either way. The check asks for 3 of 4 tokens equal (a broken
replay agrees with nothing) and records the count.

Imports torch and the engine only (no pydantic, no deploy/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import gpu_models

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import LoadedModel, load
from pdserve.shared.engine.sequence import SamplingParams

BATCHES = [1, 8, 32]
AGREE = 0.75


def greedy(loaded: LoadedModel, cfg: EngineConfig, prompts: list[list[int]]) -> tuple[list[list[int]], Engine]:
    engine = Engine(loaded, cfg)
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=gpu_models.NEW, temperature=0, ignore_eos=True))
    outs = gpu_models.drain(engine)
    return [[t for o in outs[f"g{i}"] for t in o.new_token_ids] for i in range(len(prompts))], engine


def run(root: Path, base: EngineConfig, timing: dict, check: Callable[..., None]) -> dict:
    name = next(iter(gpu_models.SHAPES))
    loaded = load(str(root / name), dtype=base.torch_dtype, device=base.device)
    cfg = replace(base, kernels="triton", max_num_seqs=max(BATCHES))
    out: dict = {"model": name, "batches": BATCHES, "context": timing["context"]}
    prompts = gpu_models.prompts(8, 64, loaded.config.vocab_size, gpu_models.SEED + 3)
    eager, _ = greedy(loaded, replace(cfg, cuda_graphs=False), prompts)
    replayed, engine = greedy(loaded, replace(cfg, cuda_graphs=True), prompts)
    graphs = engine.runner.graphs
    check(f"{name}: decode passes replayed as CUDA graphs", graphs is not None and bool(graphs.graphs),
          (graphs.off or "") if graphs is not None else "no graphs made")
    pairs = [(a, b) for x, y in zip(eager, replayed) for a, b in zip(x, y)]
    same = sum(a == b for a, b in pairs)
    check(f"{name}: greedy tokens with graphs equal the eager ones (batch 8)", same >= AGREE * len(pairs),
          f"{same}/{len(pairs)} equal")
    out["tokens_equal"] = f"{same}/{len(pairs)}"
    gpu_models.free(base.device)
    for graphs_on in (False, True):
        print(f"    {name}, CUDA graphs {'on' if graphs_on else 'off'}:")
        steps = gpu_models.decode_steps(loaded, replace(cfg, cuda_graphs=graphs_on), BATCHES, timing["context"],
                                        timing["steps"], timing["gbps"])["steps"]
        out["graphs" if graphs_on else "eager"] = {row["batch"]: round(row["step_ms"], 3) for row in steps}
        gpu_models.free(base.device)
    out["eager_over_graphs"] = {b: round(out["eager"][b] / out["graphs"][b], 2) for b in BATCHES}
    return out
