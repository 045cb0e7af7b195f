"""The fake model (pdserve/shared/engine/fake.py) behind the real Engine: fast to load, no weights, the
real KV shape, tokens a function of the whole sequence (through the KV in the pool), and never
the default model anywhere."""

from __future__ import annotations

import time

import pytest
from helpers import generate, run_all, tokens

from pdserve.local.stack import StackConfig
from pdserve.shared.config import DecodeSettings, GatewaySettings, PrefillSettings, WorkerSettings, model_id
from pdserve.shared.engine import fake, sources
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.engine.sources import inspect

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load("fake:smollm2")


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    chats = ["What is the capital of Japan?", "Tell me about honey bees.", "Tell me about honey bees!"]
    return {f"r{i}": tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]))
            for i, c in enumerate(chats)}


def test_it_loads_without_weights_under_a_name_of_its_own(monkeypatch):
    from pdserve.shared.engine import gguf_file, gguf_tensors

    def no_weights(*args, **kwargs):
        raise AssertionError("the fake model read the file's tensors or its architecture")

    for module, name in ((gguf_tensors, "tensors"), (gguf_file, "tensors"), (gguf_file, "config")):
        monkeypatch.setattr(module, name, no_weights)
    loaded = load("fake:smollm2")   # (the tokenizer alone, read from SmolLM2's file's metadata)
    assert isinstance(loaded.model, fake.FakeModel) and loaded.name == "fake-smollm2"
    assert not hasattr(loaded.model, "parameters")
    with pytest.raises(TypeError, match="fake"):
        loaded.decoder  # noqa: B018 - the property raises
    assert model_id("fake:smollm2") == "fake-SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="unknown fake model"):
        load("fake:gemma3-270m")


def test_its_kv_shape_vocabulary_and_tokenizer_are_its_bases(loaded, smollm2):
    base = smollm2.config
    shape = ("vocab_size", "num_layers", "num_kv_heads", "head_dim", "max_position", "eos_token_ids", "bos_token_id")
    assert {k: getattr(loaded.config, k) for k in shape} == {k: getattr(base, k) for k in shape}
    engine = Engine(loaded, EngineConfig(num_blocks=8))
    assert engine.runner.kv.shape == Engine(smollm2, EngineConfig(num_blocks=8)).runner.kv.shape
    assert loaded.tokenizer.chat_template == smollm2.tokenizer.chat_template
    assert inspect("fake:smollm2")[0] == loaded.config
    # a fake worker and a real one never exchange KV
    assert engine.fingerprint != Engine(smollm2, EngineConfig(num_blocks=8)).fingerprint


def test_greedy_tokens_are_a_function_of_the_whole_prompt(loaded, prompts):
    first = generate(loaded, prompts, GREEDY)
    assert generate(loaded, prompts, GREEDY) == first                       # another engine: the same
    alone = {rid: generate(loaded, {rid: ids}, GREEDY)[rid] for rid, ids in prompts.items()}
    assert alone == first                                                   # batched or alone: the same
    assert generate(loaded, prompts, GREEDY, prefill_chunk=16, max_batched_tokens=32) == first  # in chunks
    assert len({tuple(t) for t in first.values()}) == 3                     # (r1, r2 differ in one token)
    text = loaded.tokenizer.decode(first["r0"])
    assert text.startswith(" ") and text.replace(" ", "").isalpha(), text   # words
    assert not set(first["r0"]) & set(loaded.config.eos_token_ids)


def test_a_resumed_stream_continues_with_the_same_tokens(loaded, prompts):
    """A failover re-prefills the prompt and the tokens streamed so far elsewhere: the rest follows alike."""
    ids = prompts["r0"]
    whole = generate(loaded, {"r": ids}, GREEDY)["r"]
    resumed = generate(loaded, {"r": ids + whole[:7]}, SamplingParams(max_tokens=13, temperature=0, ignore_eos=True))
    assert whole[7:] == resumed["r"]
    engine = Engine(loaded, EngineConfig(num_blocks=64))
    generate(loaded, {"a": ids}, GREEDY, engine=engine)                     # its blocks cached
    again = generate(loaded, {"b": ids}, GREEDY, engine=engine)["b"]
    assert again == whole                                                   # from the prefix cache: the same


def test_the_tokens_come_from_the_kv_in_the_pool(loaded, prompts):
    """Changing the KV of the prompt's last token changes what follows: the KV is read, not only written."""
    ids = prompts["r0"]
    want = generate(loaded, {"r": ids}, GREEDY)["r"]
    engine = Engine(loaded, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    engine.add_request("r", ids, GREEDY)
    got = [t for o in engine.step() for t in o.new_token_ids]   # the prompt's pass: the first token
    assert got == want[:1]
    seq = engine.seqs["r"]
    last = len(ids) - 1
    engine.runner.kv[:, seq.block_table[last // 16], :, last % 16] += 1.0
    got += tokens(run_all(engine)["r"])
    assert got[0] == want[0] and got[1:] != want[1:]


def test_seeded_sampling_is_reproducible_and_spreads(loaded, prompts):
    def sample(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=30, temperature=1.0, seed=seed, ignore_eos=True)
        return generate(loaded, {"r": prompts["r0"]}, params)["r"]
    greedy = generate(loaded, {"r": prompts["r0"]}, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert sample(5) == sample(5)
    assert sample(5) != sample(6)
    assert sample(5) != greedy["r"]


def test_a_step_time_is_slept_per_pass(prompts):
    loaded = load("fake:smollm2")
    loaded.model.step_s = 0.05
    engine = Engine(loaded, EngineConfig(num_blocks=64))
    engine.add_request("r", prompts["r0"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    run_all(engine)
    assert time.perf_counter() - start >= 5 * 0.05


def test_it_is_never_the_default():
    for settings in (WorkerSettings, PrefillSettings, DecodeSettings, GatewaySettings):
        assert not sources.is_fake(settings.model_fields["model"].default)
        assert settings.model_fields["model"].default == "smollm2"
    assert StackConfig().model == "smollm2"
    assert WorkerSettings.model_fields["fake_step_s"].default == 0
    with pytest.raises(ValueError):
        load("fake")                      # the name alone is no model
