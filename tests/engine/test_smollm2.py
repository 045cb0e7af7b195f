"""The real SmolLM2-135M-Instruct through the engine, against transformers on the same GGUF."""

from __future__ import annotations

import pytest
import torch
from helpers import generate, gguf_parsed_once, pass_logits, run_all, tokens, transfer

from bench.engine.quality import reference_greedy
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.engine.sources import smollm2_path
from pdserve.shared.tools.held_prompts import CONVERSATIONS

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    return {name: tok.encode(tok.apply_chat_template(msgs)) for name, msgs in CONVERSATIONS.items()}


@pytest.fixture(scope="module")
def parsed_once():
    """transformers' three reads of the file (config, weights, tokenizer) share one parse (tests/helpers.py)."""
    with gguf_parsed_once():
        yield


@pytest.fixture(scope="module")
def hf_model(parsed_once):
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(prompts, hf_model):
    """Greedy tokens from transformers loading the same GGUF (an independent implementation)."""
    return {name: reference_greedy(hf_model, ids, NEW_TOKENS) for name, ids in prompts.items()}


def test_prompts_cover_lengths_and_turns(prompts):
    assert len(prompts) >= 5
    assert len(prompts["document"]) > 400 and len(prompts["greeting"]) < 40


def test_greedy_tokens_equal_transformers(smollm2, prompts, reference):
    ours = generate(smollm2, prompts, GREEDY)
    for name in prompts:
        assert ours[name] == reference[name], name


def test_answers_paris(smollm2, prompts):
    eng = Engine(smollm2, EngineConfig(num_blocks=64))
    eng.add_request("p", prompts["short"], SamplingParams(max_tokens=24, temperature=0))
    outs = run_all(eng)["p"]
    assert "Paris" in "".join(o.text for o in outs) and outs[-1].finish_reason == "stop"


def test_chunked_prefill_equals_transformers(smollm2, prompts, reference):
    ours = generate(smollm2, {"document": prompts["document"]}, GREEDY, max_batched_tokens=128,
                    prefill_chunk=64)
    assert ours["document"] == reference["document"]


def test_mixed_passes_equal_transformers(smollm2, prompts, reference):
    """The document is prefilled 64 tokens a pass while the other prompts decode: their
    tokens go in the same passes as its chunks, and every sequence's tokens stay the reference's."""
    eng = Engine(smollm2, EngineConfig(num_blocks=256, max_batched_tokens=96, prefill_chunk=64))
    others = {name: ids for name, ids in prompts.items() if name != "document"}
    for name, ids in others.items():
        eng.add_request(name, ids, GREEDY)
    while len(eng.scheduler.running) < len(others):
        eng.step()
    eng.add_request("document", prompts["document"], GREEDY)
    outs, kinds = {}, []
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        kinds.append(eng.last_pass.kind)
    assert kinds.count("mixed") >= len(prompts["document"]) // 64
    for name, got in outs.items():
        assert got == reference[name][-len(got):], name


@pytest.mark.parametrize("receiver_has_prefix", [False, True])
def test_export_import_continues_like_an_uninterrupted_run(smollm2, prompts, reference, receiver_has_prefix):
    src = Engine(smollm2, EngineConfig(num_blocks=128))
    dst = Engine(smollm2, EngineConfig(num_blocks=128))
    if receiver_has_prefix:  # same system prompt and document, different question: shared blocks
        other = prompts["document"][:-20] + prompts["short"][-20:]
        generate(smollm2, {"warm": other}, SamplingParams(max_tokens=2, temperature=0), engine=dst)
    for name in ("document", "multi_turn"):
        first = transfer(src, dst, name, prompts[name], GREEDY)
        if receiver_has_prefix and name == "document":
            assert dst.seqs[name].num_cached >= 16 * 20  # most of the prompt was not sent
        got = first.new_token_ids + tokens(run_all(dst)[name])
        assert got == reference[name], name
    assert src.num_free_blocks == src.num_blocks and dst.num_free_blocks == dst.num_blocks


def test_batch_of_eight_equals_each_alone(smollm2, prompts):
    tok = smollm2.tokenizer
    questions = ["Why is the sky blue?", "Write a haiku about rain.", "What is 17 times 3?",
                 "List two uses of copper.", "Who wrote Hamlet?", "Explain recursion briefly.",
                 "Translate 'good morning' to French.", "What do bees make?"]
    ps = {f"q{i}": tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
          for i, q in enumerate(questions)}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    together = generate(smollm2, ps, params, num_blocks=256)
    for rid, ids in ps.items():
        assert generate(smollm2, {rid: ids}, params, num_blocks=64)[rid] == together[rid], rid


