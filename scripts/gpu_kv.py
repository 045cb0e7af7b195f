"""The KV path on one GPU, part of `make gpu-check` (scripts/gpu_check.py): device→host of
streamed layers and host→device of received blocks through the engine's KV stream
(pdserve/shared/engine/kv_copies.py) against pinned cudaMemcpy, and the exposed part of a 2k-token
prefill's KV reaching the host (SmolLM2 takes at most 2,047 tokens: 2k stands for the long
prompt).

Not yet run on a GPU: the first run on a CUDA machine (`make gpu-check`) is its test."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.kv_io import KVPiece
from pdserve.shared.engine.loader import LoadedModel
from pdserve.shared.engine.sequence import SamplingParams

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _gbps(nbytes: int, fn: Callable[[], object], reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - start) / 1e9


def memcpy_gbps(nbytes: int = 256 << 20) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    return {"d2h_pinned_gbps": _gbps(nbytes, lambda: pinned.copy_(dev, non_blocking=True)),
            "h2d_pinned_gbps": _gbps(nbytes, lambda: dev.copy_(pinned, non_blocking=True)),
            "h2d_pageable_gbps": _gbps(nbytes, lambda: dev.copy_(pageable))}


def _prefill(engine: Engine, rid: str, prompt: list[int], sink: Callable[[KVPiece], None] | None = None
             ) -> tuple[int, float]:
    """The prompt's prefill; returns its first token and when its last pass returned."""
    engine.add_request(rid, prompt, PARAMS, prefill_only=True)
    if sink is not None:
        engine.stream_kv(rid, 0, sink)
    while not (outs := engine.step()):
        pass
    return outs[0].new_token_ids[0], time.perf_counter()


def _run(engine: Engine) -> list[int]:
    out = []
    while engine.has_work():  # (the passes of a chunked prefill return no tokens)
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


def kv_path(loaded: LoadedModel, prompt: list[int], check: Callable[..., None], rounds: int = 5) -> dict:
    src = Engine(loaded, EngineConfig(num_blocks=4096, device="cuda", enable_prefix_cache=False))
    alone, streamed, after = [], [], []
    pieces: list[KVPiece] = []
    for i in range(rounds + 1):  # round 0 warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _prefill(src, f"alone-{i}", prompt)
        torch.cuda.synchronize()
        alone_s = time.perf_counter() - t0
        src.free(f"alone-{i}")
        pieces = []
        t0 = time.perf_counter()
        first, computed = _prefill(src, f"kv-{i}", prompt, pieces.append)
        ready = pieces[-1].ready
        assert ready is not None  # (on CUDA: an event)
        ready.synchronize()  # (recorded in order on the KV stream)
        landed = time.perf_counter()
        if i:
            alone.append(alone_s)
            streamed.append(landed - t0)
            after.append(landed - computed)
        if i < rounds:
            src.free(f"kv-{i}")
    on_host = all(p.data.device.type == "cpu" and p.data.is_pinned() for p in pieces)
    check("streamed KV pieces land in pinned host memory", on_host, f"{len(pieces)} pieces")

    # host -> device: the pieces as the decode side gets them (pageable staging bytes) into a
    # reservation through write_kv, then the import continues exactly
    rid = f"kv-{rounds}"
    dst = Engine(loaded, EngineConfig(num_blocks=4096, device="cuda", enable_prefix_cache=False))
    res = dst.reserve(rid, prompt, PARAMS)
    staged = [(p, np.array(p.data.reshape(p.num_blocks, -1).view(torch.uint8).numpy())) for p in pieces]
    nbytes = sum(b.nbytes for _, b in staged)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for p, rows in staged:
        start = p.first_block - res.first_block
        dst.write_kv(p.layer, list(res.block_ids[start:start + p.num_blocks]), torch.from_numpy(rows))
    dst.handoff.join()
    torch.cuda.synchronize()
    h2d_s = time.perf_counter() - t0
    ref = Engine(loaded, EngineConfig(num_blocks=4096, device="cuda"))
    ref.add_request("ref", prompt, PARAMS)
    whole = _run(ref)
    out = dst.commit_import(rid, first).new_token_ids + _run(dst)
    check("KV streamed to the host and written back continues exactly", out == whole,
          f"{sum(a == b for a, b in zip(out, whole))}/{len(whole)} tokens equal")

    # device -> host of the same blocks through the KV stream, outside a pass
    ids = list(src.seqs[rid].block_table)

    def d2h() -> None:
        for layer in range(src.model_config.num_layers):
            src.handoff.copies.to_host(src.handoff.view(layer, ids), None)
    d2h_gbps = _gbps(nbytes, d2h, reps=5)
    src.free(rid)
    per_round = [(s - a) / a for a, s in zip(alone, streamed)]
    return {"prompt_tokens": len(prompt), "kv_bytes": nbytes, "rounds": rounds,
            "prefill_s": statistics.median(alone), "prefill_and_kv_on_host_s": statistics.median(streamed),
            "kv_on_host_after_prefill_s": statistics.median(after), "exposed_per_round": per_round,
            "exposed_transfer_fraction_2k": statistics.median(per_round),
            "kv_d2h_gbps": d2h_gbps, "kv_h2d_gbps": nbytes / h2d_s}
