"""Where a model comes from (a directory, a Hub id through the Hugging Face cache), the id it is
served under, and what is refused by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from bench.engine import tiny_archs
from pdserve.shared.config import SMOLLM2_ID, GatewaySettings, model_id
from pdserve.shared.engine.loader import load


def test_the_served_id_is_the_models_own_name(tmp_path):
    path = tiny_archs.save("qwen2", tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"")
    assert model_id("smollm2") == SMOLLM2_ID
    assert model_id(str(path)) == "qwen2" and model_id(str(path) + "/") == "qwen2"
    assert model_id(str(tmp_path / "m.gguf")) == "m"
    assert model_id("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert GatewaySettings(model=str(path)).model_name == "qwen2"
    assert GatewaySettings(model=str(path), model_name="mine").model_name == "mine"


def _cache(home, repo_id: str, src) -> None:
    """A Hugging Face cache holding `src`'s files as repo_id's main snapshot (the layout
    huggingface_hub writes: blobs behind snapshots/<commit>, refs/main naming the commit)."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(src, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def _load_in(home, source: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    code = f"from pdserve.shared.engine.loader import load; m = load({source!r}); print(m.config.arch, m.name)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_hub_id_loads_from_the_cache_and_an_absent_one_is_named(tmp_path):
    _cache(tmp_path / "hf", "tiny-org/tiny-qwen3", tiny_archs.save("qwen3", tmp_path, tokenizer=True))
    done = _load_in(tmp_path / "hf", "tiny-org/tiny-qwen3")
    assert done.returncode == 0 and done.stdout.split()[0] == "qwen3", done.stderr
    missing = _load_in(tmp_path / "hf", "tiny-org/not-there")
    assert missing.returncode != 0 and "'tiny-org/not-there' is not in the Hugging Face cache" in missing.stderr


def _with_config(tmp_path, name: str, **changes):
    path = tiny_archs.save(name, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("name,changes,said", [
    ("llama", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2' is not supported"),
    ("llama", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                                "original_max_position_embeddings": 64}}, "RoPE scaling 'longrope'"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("qwen2", {"hidden_act": "relu"}, "activation 'relu'"),
])
def test_what_the_engine_does_not_compute_is_refused_by_name(tmp_path, name, changes, said):
    with pytest.raises(ValueError, match=said):
        load(_with_config(tmp_path, name, **changes))


def test_sharded_safetensors_load_shard_by_shard_to_the_same_model(tmp_path, monkeypatch):
    import safetensors.torch
    import torch

    from bench.engine.quality import logits_all

    whole = load(str(tiny_archs.save("qwen2", tmp_path)))
    sharded = tmp_path / "sharded"
    tiny_archs.build("qwen2").save_pretrained(sharded, max_shard_size="40KB")  # q, k and v in different shards
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 10
    opened, read = [], safetensors.torch.load_file
    monkeypatch.setattr(safetensors.torch, "load_file", lambda f: opened.append(f) or read(f))
    ids = list(range(3, 40))
    assert torch.equal(logits_all(load(str(sharded)), ids), logits_all(whole, ids))
    assert opened == shards
    shards[3].unlink()  # a shard missing: its tensors are named
    with pytest.raises(ValueError, match="missing"):
        load(str(sharded))


def test_building_a_model_imports_no_compiler():
    """The loader builds a model on the meta device before filling it; an op run there (a random
    init, the RoPE tables) goes through torch's Python references, which import its compiler
    (torch._dynamo): seconds of every worker's start, for nothing the engine uses."""
    code = ("import sys; from pdserve.shared.engine.loader import load; load('tiny'); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
