"""Model architecture and engine settings (plain dataclasses: no I/O, no environment)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where a dtype is made: a gateway reads a ModelConfig without it)
    import torch

from pdserve.shared.engine.rope import Rope


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: Llama and the architectures that differ from it in a few
    places (model.py, attention.py), each difference a field whose default is Llama's. Field names follow
    Hugging Face `config.json` semantics where it has one (loader.py maps each `model_type`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Rope = field(default_factory=Rope)
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    arch: str = "llama"                  # the checkpoint's model_type (what the loader mapped)
    qkv_bias: bool = False               # biases on q, k, v (Qwen2; attention_bias)
    o_bias: bool = False                 # and on the output projection (attention_bias)
    qk_norm: bool = False                # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    rotary_dim: int = 0                  # dimensions of a head RoPE rotates (0: all; Phi-3's partial_rotary_factor)
    activation: str = "silu"             # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    norm_plus_one: bool = False          # RMSNorm weights stored as offsets from 1, and the product in fp32 (Gemma)
    sandwich_norms: bool = False         # norms after attention and after the MLP too (Gemma 2/3)
    embed_scale: float = 1.0             # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    query_scale: float = 0.0             # attention's score scale (0: head_dim ** -0.5)
    attn_softcap: float = 0.0            # scores -> cap * tanh(scores / cap) (Gemma 2; 0: none)
    final_softcap: float = 0.0           # the same on the logits
    windows: tuple[int, ...] = ()        # per layer: a sliding window of this many tokens, 0 full (empty: all full)
    local_rope: Rope | None = None       # the sliding-window layers' RoPE, where it differs (Gemma 3)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError("windows: one per layer")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation {self.activation!r}: silu or gelu_tanh")

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens (0: it attends to the whole context)."""
        return self.windows[layer] if self.windows else 0

    @property
    def scale(self) -> float:
        return self.query_scale or self.head_dim ** -0.5

    @property
    def plain(self) -> bool:
        """Llama's layer exactly (what the C decode kernels compute)."""
        return (not (self.qkv_bias or self.o_bias or self.qk_norm or self.norm_plus_one or self.sandwich_norms
                     or self.attn_softcap or any(self.windows)) and self.activation == "silu"
                and self.rotary_dim in (0, self.head_dim) and self.query_scale in (0.0, self.head_dim ** -0.5))

    @property
    def fusable(self) -> bool:
        """Whether a decode pass's layers can run as one C call (kernels/fused.c): every layer
        here but biased projections and partial rotary."""
        return not (self.qkv_bias or self.o_bias) and self.rotary_dim in (0, self.head_dim)

    @classmethod
    def tiny(cls, vocab_size: int = 512) -> ModelConfig:
        """A few-layer random-weight model for fast unit tests (same code paths as the real one)."""
        return cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=3,
                   num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position=1024, eos_token_ids=(2,))


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a loaded model.

    The KV pool is sized either in blocks (`num_blocks`) or in GiB (`kv_cache_gib`); one of
    them must be set. `max_batched_tokens` bounds the tokens of one forward pass; a prompt
    longer than `prefill_chunk` is prefilled in chunks of that many tokens. `mixed_batches`:
    running sequences' decode tokens and prompt chunks share a pass (scheduler.py); off, the
    two kinds of pass alternate.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_gib: float | None = None
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    prefill_chunk: int = 512
    mixed_batches: bool = True
    enable_prefix_cache: bool = True
    device: str = "cpu"
    dtype: torch.dtype | None = None  # default: float32 on CPU, bfloat16 on CUDA
    kernels: str = "auto"  # auto | torch | triton | triton-unsplit | c (kernels/__init__.py)
    seed: int = 0  # for requests without a seed of their own
    pair_any_weights: bool = False  # the KV fingerprint leaves out the weights' format (loader.LoadedModel)
    grammar_compile_threads: int = 2  # grammars compiled at once, off the engine thread (grammar.py)
    grammar_compile_timeout_s: float = 30.0  # a request whose grammar is not compiled by then fails
    grammar_compiles_per_tenant: int = 2  # a tenant's compiles at once (its others wait for them)
    speculative_tokens: int = 0  # draft tokens per step for requests that name none (speculative.py; 0: off)
    cuda_graphs: bool | None = None  # decode passes replayed as CUDA graphs (cuda_graphs.py; None: PD_CUDA_GRAPHS, on)
    pass_target_ms: float = 0.0  # a pass with prompt tokens beside running streams aims at this (pass_time.py)

    def __post_init__(self) -> None:
        if (self.num_blocks is None) == (self.kv_cache_gib is None):
            raise ValueError("set exactly one of num_blocks and kv_cache_gib")
        if self.prefill_chunk < self.block_size or self.prefill_chunk > self.max_batched_tokens:
            raise ValueError("need block_size <= prefill_chunk <= max_batched_tokens")
        if self.kernels not in ("auto", "torch", "triton", "triton-unsplit", "c"):
            raise ValueError(f"unknown kernels backend {self.kernels!r}")
        if self.speculative_tokens < 0:
            raise ValueError("speculative_tokens must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32

    def block_bytes(self, model: ModelConfig) -> int:
        """One block of the pool: K and V for every layer of one block of tokens."""
        return 2 * model.num_layers * self.block_size * model.num_kv_heads * model.head_dim * self.torch_dtype.itemsize

    def blocks_for(self, model: ModelConfig) -> int:
        """Pool size in blocks."""
        if self.num_blocks is not None:
            return self.num_blocks
        assert self.kv_cache_gib is not None  # one of the two is set (checked when made)
        return max(1, int(self.kv_cache_gib * 2**30) // self.block_bytes(model))


# A worker's batching and KV pool where its settings name none, per device kind (a GPU's pool: the
# device's memory, `runner.blocks_in_memory`)
DEVICE_DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"kv_blocks": 2048, "max_num_seqs": 64, "max_batched_tokens": 2048, "prefill_chunk": 512},
    "cuda": {"max_num_seqs": 256, "max_batched_tokens": 8192, "prefill_chunk": 2048},
}
