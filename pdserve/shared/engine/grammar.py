"""Structured output: what a sequence's tokens must spell (a JSON schema, any JSON object, a
regular expression, one of several strings, an EBNF grammar), enforced by masking, before each
choice, every token that would leave the grammar — with xgrammar, measured the fastest of
three libraries on this vocabulary (`python -m bench.engine.grammar_libs`).

    grammars = Grammars(token_table(tokenizer, vocab_size), eos_ids)   # one per engine
    matcher = grammars.matcher(Grammar("json_schema", schema_text))   # one per sequence
    mask_rows(logits, {row: matcher})     # before the choice: tokens that leave it set to -inf
    matcher.accept(token)                 # after it

A matcher's state is a function of the tokens it accepted, so the decode side rebuilds it
from the tokens generated before (the first token, or a failover's), and the first token
obeys the grammar on the prefill side as every later one does on the decode side.

JSON is generated compact and in the schema's property order (", " and ": " separators, no
other whitespace): a small model given free whitespace may spend its tokens on newlines.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:  # imported where first used: each costs a second or two at import, and most
    import torch  # processes importing this module (the router, a gateway's messages) never match
    import xgrammar as xgr

    from pdserve.shared.engine.tokenizer import Tokenizer

class GrammarError(ValueError):
    """The grammar cannot be compiled (the message says where)."""


@dataclass(frozen=True)
class Grammar:
    kind: Literal["json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag"]
    # json_schema: the schema's JSON text; regex; choice: a JSON list of strings; ebnf;
    # structural_tag: xgrammar's structural tag as JSON (free text with tagged parts: tool calls)
    spec: str = ""


def check(grammar: Grammar) -> None:
    """Raise GrammarError if `grammar` does not parse (no vocabulary needed: a gateway's check)."""
    try:
        _parse(grammar)
    except Exception as e:  # noqa: BLE001 - whatever the parser raises, the input was at fault
        raise GrammarError(_reason(e)) from e


def _reason(e: Exception) -> str:
    """The library's message without its log prefix ("[hh:mm:ss] file.cc:83: Check failed: ...")."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return re.sub(r"^Check failed: .*? is false: ", "", text)[:300]


def _parse(grammar: Grammar) -> xgr.Grammar:
    import xgrammar as xgr
    if grammar.kind in ("json_schema", "json_object"):
        schema = grammar.spec if grammar.kind == "json_schema" else '{"type": "object"}'
        return _json_strings(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    if grammar.kind == "regex":
        return xgr.Grammar.from_regex(grammar.spec)
    if grammar.kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(grammar.spec)))
    if grammar.kind == "ebnf":
        return xgr.Grammar.from_ebnf(grammar.spec)
    if grammar.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(json.dumps(_compact(json.loads(grammar.spec))))
    raise GrammarError(f"unknown grammar kind {grammar.kind!r}")


# JSON strings' characters, as xgrammar 0.2.8 writes them: with minLength/maxLength it leaves
# control characters in (JSON forbids them raw in a string: a tab, say), and neither class
# leaves out the UTF-16 surrogates (three bytes that are no UTF-8 text)
_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_CHARS = r'[^\0-\x1f\"\\\r\n\ud800-\udfff]'


def _json_strings(g: xgr.Grammar) -> xgr.Grammar:
    """`g` with every JSON string character class made JSON's: no control characters, no surrogates."""
    import xgrammar as xgr
    ebnf = str(g)
    for chars in _STRING_CHARS:
        ebnf = ebnf.replace(chars, _JSON_CHARS)
    return xgr.Grammar.from_ebnf(ebnf)


def _compact(part: Any) -> Any:
    """A structural tag with each JSON schema part made this module's compact JSON grammar."""
    if isinstance(part, dict) and part.get("type") == "json_schema" and "json_schema" in part:
        return {"type": "grammar", "grammar": str(_parse(Grammar("json_schema", json.dumps(part["json_schema"]))))}
    if isinstance(part, dict):
        return {k: _compact(v) for k, v in part.items()}
    return [_compact(v) for v in part] if isinstance(part, list) else part


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ...: exactly one of the strings (JSON's escapes are EBNF's)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choices are one or more non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class Matcher:
    """Where one sequence is in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        import xgrammar as xgr
        self._m = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` (B, ceil(vocab/32)) int32: bit t set where token t may come next."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) where the grammar does not allow it."""
        return self._m.accept_token(token)


class Grammars:
    """Compiles grammars against one vocabulary (the last 256 kept) and makes matchers."""

    def __init__(self, token_bytes: list[bytes], eos_ids: tuple[int, ...]):
        """`token_bytes`: each token's bytes, empty for control tokens (never text)."""
        import xgrammar as xgr
        self.vocab_size = len(token_bytes)
        info = xgr.TokenizerInfo(token_bytes, xgr.VocabType.RAW, vocab_size=len(token_bytes),
                                 stop_token_ids=list(eos_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.compile = lru_cache(maxsize=256)(self._compile)

    def _compile(self, grammar: Grammar) -> xgr.CompiledGrammar:
        try:
            return self._compiler.compile_grammar(_parse(grammar))
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{grammar.kind}: {_reason(e)}") from e

    def matcher(self, grammar: Grammar) -> Matcher:
        return Matcher(self.compile(grammar))



def token_table(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each of the model's `vocab_size` token ids' bytes; added and control tokens (and ids past
    the tokenizer's) empty, so no grammar spells text with them."""
    added = set(tokenizer.tok.get_added_tokens_decoder())
    return [b"" if i in added else tokenizer.token_bytes(i) for i in range(vocab_size)]


def mask_rows(logits: torch.Tensor, matchers: dict[int, Matcher]) -> None:
    """Set to -inf, in place, each logit of row r (of logits (B, vocab)) that would leave
    matchers[r]'s grammar.

    On the CPU the bitmask is unpacked with numpy and the rows written with one masked copy:
    about 4x faster than xgrammar's CPU kernel on mostly-masked rows of this vocabulary (0.3
    against 1.1-1.6 ms at batch 8 on this machine); elsewhere, xgrammar's kernel."""
    import torch
    import xgrammar as xgr
    rows, vocab = list(matchers), logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    for row, m in matchers.items():
        m.fill(bitmask, row)
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or sys.byteorder != "little":
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        return
    allowed = np.unpackbits(bitmask[rows].numpy().view(np.uint8), axis=-1, bitorder="little", count=vocab).view(bool)
    if rows == list(range(logits.shape[0])) and logits.is_contiguous():
        np.copyto(logits.numpy(), _NEG, where=~allowed)
    else:
        part = logits[rows].contiguous()
        np.copyto(part.numpy(), _NEG, where=~allowed)
        logits[rows] = part


_NEG = np.float32(-np.inf)
