"""The quality cost of int8 KV on the wire (part of `make bench-transfer`): each held
conversation handed off exactly and through the int8 codec, then decoded greedily."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any
from unittest import mock

if TYPE_CHECKING:
    import torch


def int8_quality(new_tokens: int = 32) -> dict:
    """Each held conversation handed off twice — KV as it is, and through the int8 codec — then
    decoded greedily on the receiving engine: token agreement, and the largest logit difference
    over the steps where both runs had seen the same tokens."""
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import Engine
    from pdserve.shared.engine.loader import load
    from pdserve.shared.engine.sequence import SamplingParams
    from pdserve.shared.kv import codec
    from pdserve.shared.tools.held_prompts import CONVERSATIONS

    loaded = load("smollm2")
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    per_prompt: dict[str, dict[str, Any]] = {}
    for name, messages in CONVERSATIONS.items():
        assert loaded.tokenizer is not None
        prompt = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(messages))
        runs = {}
        for encoding in ("native", "int8"):
            src, dst = (Engine(loaded, EngineConfig(num_blocks=256)) for _ in range(2))
            res = dst.reserve("r", prompt, params)
            src.add_request("r", prompt, params, prefill_only=True)
            while not (outs := src.step()):
                pass
            export = src.export_kv("r", res.first_block)
            pool = dst.runner.kv
            for layer in range(export.num_layers):
                rows = codec.encode(encoding, export.layer(layer))
                kv = codec.decode(encoding, rows, tuple(pool.shape[2:]), pool.dtype)
                dst.write_kv(layer, list(res.block_ids), kv)
            logits: list[torch.Tensor] = []
            run = dst.runner.run
            def keep_logits(sched, hook=None, logits=logits, run=run):
                logits.append(run(sched, hook))
                return logits[-1]
            with mock.patch.object(dst.runner, "run", keep_logits):
                out = dst.commit_import("r", outs[0].new_token_ids[0])
                toks = list(out.new_token_ids)
                while dst.has_work():
                    toks += [t for o in dst.step() for t in o.new_token_ids]
            runs[encoding] = (toks, [x[0] for x in logits])
        (t0, l0), (t1, l1) = runs["native"], runs["int8"]
        same = next((i for i, (a, b) in enumerate(zip(t0, t1)) if a != b), len(t0))
        # logits of step i come from tokens[:i+1]: comparable while those agree
        diffs = [float((a - b).abs().max()) for a, b in zip(l0[:same], l1[:same])]
        per_prompt[name] = {"prompt_tokens": len(prompt), "agreement": sum(a == b for a, b in zip(t0, t1)) / len(t0),
                            "first_difference": same if same < len(t0) else None,
                            "max_logit_diff": max(diffs), "max_abs_logit": float(max(x.abs().max() for x in l0))}
    shape, dtype = tuple(pool.shape[2:]), pool.dtype
    return {"per_prompt": per_prompt,
            "int8_greedy_token_agreement": statistics.mean(r["agreement"] for r in per_prompt.values()),
            "int8_max_logit_diff": max(r["max_logit_diff"] for r in per_prompt.values()),
            "int8_bytes_over_native": codec.block_nbytes("int8", shape, dtype)
            / codec.block_nbytes("native", shape, dtype)}