def test_safetensors_directory_loads_the_same_model(hf_model, prompts, reference, tmp_path):
    """The GPU user's path: a Hugging Face directory (config.json + safetensors + tokenizer)."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    weights = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf_model.config.to_dict(), default=str))

    path = smollm2_path()
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp_path)
    loaded = load(str(tmp_path))
    assert loaded.config.num_layers == 30 and loaded.config.num_kv_heads == 3
    ours = generate(loaded, {"multi_turn": prompts["multi_turn"]}, GREEDY)
    assert ours["multi_turn"] == reference["multi_turn"]
    text = loaded.tokenizer.apply_chat_template(CONVERSATIONS["short"])
    assert loaded.tokenizer.encode(text) == prompts["short"]


def test_resumed_request_streams_the_same_text(smollm2, prompts):
    """Failover on the real vocabulary: text streamed before + after the move = one run's text."""
    params = SamplingParams(max_tokens=40, temperature=0, stop=("Paris",))
    eng = Engine(smollm2, EngineConfig(num_blocks=64))
    eng.add_request("a", prompts["short"], params)
    outs = run_all(eng)["a"]
    cut = 3
    before = "".join(o.text for o in outs[:cut])
    eng.add_request("b", prompts["short"], params, generated_token_ids=tokens(outs[:cut]))
    after = run_all(eng)["b"]
    assert tokens(outs) == tokens(outs[:cut]) + tokens(after)
    assert before + "".join(o.text for o in after) == "".join(o.text for o in outs)
    assert after[-1].finish_reason == outs[-1].finish_reason == "stop"  # the stop string, cut
    assert "Paris" not in "".join(o.text for o in outs)


@pytest.fixture(scope="module")
def native(smollm2_native):
    return smollm2_native


def test_native_weights_rank_the_references_tokens_first(native, prompts, reference):
    """The file's 4-bit blocks computed with as they are: against transformers' fp32 greedy
    tokens, teacher-forced (bench/engine/quality.py), the same first choice almost everywhere."""
    from bench.engine.quality import agreement

    counts = [agreement(native, prompts[name], reference[name]) for name in prompts]
    assert sum(a for a, _ in counts) / sum(n for _, n in counts) >= 0.95


def test_native_weights_serve_decode_steps_like_one_pass(native, prompts):
    """Decode steps (one row at a time through the kernel) and one prefill pass over the same
    tokens choose the same tokens almost everywhere. Not everywhere: the two attention paths
    round differently in fp32's last bits, and the kernel's 8-bit rounding of its input can
    turn that into a different choice where two tokens are nearly tied."""
    from bench.engine.quality import logits_all

    ours = generate(native, {"short": prompts["short"]}, GREEDY)["short"]
    again = logits_all(native, prompts["short"] + ours[:-1], start=len(prompts["short"]) - 1).argmax(-1).tolist()
    same = sum(a == b for a, b in zip(again, ours))
    assert len(again) == len(ours) and same >= 0.9 * len(ours), (same, len(ours))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_native_decode_passes_in_one_call_equal_the_layer_by_layer_path_to_the_bit(native, prompts, monkeypatch):
    """kernels/fused.c runs a decode pass's layers as the model's per-layer path does, step
    for step: the same logits, bit for bit, for sequences of different lengths in one batch."""
    from pdserve.shared.engine.kernels import fused

    calls, decode_layers = [], fused.decode_layers
    monkeypatch.setattr(fused, "decode_layers", lambda *a, **k: calls.append(1) or decode_layers(*a, **k))
    one_call = pass_logits(native, prompts)
    taken = len(calls)
    assert taken >= 11  # every decode pass took the one call
    monkeypatch.setattr(native.model, "fuse", False)
    layered = pass_logits(native, prompts)
    assert len(calls) == taken and len(one_call) == len(layered)
    assert all(_equal(a, b) for a, b in zip(one_call, layered))


def test_native_logits_of_a_sequence_do_not_depend_on_its_batch(native, prompts):
    """With native weights a row is summed alike whatever else is in the pass (kernels/blocks.c),
    so a sequence alone and beside four others (one prefill pass with a 900-token document, then
    decode passes of five) gets the same logits, bit for bit, at every step."""
    alone = [p["short"] for p in pass_logits(native, {"short": prompts["short"]})]
    together = [p["short"] for p in pass_logits(native, prompts) if "short" in p]
    assert len(alone) == len(together) == 12
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
