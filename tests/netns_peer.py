"""One side of a KV handoff, run inside a network namespace by tests/stack/test_netns.py.

    python tests/netns_peer.py decode NATS_URL DIR     # reserve, receive, commit, generate
    python tests/netns_peer.py prefill NATS_URL DIR    # prefill, streaming the KV to decode

Both use the services' handoff code (KVSender / KVReceiver) and the UCX transport, with the
tiny model; they meet through files in DIR and NATS.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from pdserve.shared import subjects
from pdserve.shared.bus import Bus
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.kv import TAG_SPAN, create_transport
from pdserve.shared.kv.receiver import KVInbox, KVReceiver
from pdserve.shared.kv.sender import KVSender, SenderSettings, WorkerHooks
from pdserve.shared.messages import KVAck, PrefillJob, Sampling

PROMPT = [(7 * i) % 200 + 3 for i in range(600)]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CONFIG = dict(num_blocks=64, prefill_chunk=128, max_batched_tokens=128)
SECRET = "5e" * 16   # the placement's secret both sides are told (pdserve/shared/macs.py)


async def decode(url: str, work: Path) -> None:
    engine = Engine(load("tiny"), EngineConfig(**CONFIG))
    bus, transport = await Bus.connect(url, "netns-decode"), create_transport("ucx")
    res = engine.reserve("r", PROMPT, PARAMS)
    inbox = KVInbox(bus, "d")
    rx = inbox.add(KVReceiver.for_engine(engine, res, TAG_SPAN, transport, bus, "p", secret=SECRET))
    await inbox.start()
    await bus.nc.flush()
    (work / "decode.json").write_text(json.dumps({"address": transport.address, "fingerprint": engine.fingerprint,
                                                  "first_block": res.first_block, "kv_tag": TAG_SPAN}))
    first = await asyncio.wait_for(rx.wait(), 60)
    out = engine.commit_import("r", first)
    await bus.publish(subjects.prefill_kv_ack("p"), KVAck(request_id="r", ok=True, kv_tag=TAG_SPAN), secret=SECRET)
    tokens = list(out.new_token_ids)
    while engine.has_work():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    (work / "result.json").write_text(json.dumps({"tokens": tokens, "bytes": rx.bytes_received,
                                                  "bad_blocks": rx.bad_blocks}))
    await bus.close()


async def prefill(url: str, work: Path) -> None:
    engine = Engine(load("tiny"), EngineConfig(**CONFIG))
    while not (work / "decode.json").exists():
        await asyncio.sleep(0.05)
    peer = json.loads((work / "decode.json").read_text())
    bus = await Bus.connect(url, "netns-prefill")

    async def read_blocks(rid, layer, first, n):
        return engine.kv_blocks(rid, layer, first, n)

    sender = KVSender(SenderSettings("p", engine.fingerprint), create_transport("ucx"), bus, WorkerHooks(read_blocks))
    await sender.start()
    job = PrefillJob(request_id="r", prompt_token_ids=PROMPT, sampling=Sampling(), decode_worker="d",
                     decode_address=peer["address"], decode_fingerprint=peer["fingerprint"],
                     first_block=peer["first_block"], kv_tag=peer["kv_tag"], secret=SECRET)
    sink = await sender.open(job)
    engine.add_request("r", PROMPT, PARAMS, prefill_only=True)
    engine.stream_kv("r", job.first_block, sink)
    while not (outs := engine.step()):
        await asyncio.sleep(0)
    h = sender.handoffs["r"]
    ack = await sender.finish("r", outs[0].new_token_ids[0], lease_s=60)
    (work / "prefill.json").write_text(json.dumps({"ok": ack.ok, "error": ack.error, "bytes": h.bytes_sent}))
    await bus.close()


if __name__ == "__main__":
    role, url, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    start = time.monotonic()
    asyncio.run({"decode": decode, "prefill": prefill}[role](url, work))
