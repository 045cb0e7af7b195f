"""n > 1 through the stack: n choices from one prompt, the prompt prefilled once.
On the session's fake-model stack (tests/stack/conftest.py): what is tested is n's choices, their
seeds and the prompt prefilled once, not the model's numbers."""

from __future__ import annotations

import httpx
import pytest
from conftest import MODEL
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
WORKERS = ("prefill-0", "decode-0")
BLOCK = 16  # the workers' KV block size (EngineConfig's default)


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


@pytest.fixture(scope="module")
def client(fake_client):
    return fake_client


def computed_prompt_tokens(stack) -> float:
    """Prompt tokens the workers computed (prefilled minus found in their prefix caches)."""
    total = 0.0
    for name in WORKERS:
        for family in text_string_to_metric_families(httpx.get(stack.metrics_url(name), timeout=10).text):
            for s in family.samples:
                if s.name == "pd_prompt_tokens_total":
                    total += s.value
                elif s.name == "pd_prefix_cache_hit_tokens_total":
                    total -= s.value
    return total


def test_three_choices_from_one_prefill_seeded_and_reproducible(stack, client):
    story = "Once upon a time in a small village by the sea, " * 24  # ~300 tokens: many blocks
    kw = dict(model=MODEL, prompt=story + "the old fisherman said", max_tokens=12, temperature=1.0, seed=7,
              extra_body={"return_token_ids": True})
    before = computed_prompt_tokens(stack)
    three = client.completions.create(n=3, **kw)
    computed = computed_prompt_tokens(stack) - before
    prompt = three.usage.prompt_tokens
    assert prompt > 250
    assert [c.index for c in three.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in three.choices]
    assert three.usage.completion_tokens == sum(map(len, ids))
    assert len({tuple(i) for i in ids}) > 1  # sampled: the choices differ
    # once: choice 0 computed the prompt; each other choice at most its last, partial block
    assert prompt <= computed <= prompt + 2 * BLOCK, (prompt, computed)
    one = client.completions.create(n=1, **kw)
    assert one.choices[0].model_extra["token_ids"] == ids[0]  # choice 0 keeps the seed
    again = client.completions.create(n=3, **kw)
    assert [c.model_extra["token_ids"] for c in again.choices] == ids


def test_n_streamed_carries_each_choice_by_index(client):
    msgs = [{"role": "user", "content": "Name a colour."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, n=2, temperature=0, max_tokens=10)
    assert len(full.choices) == 2 and full.choices[0].message.content == full.choices[1].message.content  # greedy
    chunks = [c for c in client.chat.completions.create(model=MODEL, messages=msgs, n=2, temperature=0,
                                                        max_tokens=10, stream=True) if c.choices]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == full.choices[index].message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [full.choices[index].finish_reason]
