"""Which grammar library masks SmolLM2's vocabulary fastest on this CPU: xgrammar, llguidance
and outlines-core side by side in one run, on the same JSON schemas and the same token walks.

    python -m bench.engine.grammar_libs [--rounds 5]

For each library and schema: the compile time (cold, then from the library's cache where it
has one), and the time to compute one token's mask (fill) and advance the matcher by the
chosen token (accept), over the tokens of a valid answer walked one at a time — the work a
decode step adds per constrained sequence. Writes bench/results/grammar-libs.json
(`summary`: each library's mean fill+accept per token in microseconds, and the pick).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from pdserve.shared.engine.grammar import token_table
from pdserve.shared.engine.loader import load

RESULTS = Path(__file__).parents[1] / "results"

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["name", "age", "email", "tags", "role"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
         "role": "admin"}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "integer"}, "paid": {"type": "boolean"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "note": {"type": "string"}},
        "required": ["id", "paid", "items", "note"], "additionalProperties": False},
        {"id": 4182, "paid": True, "items": [{"sku": "A-17", "qty": 2, "price": 9.5},
                                             {"sku": "B-3", "qty": 1, "price": 120.25}],
         "note": "Leave the parcel with the neighbour if nobody answers the door."}),
}


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo(token_table(tokenizer, vocab_size), xgr.VocabType.RAW,
                                 vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.mask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m) -> torch.Tensor:
        m.fill_next_token_bitmask(self.mask, 0)
        return self.mask

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        import llguidance
        import llguidance.torch
        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: str):
        compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=compact)

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled)

    def fill(self, m) -> torch.Tensor:
        self.llg.torch.fill_next_token_bitmask(m, self.mask, 0)
        return self.mask

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        from outlines_core import Vocabulary
        special = set(tokenizer.tok.get_added_tokens_decoder())
        pieces: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_table(tokenizer, vocab_size)):
            if i not in special and b:
                pieces.setdefault(b, []).append(i)
        self.vocab = Vocabulary(eos[0], pieces)
        from outlines_core.kernels import torch as kernels
        self.kernels = kernels
        self.mask = kernels.allocate_token_bitmask(vocab_size)

    def compile(self, schema: str):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema
        return Index(build_regex_from_schema(schema), self.vocab)

    def matcher(self, compiled):
        from outlines_core import Guide
        return Guide(compiled)

    def fill(self, m) -> torch.Tensor:
        self.kernels.fill_next_token_bitmask(m, self.mask)
        return self.mask

    def accept(self, m, token: int) -> bool:
        if token == self.vocab.get_eos_token_id():  # the end: allowed where the guide is finished
            return m.is_finished()
        m.advance(token)
        return True


def walk(lib, compiled, tokens: list[int]) -> tuple[list[float], list[float]]:
    """Fill and accept times (s) per token of a valid answer."""
    m, fills, accepts = lib.matcher(compiled), [], []
    for t in tokens:
        start = time.perf_counter()
        lib.fill(m)
        mid = time.perf_counter()
        if not lib.accept(m, t):
            raise RuntimeError(f"{lib.name} refused token {t} of a valid answer")
        fills.append(mid - start)
        accepts.append(time.perf_counter() - mid)
    return fills, accepts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load("smollm2")
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    assert tok is not None
    eos = list(loaded.config.eos_token_ids)
    results: dict[str, dict] = {}
    for cls in (Xgrammar, Llguidance, OutlinesCore):
        start = time.perf_counter()
        lib = cls(tok, vocab, eos)
        setup_s = time.perf_counter() - start
        row: dict = {"setup_s": round(setup_s, 3), "schemas": {}}
        for name, (schema, answer) in SCHEMAS.items():
            text = json.dumps(answer)  # the separators every library produces without flexible whitespace
            tokens = tok.encode(text) + eos[:1]
            start = time.perf_counter()
            compiled = lib.compile(json.dumps(schema))
            compile_s = time.perf_counter() - start
            fills, accepts = [], []
            for _ in range(args.rounds):
                f, a = walk(lib, compiled, tokens)
                fills += f
                accepts += a
            per_token = [f + a for f, a in zip(fills, accepts)]
            row["schemas"][name] = {
                "tokens": len(tokens), "compile_ms": round(compile_s * 1e3, 2),
                "fill_us_mean": round(statistics.mean(fills) * 1e6, 1),
                "fill_us_p99": round(sorted(fills)[int(0.99 * (len(fills) - 1))] * 1e6, 1),
                "accept_us_mean": round(statistics.mean(accepts) * 1e6, 1),
                "per_token_us_mean": round(statistics.mean(per_token) * 1e6, 1)}
            print(cls.name, name, row["schemas"][name], flush=True)
        row["per_token_us_mean"] = round(statistics.mean(s["per_token_us_mean"] for s in row["schemas"].values()), 1)
        row["compile_ms_mean"] = round(statistics.mean(s["compile_ms"] for s in row["schemas"].values()), 2)
        results[cls.name] = row
    logits = torch.randn(8, vocab)
    mask = torch.ones(8, (vocab + 31) // 32, dtype=torch.int32)
    import xgrammar as xgr
    start = time.perf_counter()
    for _ in range(100):
        xgr.apply_token_bitmask_inplace(logits, mask)
    apply_us = (time.perf_counter() - start) / 100 * 1e6
    pick = min(results, key=lambda k: results[k]["per_token_us_mean"])
    out = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": 1},
        "vocab_size": vocab, "rounds": args.rounds, "libraries": results,
        "apply_mask_b8_us": round(apply_us, 1),
        "summary": {**{f"{k}_per_token_us": v["per_token_us_mean"] for k, v in results.items()},
                    **{f"{k}_compile_ms": v["compile_ms_mean"] for k, v in results.items()},
                    "fastest": pick},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grammar-libs.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["summary"], indent=2))


if __name__ == "__main__":
    main()
