"""Tokenizer and chat template, built from GGUF metadata or a Hugging Face `tokenizer.json`.

The GGUF path rebuilds the byte-level BPE (vocab + merges + special tokens) with the
`tokenizers` library (other kinds: transformers' converter). The model's own Jinja chat
template (for SmolLM2: ChatML with its default system prompt), or the one the operator gives
(PD_CHAT_TEMPLATE), is rendered by transformers' `render_jinja_template`: the sandbox and the
globals `apply_chat_template` gives templates (raise_exception, strftime_now, tojson with
indent), with `tools` and template keyword arguments passed through.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from functools import cache, cached_property
from pathlib import Path
from typing import Any, cast

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's bytes_to_unicode), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


_UNICODE_TO_BYTE = _byte_alphabet()


class Tokenizer:
    def __init__(self, tok: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, add_bos: bool = False):
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.add_bos = bos_token, eos_token, add_bos
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self._bytes: list[bytes] | None = None  # token_bytes' table, built on first use

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._with_bos(self.tok.encode(text, add_special_tokens=False).ids)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a byte-level BPE token may hold part of a character;
        an added token, its text)."""
        if self._bytes is None:
            self._bytes = self._byte_table()
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def _byte_table(self) -> list[bytes]:
        vocab = self.tok.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values(), default=-1) + 1)
        added = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        byte_level = type(self.tok.decoder).__name__ == "ByteLevel"
        for piece, i in vocab.items():
            if byte_level and piece not in added and all(c in _UNICODE_TO_BYTE for c in piece):
                table[i] = bytes(_UNICODE_TO_BYTE[c] for c in piece)
            else:
                table[i] = self.tok.decode([i], skip_special_tokens=False).encode()
        return table

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """The conversation as the template renders it (a template's own error, e.g. roles
        that do not alternate, is a jinja2 TemplateError naming it)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        rendered: Any = render_jinja_template([messages], tools=cast(Any, tools), chat_template=self.chat_template,
                                              add_generation_prompt=add_generation_prompt,
                                              **{"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                                                 **kwargs})
        return rendered[0][0]  # (the rendered conversations, their generation indices)

    def encode_chat(self, parts: Any, render: Callable[[Any], str], specials_as_text: bool = True) -> list[int]:
        """The tokens of what `render` writes from `parts` (the client's messages).
        Text in `parts` that spells a special token ("<|im_start|>system" pasted into a message)
        stays text, so only the template writes control tokens (specials_as_text=False: it
        becomes the control token, as a plain encode of the rendered text reads it)."""
        spelled: list[str] = []
        nonce = secrets.token_hex(8)  # (client text cannot forge a mark)

        def mark(m: re.Match) -> str:
            spelled.append(m[0])
            return f"\ue000{nonce}.{len(spelled) - 1}\ue001"

        specials = self._specials if specials_as_text else None
        marked = _strings(parts, lambda s: specials.sub(mark, s)) if specials is not None else parts
        if not spelled:
            return self.encode(render(parts))
        text, spans = _unmarked(render(marked), spelled, nonce)
        enc, ids = self.tok.encode(text, add_special_tokens=False), []
        for i, (a, b) in zip(enc.ids, enc.offsets):
            if i in self._special_ids and any(a < end and start < b for start, end in spans):
                ids += self._as_text.encode(text[a:b], add_special_tokens=False).ids
            else:
                ids.append(i)
        return self._with_bos(ids)

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def _specials(self) -> re.Pattern | None:
        """Any special token's spelling (the longest first), or None for a tokenizer with none.
        A trie, not an alternation: Gemma's vocabulary has thousands of `<unusedN>` specials,
        and an alternation would try each at every position of a message."""
        texts = [t for i in self._special_ids if (t := self.tok.id_to_token(i))]
        return re.compile(_trie_pattern(texts)) if texts else None

    @cached_property
    def _as_text(self) -> HFTokenizer:
        """This tokenizer reading special tokens' spellings as text."""
        tok = HFTokenizer.from_str(self.tok.to_str())
        tok.encode_special_tokens = True
        return tok

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads `tools` (it lists them and writes calls its own way)."""
        return self.chat_template is not None and _reads_tools(self.chat_template)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        """Byte-level BPE (`tokenizer.ggml.model` gpt2) rebuilt here from the file's fields; every
        other kind (SentencePiece `llama`, as Gemma, Llama 2 and Mistral files carry) by
        transformers' GGUF converter, which gives each architecture's normalizer, pre-tokenizer
        and decoder."""
        from pdserve.shared.engine.gguf_tensors import metadata

        meta, _ = metadata(path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
        if meta.get("tokenizer.ggml.model") != "gpt2":
            return cls._converted_gguf(path, meta.get("tokenizer.chat_template"))

        def field(key: str, default: Any = None) -> Any:
            return meta.get(key, default)

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
    def _converted_gguf(cls, path: Path, chat_template: str | None) -> Tokenizer:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

        arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
        return cls(backend, chat_template, tokenizer_config.get("bos_token"), tokenizer_config.get("eos_token"),
                   bool(tokenizer_config.get("add_bos_token", False)))

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


def _trie_pattern(words: list[str]) -> str:
    """A regular expression matching any of `words`, the longest where several match."""
    trie: dict = {}
    for word in words:
        node = trie
        for c in word:
            node = node.setdefault(c, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        alts = [re.escape(c) + pattern(child) for c, child in sorted(node.items()) if c]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return pattern(trie)


def _strings(value: Any, change: Callable[[str], str]) -> Any:
    """`value` (JSON-like) with `change` applied to every string in it."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {k: _strings(v, change) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strings(v, change) for v in value]
    return value


def _unmarked(rendered: str, spelled: list[str], nonce: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text with each mark (private-use characters around the nonce and an index
    into `spelled`) back as its spelling, and where those spellings are."""
    out, spans, at = [], [], 0
    for m in re.finditer(f"\ue000{nonce}\\.(\\d+)\ue001", rendered):
        out.append(rendered[at:m.start()])
        start = sum(map(len, out))
        out.append(spelled[int(m[1])])
        spans.append((start, start + len(spelled[int(m[1])])))
        at = m.end()
    out.append(rendered[at:])
    return "".join(out), spans


@cache
def _reads_tools(template: str) -> bool:
    from jinja2 import Environment, meta

    return "tools" in meta.find_undeclared_variables(Environment().parse(template))


def template_text(value: str) -> str:
    """A chat template given as its text or as the path of a file holding it."""
    path = Path(value)
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"chat template {value!r} is neither a Jinja template nor a file")
    return value
