"""Structured output in the engine: every token chosen under the grammar's mask, on the tiny
random-weight model (whose choices, unconstrained, are noise) given a vocabulary of bytes."""

import json
import re

import pytest
from helpers import run_all, tokens, transfer

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.grammar import Grammar, GrammarError, Grammars, check
from pdserve.shared.engine.sequence import SamplingParams

PROMPT = list(range(40, 90))
EOS = 2
# tokens 0-255 spell their byte, 256-511 two bytes each (printable pairs); the end token spells nothing
VOCAB = [b"" if i == EOS else bytes([i]) for i in range(256)] + \
    [bytes([33 + (i % 90), 33 + (i * 7 % 90)]) for i in range(256)]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user"]}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "role", "ok"], "additionalProperties": False}


def engine(tiny) -> Engine:
    e = Engine(tiny, EngineConfig(num_blocks=64))
    e.grammars = Grammars(VOCAB, e.eos_token_ids)  # (the tiny model has no tokenizer)
    return e


def text(ids: list[int]) -> str:
    """The output's bytes as UTF-8, strictly: a JSON string's characters leave out surrogates."""
    return b"".join(VOCAB[t] for t in ids).decode()


def generate(tiny, grammar: Grammar, seed: int, **kw) -> tuple[str, str]:
    e = engine(tiny)
    e.add_request("a", PROMPT, SamplingParams(max_tokens=120, temperature=1.0, seed=seed, grammar=grammar, **kw))
    outs = run_all(e)["a"]
    assert e.num_free_blocks == e.num_blocks
    return text(tokens(outs)), outs[-1].finish_reason


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_parses_and_follows_the_schema(tiny, seed):
    out, reason = generate(tiny, Grammar("json_schema", json.dumps(PERSON)), seed)
    assert reason == "stop", out
    value = json.loads(out)
    assert list(value) == ["name", "age", "role", "ok"]
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert value["role"] in ("admin", "user") and isinstance(value["ok"], bool)


def test_regex_choice_and_json_object(tiny):
    for seed in range(4):
        out, _ = generate(tiny, Grammar("regex", r"[0-9]{3}-[a-z]{2,4}"), seed)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out), out
        out, _ = generate(tiny, Grammar("choice", json.dumps(["yes", "no", "maybe so"])), seed)
        assert out in ("yes", "no", "maybe so")
        out, reason = generate(tiny, Grammar("json_object"), seed)
        assert reason == "length" or isinstance(json.loads(out), dict), out


def test_without_a_grammar_the_same_seed_leaves_it(tiny):
    """The mask is what makes the output valid: the same draws unconstrained are noise."""
    e = engine(tiny)
    e.add_request("a", PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=0, ignore_eos=True))
    out = tokens(run_all(e)["a"])
    assert not re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", b"".join(VOCAB[t] for t in out).decode(errors="replace"))


def test_the_first_token_obeys_on_the_prefill_side_and_the_rest_continue_after_a_transfer(tiny):
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=5, grammar=Grammar("json_schema", json.dumps(PERSON)))
    alone = engine(tiny)
    alone.add_request("a", PROMPT, params)
    expected = tokens(run_all(alone)["a"])
    src, dst = engine(tiny), engine(tiny)
    first = transfer(src, dst, "a", PROMPT, params)
    moved = first.new_token_ids + tokens(run_all(dst)["a"])
    assert moved == expected and json.loads(text(moved))


def test_a_failover_resumes_inside_the_grammar(tiny):
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=9, grammar=Grammar("json_schema", json.dumps(PERSON)))
    alone = engine(tiny)
    alone.add_request("a", PROMPT, params)
    expected = tokens(run_all(alone)["a"])
    resumed = engine(tiny)
    resumed.add_request("a", PROMPT, params, generated_token_ids=expected[:7])
    assert expected[:7] + tokens(run_all(resumed)["a"]) == expected
    wrong = engine(tiny)  # tokens no grammar state explains: the request ends with the error
    wrong.add_request("b", PROMPT, params, generated_token_ids=[ord("x")])
    (out,) = run_all(wrong)["b"]
    assert out.finish_reason == "error" and "leave the grammar" in out.error and not wrong.seqs


def test_a_grammar_that_does_not_parse_is_refused_by_the_check():
    """The gateway's check; the engine's failed compiles: tests/unit/test_grammar_compiles.py."""
    for bad in (Grammar("json_schema", "{not json"), Grammar("regex", "[a-"), Grammar("choice", "[]"),
                Grammar("ebnf", "root ::= missing_rule")):
        with pytest.raises(GrammarError):
            check(bad)


def test_a_model_without_a_tokenizer_refuses_structured_output(tiny):
    e = Engine(tiny, EngineConfig(num_blocks=64))
    with pytest.raises(GrammarError, match="tokenizer"):
        e.add_request("a", PROMPT, SamplingParams(grammar=Grammar("json_object")))


def test_the_cpu_mask_equals_xgrammars_kernel_on_all_rows_or_some():
    import torch
    import xgrammar as xgr

    from pdserve.shared.engine.grammar import mask_rows

    grammars = Grammars(VOCAB, (EOS,))
    ms = {row: grammars.matcher(Grammar("json_schema", json.dumps(PERSON))) for row in range(4)}
    for m, prefix in zip(ms.values(), [b"", b'{"na', b'{"name": "Al', b'{"name": "A", "age": 3']):
        assert all(m.accept(b) for b in prefix)
    for rows in ([0, 1, 2, 3], [1, 3]):
        logits = torch.randn(4, len(VOCAB))
        expected = logits.clone()
        bitmask = xgr.allocate_token_bitmask(4, len(VOCAB))
        for row in rows:
            ms[row].fill(bitmask, row)
        xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
        mask_rows(logits, {row: ms[row] for row in rows})
        assert torch.equal(logits, expected)
        assert torch.isinf(logits[rows]).any() and not torch.isinf(logits[[r for r in range(4) if r not in rows]]).any()
