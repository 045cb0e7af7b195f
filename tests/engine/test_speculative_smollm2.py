"""Speculative decoding on the real SmolLM2 with its file's own blocks (a row's logits do not depend on its batch):
greedy tokens equal to those without it, drafts kept where the answer copies its prompt and refused in free chat."""

from __future__ import annotations

import pytest
from helpers import run_all, tokens

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.sequence import SamplingParams

pytestmark = pytest.mark.slow

TEXT = ("The quick brown fox jumps over the lazy dog near the river bank, and the small bird sings a song "
        "about the morning sun while the farmer walks his cows to the green field behind the old barn.")
CONVERSATIONS = {
    "copy": [{"role": "user", "content": f"Repeat this text exactly, twice:\n\n{TEXT}"}],
    "chat": [{"role": "user", "content": "What should I cook for dinner tonight?"}],
}


def _generate(loaded, prompts: dict[str, list[int]], k: int) -> tuple[dict[str, list[int]], Engine]:
    eng = Engine(loaded, EngineConfig(num_blocks=128, speculative_tokens=k))
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    outs = run_all(eng)
    assert eng.num_free_blocks == eng.num_blocks
    return {rid: tokens(outs[rid]) for rid in prompts}, eng


def test_greedy_tokens_with_drafts_equal_those_without(smollm2_native):
    tok = smollm2_native.tokenizer
    prompts = {name: tok.encode(tok.apply_chat_template(msgs)) for name, msgs in CONVERSATIONS.items()}
    plain, _ = _generate(smollm2_native, prompts, 0)
    drafted, eng = _generate(smollm2_native, {"copy": prompts["copy"]}, 4)
    assert drafted["copy"] == plain["copy"] and eng.speculator.stats.accepted > 0
    chat, eng = _generate(smollm2_native, {"chat": prompts["chat"]}, 4)
    stats = eng.speculator.stats
    assert chat["chat"] == plain["chat"] and stats.drafted > stats.accepted
