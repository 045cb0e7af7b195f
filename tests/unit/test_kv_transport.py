"""A KV handoff through the transport interface (fake backend): layers and their checksums."""

import asyncio

import numpy as np
import torch

from helpers import run_all, tokens
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.sequence import SamplingParams
from shared.kv import checksum, make
from shared.messages import KVHeader

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


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
        header = KVHeader.decode(header.encode())  # it travels over NATS
        recv = asyncio.create_task(b.receive(1 << 16, header.num_layers, header.layer_nbytes))
        sent = await a.send(b.address, 1 << 16, layers)
        got_layers = await recv
        assert sent == sum(p.nbytes for p in layers)
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
