"""Small drivers for engine tests."""

from __future__ import annotations

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine, RequestOutput
from shared.engine.sequence import SamplingParams
from shared.hashing import block_hashes

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def run_all(engine: Engine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until idle; outputs grouped by request id."""
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def generate(loaded, prompts: dict[str, list[int]], params: SamplingParams = GREEDY,
             engine: Engine | None = None, **cfg) -> dict[str, list[int]]:
    """Run prompts together in an engine (a fresh one by default); generated ids per request."""
    engine = engine or Engine(loaded, EngineConfig(**{"num_blocks": 512, **cfg}))
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    outs = run_all(engine)
    assert engine.num_free_blocks == engine.num_blocks
    return {rid: tokens(outs[rid]) for rid in prompts}


def transfer(src: Engine, dst: Engine, rid: str, prompt: list[int], params: SamplingParams,
             generated: list[int] | tuple[()] = ()) -> RequestOutput:
    """Disaggregated path in one process: prefill on src, KV moved layer by layer to dst
    (`generated`: a failover's tokens streamed before it, prefilled with the prompt)."""
    reservation = dst.reserve(rid, prompt, params, generated)
    src.add_request(rid, prompt, params, prefill_only=True, generated_token_ids=generated)
    first = None
    while first is None:
        first = next((o for o in src.step() if o.request_id == rid), None)
    export = src.export_kv(rid, first_block=reservation.first_block)
    assert export.num_blocks == reservation.num_blocks - reservation.first_block
    assert export.block_hashes == block_hashes([*prompt, *generated], src.cfg.block_size, params.cache_salt)
    for layer in range(export.num_layers):
        dst.import_layer(rid, layer, export.layer_bytes(layer), reservation.first_block)
    src.free(rid)
    out = dst.commit_import(rid, first.new_token_ids[0])
    out.text = first.text
    return out
