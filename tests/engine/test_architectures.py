"""Every architecture the engine serves against transformers, on tiny random checkpoints of each
(bench/engine/tiny_archs.py: built from transformers' config classes, saved as safetensors directories).

Greedy tokens equal transformers' exactly, in one pass, in chunks, beside other sequences,
after a prefix-cache hit, after a KV transfer and after a failover; logits within LOGITS_TOL in
fp32; a JSON schema's output follows it and is the same after a transfer. In bfloat16 (the
GPU's dtype, run here on CPU) the logits are as far from transformers' fp32 ones as
transformers' own bfloat16 logits are (BF16_SLACK times that, at most). Each architecture's
differences from Llama matter: without one, the logits move (so the equalities test them).
Converted to GGUF by llama.cpp's own converter, every checkpoint loads from the file with the
same tokens and logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import generate, pass_logits, run_all, tokens, transfer

from bench.engine import tiny_archs
from bench.engine.quality import logits_all, reference_greedy
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.model import DecoderModel
from pdserve.shared.engine.rope import Rope
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.engine.sources import inspect

NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
LOGITS_TOL = 1e-4   # fp32, max abs difference over every position (logits' std is ~2)
BF16_SLACK = (1.5, 1.25)  # bf16: (max, mean) abs difference from fp32, over transformers' bf16 own
NAMES = list(tiny_archs.configs())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("archs")


@pytest.fixture(scope="module")
def prompts():
    """Longer than the 24-token sliding windows, one shorter, and one sharing a 48-token prefix."""
    g = torch.Generator().manual_seed(0)
    ids = {n: torch.randint(3, 384, (k,), generator=g).tolist() for n, k in (("short", 9), ("mid", 40), ("long", 70))}
    ids["shared"] = ids["long"][:48] + torch.randint(3, 384, (13,), generator=g).tolist()
    return ids


_cache: dict[str, tuple] = {}


def _model(name: str, root):
    """(transformers model, our loaded model, the reference's greedy tokens per prompt)."""
    if name not in _cache:
        _cache[name] = (tiny_archs.build(name), load(str(tiny_archs.save(name, root))), {})
    return _cache[name]


def _reference(name, root, prompts):
    hf, ours, ref = _model(name, root)
    for k, ids in prompts.items():
        if k not in ref:
            ref[k] = reference_greedy(hf, ids, NEW)
    return hf, ours, ref


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_and_logits_equal_transformers(name, root, prompts):
    hf, ours, ref = _reference(name, root, prompts)
    assert generate(ours, prompts, GREEDY) == ref
    ids = prompts["long"] + ref["long"]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert float((logits_all(ours, ids) - want).abs().max()) < LOGITS_TOL


@pytest.mark.parametrize("name", NAMES)
def test_chunks_prefix_cache_transfer_and_failover_keep_the_tokens(name, root, prompts):
    _, ours, ref = _reference(name, root, prompts)
    # chunked prefill of 16-token chunks, beside the other prompts' decode steps
    assert generate(ours, prompts, GREEDY, max_batched_tokens=32, prefill_chunk=16) == ref
    # a prefix-cache hit: "shared" reuses 3 blocks of "long"
    eng = Engine(ours, EngineConfig(num_blocks=64))
    assert generate(ours, {"long": prompts["long"]}, GREEDY, engine=eng)["long"] == ref["long"]
    eng.add_request("shared", prompts["shared"], GREEDY)
    outs = run_all(eng)["shared"]
    assert outs[-1].num_cached_tokens == 48 and tokens(outs) == ref["shared"]
    # prefill in one engine, KV moved to another, decode there
    src, dst = Engine(ours, EngineConfig(num_blocks=64)), Engine(ours, EngineConfig(num_blocks=64))
    first = transfer(src, dst, "long", prompts["long"], GREEDY)
    assert first.new_token_ids + tokens(run_all(dst)["long"]) == ref["long"]
    # failover after 5 tokens: the prompt and those tokens prefilled again elsewhere
    dst.add_request("again", prompts["long"], GREEDY, generated_token_ids=ref["long"][:5])
    assert tokens(run_all(dst)["again"]) == ref["long"][5:]


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_logits_and_engine_paths(name, root, prompts):
    """bfloat16 weights, activations and KV pool (PD_DTYPE on a GPU): logits as close to
    transformers' fp32 ones as transformers' own bf16 logits, and the engine's paths agree with
    each other in bf16 too."""
    hf, _, ref = _reference(name, root, prompts)
    ours = load(str(tiny_archs.save(name, root)), dtype=torch.bfloat16)
    hf_bf16 = tiny_archs.build(name, torch.bfloat16)
    ids = prompts["long"] + ref["long"]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        theirs = (hf_bf16(torch.tensor([ids])).logits[0].float() - want).abs()
    err = (logits_all(ours, ids) - want).abs()
    assert float(err.max()) <= BF16_SLACK[0] * float(theirs.max())
    assert float(err.mean()) <= BF16_SLACK[1] * float(theirs.mean())
    # fed transformers' fp32 greedy tokens, the bf16 engine ranks them first as often as
    # transformers in bf16 does (bf16 rounding turns near ties either way)
    ours_agree = theirs_agree = 0
    for k, ids in prompts.items():
        fed = ids + ref[k][:-1]
        with torch.no_grad():
            theirs_first = hf_bf16(torch.tensor([fed])).logits[0, len(ids) - 1:].argmax(-1)
        ours_agree += int((logits_all(ours, fed, start=len(ids) - 1).argmax(-1) == torch.tensor(ref[k])).sum())
        theirs_agree += int((theirs_first == torch.tensor(ref[k])).sum())
    assert ours_agree >= theirs_agree - 2, (ours_agree, theirs_agree)
    bf16 = dict(dtype=torch.bfloat16)
    one = generate(ours, prompts, GREEDY, **bf16)
    # a transfer in bf16 decodes from the same KV bytes: the same tokens as one engine
    src, dst = (Engine(ours, EngineConfig(num_blocks=64, **bf16)) for _ in range(2))
    first = transfer(src, dst, "mid", prompts["mid"], GREEDY)
    assert first.new_token_ids + tokens(run_all(dst)["mid"]) == one["mid"]


@pytest.fixture(scope="module")
def gguf_files(root):
    return tiny_archs.save_gguf(NAMES, root)


@pytest.mark.parametrize("name", NAMES)
def test_gguf_file_from_llamacpp_converter_equals_transformers(name, gguf_files, prompts):
    """The file's tokens and logits are the checkpoint's, as the file describes it (a Mistral
    file has no window: tiny_archs.gguf_reference); its tokenizer encodes as the directory's."""
    hf, ours = tiny_archs.gguf_reference(name), load(str(gguf_files[name]))
    ref = {k: reference_greedy(hf, ids, NEW) for k, ids in prompts.items()}
    assert generate(ours, prompts, GREEDY) == ref
    ids = prompts["long"] + ref["long"]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert float((logits_all(ours, ids) - want).abs().max()) < LOGITS_TOL
    text = tiny_archs.TEXT + "<|im_start|>user\nhi<|im_end|>"
    _, tokenizer = inspect(str(tiny_archs.save(name, gguf_files[name].parent, tokenizer=True)))
    assert ours.tokenizer.encode(text) == tokenizer.encode(text)


@pytest.fixture(scope="module")
def q8_0_files(root):
    return tiny_archs.save_gguf(NAMES, root, "q8_0")


@pytest.mark.parametrize("name", NAMES)
def test_a_q8_0_file_computed_with_its_own_blocks_gives_its_dequantized_logits(name, q8_0_files):
    """Every architecture's layer (biases, Gemma's norms and GeGLU, Phi-3's fused matrices…) on
    native weights: the prompt pass's logits are the fp32 dequantization's to the kernel's 8-bit
    rounding of activations (a random model's near-flat logits move 1–6%; a matrix wired to the
    wrong rows moves them ~100%)."""
    native, dense = (load(str(q8_0_files[name]), weights=w) for w in ("native", "fp32"))
    assert native.weights == "native" and native.model.packed_formats() == {"Q8_0"}
    ids = list(range(3, 40))
    got, want = logits_all(native, ids), logits_all(dense, ids)
    assert float((got - want).norm() / want.norm()) < 0.1


@pytest.mark.parametrize("name", NAMES)
def test_a_q8_0_files_decode_passes_in_one_call_equal_the_layer_by_layer_path(name, q8_0_files, prompts,
                                                                            monkeypatch):
    """kernels/fused.c runs each architecture's decode pass in one call (all but biased
    projections and partial rotary): q/k norms, Gemma's norms around both blocks and GeGLU,
    windows with their own RoPE, soft-capped scores. Its logits are the per-layer path's: to
    the bit for Llama's layer (the same C steps), to float rounding where the per-layer path
    norms in torch (q/k and output norms: ~1e-7; a window or norm gone wrong moves them
    ~1e-1)."""
    from pdserve.shared.engine.kernels import fused

    native = load(str(q8_0_files[name]), weights="native")
    assert (native.model.packed_layers is not None) == (name not in ("qwen2", "phi3"))
    calls, decode_layers = [], fused.decode_layers
    monkeypatch.setattr(fused, "decode_layers", lambda *a, **k: calls.append(1) or decode_layers(*a, **k))
    one_call = pass_logits(native, prompts)
    assert len(calls) == (0 if native.model.packed_layers is None else NEW - 1)
    native.model.fuse = False
    layered = pass_logits(native, prompts)
    cfg = native.model.cfg
    exact = not (cfg.qk_norm or cfg.sandwich_norms)  # (no step the per-layer path does in torch)
    for a, b in zip(one_call[1:4], layered[1:4]):  # (the first passes: later ones may part ways)
        for rid in a:
            err = float((a[rid] - b[rid]).norm() / b[rid].norm())
            assert err == 0 if exact else err < 1e-5, (rid, err)


def test_gguf_files_carry_rope_windows_and_shapes(gguf_files):
    """What each file's metadata and tensors give the engine, where llama.cpp keeps it its own way."""
    cfg = {name: inspect(str(path))[0] for name, path in gguf_files.items()}
    assert cfg["llama3-rope"].rope.kind == "factors"  # rope_freqs.weight
    assert (cfg["linear-rope"].rope.kind, cfg["yarn-rope"].rope.kind) == ("linear", "yarn")
    assert cfg["gemma3"].windows == (24,) * 5 + (0,) and cfg["gemma3"].local_rope == Rope(10_000.0)
    assert cfg["mistral"].windows == () and cfg["phi3"].rotary_dim == 8 and cfg["qwen3"].head_dim == 16


# the tiny checkpoints' vocabulary read as bytes (structured output's masks need one): tokens 0-255
# spell their byte, the rest two printable bytes each; the end token (2) spells nothing
VOCAB = [b"" if i == 2 else bytes([i]) for i in range(256)] + \
    [bytes([33 + (i % 90), 33 + (i * 7 % 90)]) for i in range(tiny_archs.COMMON["vocab_size"] - 256)]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("name", NAMES)
def test_structured_output_follows_the_schema_after_a_transfer(name, root, prompts):
    import json

    from pdserve.shared.engine.grammar import Grammar, Grammars

    _, ours, _ = _model(name, root)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, grammar=Grammar("json_schema", json.dumps(PERSON)))
    engines = [Engine(ours, EngineConfig(num_blocks=64)) for _ in range(3)]
    for e in engines:
        e.grammars = Grammars(VOCAB, e.eos_token_ids)
    one = tokens(run_all(_added(engines[0], prompts["mid"], params))["a"])
    first = transfer(engines[1], engines[2], "a", prompts["mid"], params)
    assert first.new_token_ids + tokens(run_all(engines[2])["a"]) == one
    value = json.loads(b"".join(VOCAB[t] for t in one).decode())
    assert set(value) == {"name", "age"} and 0 <= value["age"] <= 120


