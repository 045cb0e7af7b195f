"""Structured output: what a sequence's tokens must spell (a JSON schema, any JSON object, a
regular expression, one of several strings, an EBNF grammar), enforced by masking, before each
choice, every token that would leave the grammar — with xgrammar, measured the fastest of
three libraries on this vocabulary (`python -m bench.engine.grammar_libs`).

    grammars = Grammars(token_table(tokenizer, vocab_size), eos_ids)   # one per engine
    pending = grammars.submit(Grammar("json_schema", schema_text))    # one per sequence: compiles on
    if pending.ready() or pending.overdue():                          # the pool, off the engine thread
        matcher = pending.matcher(generated_before)                   # GrammarError: failed or overdue
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
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
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


def library() -> None:
    """Load the grammar library: seconds of CPU the first time (xgrammar imports torch), nothing after."""
    import xgrammar  # noqa: F401


def library_loaded() -> bool:
    return "xgrammar" in sys.modules


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
    """Where one sequence is in its grammar; `draft`: the tokens its pass's rows after the first
    assume (speculative.py), each row masked as the grammar stands after the draft before it."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        import xgrammar as xgr
        self._m = xgr.GrammarMatcher(compiled)
        self.draft: list[int] = []

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` (B, ceil(vocab/32)) int32: bit t set where token t may come next."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def fill_rows(self, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Rows `rows` (the sequence's row, then its draft's) as `fill` sets them, row j after the
        draft's first j tokens; the state is the same after as before."""
        for j, row in enumerate(rows):
            self.fill(bitmask, row)
            if j + 1 < len(rows) and not self._m.accept_token(self.draft[j]):
                if j:
                    self._m.rollback(j)  # (the state as before, the error raised)
                raise ValueError(f"draft token {self.draft[j]} leaves the grammar (cut it first: allows)")
        if len(rows) > 1:
            self._m.rollback(len(rows) - 1)

    def allows(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar takes from here short of its end (a draft
        stops before the stop token: no row is masked past it); the state is unchanged."""
        n = 0
        while n < len(tokens) and self._m.accept_token(tokens[n]):
            n += 1
            if self._m.is_terminated():
                n -= 1
                self._m.rollback(1)
                break
        if n:
            self._m.rollback(n)
        return n

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) where the grammar does not allow it."""
        return self._m.accept_token(token)


class Grammars:
    """Compiles grammars against one vocabulary on a pool of `threads` (the bound on compiles
    at once; xgrammar releases the GIL while it compiles), the last KEPT kept, and makes matchers.
    A tenant starts at most `per_tenant` compiles at once: its others wait for them, out of the
    pool's queue, so a flood of distinct grammars from one key delays another's by that many."""

    KEPT = 256

    def __init__(self, token_bytes: list[bytes], eos_ids: tuple[int, ...], threads: int = 2,
                 timeout_s: float = 30.0, per_tenant: int = 2):
        """`token_bytes`: each token's bytes, empty for control tokens (never text). `timeout_s`:
        a grammar not compiled this long after it was asked for fails its request."""
        import xgrammar as xgr
        self.vocab_size, self.timeout_s, self.per_tenant = len(token_bytes), timeout_s, per_tenant
        info = xgr.TokenizerInfo(token_bytes, xgr.VocabType.RAW, vocab_size=len(token_bytes),
                                 stop_token_ids=list(eos_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._futures: OrderedDict[Grammar, Future] = OrderedDict()  # the last KEPT asked for (one thread's)
        self._started: dict[str, list[Future]] = {}  # each tenant's compiles started and not done

    def _compile(self, grammar: Grammar) -> xgr.CompiledGrammar:
        try:
            return self._compiler.compile_grammar(_parse(grammar))
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{grammar.kind}: {_reason(e)}") from e

    def future(self, grammar: Grammar, tenant: str | None = None) -> Future | None:
        """`grammar`'s compile: the one asked for before (done, running or queued), else a new one,
        unless `tenant` has `per_tenant` compiles going already (None: ask again later)."""
        fut = self._futures.pop(grammar, None)
        if fut is None or fut.cancelled():
            if tenant is not None and not self._room(tenant):
                return None
            fut = self._pool.submit(self._compile, grammar)
            if tenant is not None:
                self._started.setdefault(tenant, []).append(fut)
        self._futures[grammar] = fut
        while len(self._futures) > self.KEPT:
            self._futures.popitem(last=False)
        return fut

    def _room(self, tenant: str) -> bool:
        self._started = {t: going for t, fs in self._started.items() if (going := [f for f in fs if not f.done()])}
        return len(self._started.get(tenant, ())) < self.per_tenant

    def submit(self, grammar: Grammar, tenant: str = "") -> Pending:
        """`grammar` compiling on the pool (or once `tenant` has room), due within `timeout_s` from now."""
        return Pending(self, grammar, tenant, time.monotonic() + self.timeout_s)

    def matcher(self, grammar: Grammar) -> Matcher:
        """A matcher at the start of `grammar`, waiting for its compile (tests, tools)."""
        fut = self.future(grammar)
        assert fut is not None  # (no tenant: never deferred)
        return Matcher(fut.result())


class Pending:
    """One sequence's grammar while it compiles: ready, failed, or past its deadline."""

    def __init__(self, grammars: Grammars, grammar: Grammar, tenant: str, deadline: float):
        self.grammars, self.grammar, self.tenant, self.deadline = grammars, grammar, tenant, deadline
        self.fut = grammars.future(grammar, tenant)  # None: waiting for the tenant's room

    def ready(self) -> bool:
        """Compiled, or failed to (a compile another sequence abandoned is asked for again)."""
        if self.fut is None or self.fut.cancelled():
            self.fut = self.grammars.future(self.grammar, self.tenant)
        return self.fut is not None and self.fut.done()

    def overdue(self) -> bool:
        return not self.ready() and time.monotonic() > self.deadline

    def matcher(self, generated: Iterable[int] = ()) -> Matcher:
        """A matcher that has accepted `generated` (the tokens generated before: a failover's, an
        import's first token). Raises GrammarError: the compile failed, is not done (past its
        deadline: it is abandoned), or a token leaves the grammar."""
        if not self.ready():
            self.abandon()
            raise GrammarError(f"{self.grammar.kind}: not compiled within {self.grammars.timeout_s:g} s")
        assert self.fut is not None  # (ready)
        try:
            matcher = Matcher(self.fut.result())
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the compiler raised ends this request only
            raise GrammarError(f"{self.grammar.kind}: {_reason(e)}") from e
        if not all(matcher.accept(t) for t in generated):
            raise GrammarError("the tokens generated before leave the grammar")
        return matcher

    def abandon(self) -> None:
        """Nobody here waits for it any more: dropped if it has not started (a sequence that
        shares it asks for it again)."""
        if self.fut is not None:
            self.fut.cancel()


def wait_any(pending: Iterable[Pending], timeout_s: float) -> None:
    """Until one of `pending` is done, at most `timeout_s` (the engine with nothing else to compute)."""
    futures = [p.fut for p in pending if p.fut is not None]
    if futures:
        wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
    else:  # (each waits for its tenant's room: compiles none of them holds)
        time.sleep(timeout_s)


def token_table(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each of the model's `vocab_size` token ids' bytes; added and control tokens (and ids past
    the tokenizer's) empty, so no grammar spells text with them."""
    added = set(tokenizer.tok.get_added_tokens_decoder())
    return [b"" if i in added else tokenizer.token_bytes(i) for i in range(vocab_size)]


def mask_rows(logits: torch.Tensor, matchers: dict[int, Matcher]) -> None:
    """Set to -inf, in place, each logit of row r (of logits (B, vocab)) that would leave
    matchers[r]'s grammar (consecutive rows of one matcher: its token's, then its draft's).

    On the CPU the bitmask is unpacked with numpy and the rows written with one masked copy:
    about 4x faster than xgrammar's CPU kernel on mostly-masked rows of this vocabulary (0.3
    against 1.1-1.6 ms at batch 8 on this machine); elsewhere, xgrammar's kernel."""
    import torch
    import xgrammar as xgr
    rows, vocab = list(matchers), logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    runs: list[list[int]] = []  # a sequence's rows are one run: its token's row, then its draft's (one matcher)
    for row in rows:
        if runs and row == runs[-1][-1] + 1 and matchers[row] is matchers[runs[-1][0]]:
            runs[-1].append(row)
        else:
            runs.append([row])
    for run in runs:
        matchers[run[0]].fill_rows(bitmask, run)
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
