"""A KV handoff through the transport interface (fake backend): header, layers, checksums."""

import asyncio

import numpy as np
import pytest
import torch

from helpers import run_all, tokens
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.sequence import SamplingParams
from shared.kv import checksum, make
from shared.kv.base import pack_header, unpack_header
from shared.messages import KVHeader

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_header_frame_round_trip_and_limit():
    h = KVHeader(request_id="r", fingerprint="f", first_block=1, num_blocks=2, num_layers=3, layer_nbytes=4,
                 checksums=[1, 2, 3], first_token=9)
    assert unpack_header(pack_header(h)) == h
    with pytest.raises(ValueError):
        pack_header(h.model_copy(update={"checksums": list(range(5000))}))


def test_engine_to_engine_through_the_fake_transport(tiny):
    prompt = list(range(3, 60))
    src, dst = Engine(tiny, EngineConfig(num_blocks=32)), Engine(tiny, EngineConfig(num_blocks=32))
    reference = Engine(tiny, EngineConfig(num_blocks=32))
    reference.add_request("r", prompt, PARAMS)
    expected = tokens(run_all(reference)["r"])

    async def handoff():
        a, b = make("fake"), make("fake")
        res = dst.reserve("r", prompt, PARAMS)
        src.add_request("r", prompt, PARAMS, prefill_only=True)
        first = src.step()[0]
        export = src.export_kv("r", res.first_block)
        layers = [export.layer_bytes(i).numpy() for i in range(export.num_layers)]
        header = KVHeader(request_id="r", fingerprint=export.fingerprint, first_block=res.first_block,
                          num_blocks=export.num_blocks, num_layers=export.num_layers,
                          layer_nbytes=layers[0].nbytes, checksums=[checksum(p) for p in layers],
                          first_token=first.new_token_ids[0])
        recv = asyncio.create_task(b.receive(1 << 16, export.num_layers, layers[0].nbytes))
        sent = await a.send(b.address, 1 << 16, header, layers)
        got_header, got_layers = await recv
        assert sent == sum(p.nbytes for p in layers) and got_header == header
        assert [checksum(p) for p in got_layers] == header.checksums
        for i, p in enumerate(got_layers):
            dst.import_layer("r", i, torch.from_numpy(p), res.first_block)
        src.free("r")
        return dst.commit_import("r", header.first_token)

    first = asyncio.run(handoff())
    assert first.new_token_ids + tokens(run_all(dst)["r"]) == expected
    assert src.num_free_blocks == dst.num_free_blocks == 32


def test_checksum_sees_a_single_flipped_byte():
    payload = np.arange(4096, dtype=np.uint8)
    before = checksum(payload)
    payload[1234] ^= 1
    assert checksum(payload) != before
