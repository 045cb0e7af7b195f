"""Small drivers for engine tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine, RequestOutput
from pdserve.shared.engine.kernels import blocks
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.hashing import block_hashes

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block transformers reads each GGUF file's parts once, with what it computes
    from them unchanged. It parses a file whole (every vocabulary entry an object) for a model's
    config, again for its weights and again for a tokenizer, and turns every metadata field into
    Python values each time: seconds each for SmolLM2's vocabulary, more for Gemma 3's 262k
    entries; and it builds gguf-py's tensor-name map of the architecture once per submodule (~400
    times for a model). Here gguf-py's reader is made once per file (handed back read-only), the
    metadata-only reading (`return_tensors=False`) is kept per file and handed back as a copy, and
    the name map is made once per (architecture, layers): each a pure function of its arguments.
    The reader parses the file as a plain array over its memory map, not an `np.memmap`: the
    same bytes, without numpy's memmap bookkeeping on each of the parse's million small slices
    (Gemma 3's file: 12.5 s to 3.5 s)."""
    import copy

    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    class Reader(gguf.GGUFReader):
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._data = mapped.view(np.ndarray)

    made, readers = gguf.GGUFReader, {}
    name_map, maps = gguf.get_tensor_name_map, {}
    checkpoint, metadata = hf_gguf.load_gguf_checkpoint, {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = Reader(path, mode)
        return readers[key]

    def tensor_name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)
        return maps[arch, n_blocks]

    def load_checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return checkpoint(path, return_tensors, **kwargs)
        if str(path) not in metadata:
            metadata[str(path)] = checkpoint(path, False)
        return copy.deepcopy(metadata[str(path)])

    gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = reader, tensor_name_map, load_checkpoint
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = made, name_map, checkpoint


def run_all(engine: Engine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until idle; outputs grouped by request id."""
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def generate(loaded, prompts: dict[str, list[int]], params: SamplingParams = GREEDY,
             engine: Engine | None = None, **cfg) -> dict[str, list[int]]:
    """Run prompts together in an engine (a fresh one by default); generated ids per request."""
    engine = engine or Engine(loaded, EngineConfig(**{"num_blocks": 512, **cfg}))
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    outs = run_all(engine)
    assert engine.num_free_blocks == engine.num_blocks
    return {rid: tokens(outs[rid]) for rid in prompts}


def transfer(src: Engine, dst: Engine, rid: str, prompt: list[int], params: SamplingParams,
             generated: list[int] | tuple[()] = (), crashes: int = 0) -> RequestOutput:
    """Disaggregated path in one process: prefill on src, KV moved layer by layer to dst
    (`generated`: a failover's tokens streamed before it, prefilled with the prompt; `crashes`:
    charged to the request, on both sides)."""
    reservation = dst.reserve(rid, prompt, params, generated)
    src.add_request(rid, prompt, params, prefill_only=True, generated_token_ids=generated, crashes=crashes)
    first = None
    while first is None:
        first = next((o for o in src.step() if o.request_id == rid), None)
    export = src.export_kv(rid, first_block=reservation.first_block)
    assert export.num_blocks == reservation.num_blocks - reservation.first_block
    assert export.block_hashes == block_hashes([*prompt, *generated], src.cfg.block_size, params.cache_salt)
    for layer in range(export.num_layers):
        dst.import_layer(rid, layer, export.layer_bytes(layer), reservation.first_block)
    src.free(rid)
    out = dst.commit_import(rid, first.new_token_ids[0], crashes=crashes)
    out.text = first.text
    return out


def pass_logits(loaded, prompts: dict[str, list[int]]) -> list[dict[str, torch.Tensor]]:
    """Each pass's next-token logits by request, in a greedy run of `prompts` together."""
    engine = Engine(loaded, EngineConfig(num_blocks=256, max_batched_tokens=2048, prefill_chunk=2048))
    passes, run = [], engine.runner.run

    def capture(sched, hook=None):
        logits = run(sched, hook)
        due = [s.request_id for s, _ in sched.chunks[:sched.num_decode]] + [
            s.request_id for s, n in sched.chunks[sched.num_decode:] if s.num_computed + n == len(s.token_ids)]
        passes.append({rid: row.clone() for rid, row in zip(due, logits)})
        return logits

    engine.runner.run = capture
    for name, ids in prompts.items():
        engine.add_request(name, ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    run_all(engine)
    return passes


# where each block format's fp16 scales are (d, then the minimum or dmin where it has one)
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random rows of `kind`'s blocks (GGUF's layout): every byte random (so every bit of the
    values, scales and high bits is exercised) but the fp16 scales, set to sane magnitudes
    (d > 0, minima < 0; `scale` times the defaults)."""
    per, size = blocks.BLOCKS[kind]
    b = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for i, at in enumerate(_HALVES[kind]):
        s = scale * (0.02 if per == 256 else 0.1) * (1 if i == 0 else -5)
        b[..., at:at + 2] = (rng.random((rows, cols // per, 1)) * s).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)