def _added(engine: Engine, ids: list[int], params: SamplingParams) -> Engine:
    engine.add_request("a", ids, params)
    return engine


# what each architecture changes, and its Llama value: taking it away must move the logits
ABLATIONS = [("mistral", "windows", ()), ("gemma2", "windows", ()), ("gemma3", "windows", ()),
             ("gemma2", "attn_softcap", 0.0), ("gemma2", "final_softcap", 0.0), ("gemma2", "embed_scale", 1.0),
             ("gemma3", "local_rope", None), ("phi3", "rotary_dim", 0), ("llama3-rope", "rope", Rope()),
             ("linear-rope", "rope", Rope()), ("yarn-rope", "rope", Rope()), ("gemma2", "activation", "silu")]


@pytest.mark.parametrize("name,field,plain", ABLATIONS, ids=[f"{n}-{f}" for n, f, _ in ABLATIONS])
def test_each_difference_from_llama_matters(name, field, plain, root, prompts):
    _, ours, ref = _reference(name, root, prompts)
    cfg = dataclasses.replace(ours.config, **{field: plain})
    other = DecoderModel(cfg)
    other.load_state_dict(ours.model.state_dict())
    ids = prompts["long"] + ref["long"]
    moved = float((logits_all(dataclasses.replace(ours, model=other, config=cfg), ids) - logits_all(ours, ids))
                  .abs().max())
    assert moved > 100 * LOGITS_TOL
