"""Tokenizer and chat template, built from GGUF metadata or a Hugging Face `tokenizer.json`.

The GGUF path rebuilds the byte-level BPE (vocab + merges + special tokens) with the
`tokenizers` library and renders the model's own Jinja chat template (for SmolLM2: ChatML
with its default system prompt) in a sandbox, as Hugging Face does.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types


class Tokenizer:
    def __init__(self, tok: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, add_bos: bool = False):
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.add_bos = bos_token, eos_token, add_bos
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(chat_template)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use the completions API")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader) -> Tokenizer:
        def field(key, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        if field("tokenizer.ggml.model") != "gpt2":
            raise ValueError("only byte-level BPE (gpt2-style) GGUF tokenizers are supported")
        tokens = field("tokenizer.ggml.tokens")
        types = field("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                     ignore_merges=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if field("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):
            # these pre-tokenizers split numbers into single digits before the GPT-2 regex
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        tok.add_tokens([AddedToken(t, special=types[i] == _CONTROL, normalized=False)
                        for i, t in enumerate(tokens) if types[i] in (_CONTROL, _USER_DEFINED)])
        name = lambda key: None if field(key) is None else tokens[field(key)]  # noqa: E731
        return cls(tok, field("tokenizer.chat_template"), name("tokenizer.ggml.bos_token_id"),
                   name("tokenizer.ggml.eos_token_id"), bool(field("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        token = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
        template_file = path / "chat_template.jinja"  # newer layout: the template on its own
        template = template_file.read_text() if template_file.exists() else cfg.get("chat_template")
        return cls(tok, template, token(cfg.get("bos_token")),
                   token(cfg.get("eos_token")), bool(cfg.get("add_bos_token", False)))


def _raise(message: str):
    raise TemplateError(message)
