"""The KV handoff protocol (pdserve/shared/kv/sender.py → receiver.py) between two tiny engines in one
process: fake transport, in-process bus. The same code runs over UCX and NATS in the stack."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from helpers import run_all, tokens
from localbus import LocalBus

from pdserve.shared import subjects
from pdserve.shared.engine import kv_device
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.kv import Faults, create_transport, receiver
from pdserve.shared.kv.receiver import KVBrokeOff, KVFailed, KVInbox, KVReceiver
from pdserve.shared.kv.same_host import SameHost
from pdserve.shared.kv.segment import Segment, Segments
from pdserve.shared.kv.sender import KVSender, SenderSettings, WorkerHooks
from pdserve.shared.kv.staging import Staging
from pdserve.shared.messages import KVAck, KVEnd, KVLayer, KVResend, KVSync, PrefillJob, Sampling

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPT = list(range(3, 90))   # 87 tokens: 6 blocks of 16
SECRET = "5e" * 16             # the placement's secret both sides are told (pdserve/shared/macs.py)
CHUNKED = dict(num_blocks=64, prefill_chunk=32, max_batched_tokens=32)   # 3 passes


async def receiving(dst: Engine, bus: LocalBus, sender: str, kv_tag: int = 1 << 20, transport=None) -> KVReceiver:
    """Decode worker "d"'s inbox, started, with a receiver of request "r" from `sender` under the
    placement's SECRET (the fake transport unless another is given)."""
    inbox = KVInbox(bus, "d")
    await inbox.start()
    return inbox.add(KVReceiver.for_engine(dst, dst.reserve("r", PROMPT, PARAMS), kv_tag,
                                           transport or create_transport("fake"), bus, sender, secret=SECRET))


def expected(tiny, prompt=PROMPT):
    ref = Engine(tiny, EngineConfig(num_blocks=64))
    ref.add_request("r", prompt, PARAMS)
    return tokens(run_all(ref)["r"])


async def handoff(src: Engine, dst: Engine, prompt=PROMPT, rid="r", faults: Faults | None = None,
                  fingerprint: str | None = None, max_sends: int = 3, encoding="native", piece_bytes=8 << 20,
                  bus: LocalBus | None = None, before_wait=None, segment: Segment | None = None,
                  decode_host: str | None = None, transport: str = "fake", pool: kv_device.PoolHandle | None = None):
    """Prefill on src streaming to dst (through `segment` when given, or src's shared `pool`: the same
    host); returns (tokens, sender handoff, receiver, bus)."""
    bus = bus or LocalBus()
    # the same host's paths in front of the transport, as the workers have them (pdserve/shared/kv/same_host.py)
    tx = SameHost(create_transport(transport, faults=faults), segment, pool=pool)
    rx_transport = SameHost(create_transport("fake"), segments=Segments(),
                            pools=kv_device.Pools(pool.kind) if pool is not None else None)

    async def read_blocks(r, layer, first, n):
        return src.kv_blocks(r, layer, first, n)

    sender = KVSender(SenderSettings("p", src.fingerprint, max_sends, encoding, piece_bytes), tx, bus,
                      WorkerHooks(read_blocks))
    await sender.start()
    res = dst.reserve(rid, prompt, PARAMS)
    inbox = KVInbox(bus, "d")
    rx = inbox.add(KVReceiver.for_engine(dst, res, 1 << 20, rx_transport, bus, "p", max_sends, SECRET))
    await inbox.start()
    if decode_host is None:
        decode_host = segment.host if segment else tx.host
    job = PrefillJob(request_id=rid, prompt_token_ids=prompt, sampling=Sampling(), decode_worker="d",
                     decode_address=rx_transport.address, decode_fingerprint=fingerprint or dst.fingerprint,
                     first_block=res.first_block, kv_tag=1 << 20, decode_host=decode_host,
                     decode_device=rx_transport.device, secret=SECRET)
    sink = await sender.open(job)
    h = sender.handoffs[rid]
    src.add_request(rid, prompt, PARAMS, prefill_only=True)
    if sink is not None:
        src.stream_kv(rid, res.first_block, sink)
    first = None
    while first is None:
        first = next(iter(src.step()), None)
        await asyncio.sleep(0)  # the worker's event loop runs between passes
    finishing = asyncio.create_task(sender.finish(rid, first.new_token_ids[0], lease_s=10))
    if before_wait is not None:
        await before_wait(bus, sender)
    try:
        first_token = await asyncio.wait_for(rx.wait(), 10)
    except KVFailed:
        await bus.publish(subjects.prefill_kv_ack("p"), KVAck(request_id=rid, ok=False, error="failed", kv_tag=1 << 20),
                          secret=SECRET)
        await finishing
        src.free(rid)
        dst.abort(rid)
        raise
    out = dst.commit_import(rid, first_token)
    await inbox.ack("p", KVAck(request_id=rid, ok=True, kv_tag=1 << 20), SECRET)
    inbox.receivers.pop(rid)
    ack = await finishing
    assert ack.ok
    src.free(rid)
    return out.new_token_ids + tokens(run_all(dst).get(rid, [])), h, rx, bus


@pytest.mark.parametrize("layers_per_message", [1, 2, "all"])
def test_layers_stream_per_pass_and_the_output_is_unchanged(tiny, layers_per_message):
    layers, block_nbytes = tiny.config.num_layers, Engine(tiny, EngineConfig(num_blocks=4)).runner.kv[0][0].nbytes
    per = layers if layers_per_message == "all" else layers_per_message
    piece_bytes = {1: 0, 2: 2 * 2 * block_nbytes, "all": 8 << 20}[layers_per_message]  # 2 blocks a layer a pass
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    out, h, rx, bus = asyncio.run(handoff(src, dst, piece_bytes=piece_bytes))
    assert out == expected(tiny)
    notices = bus.of_type(KVLayer)
    # pass 1 completes blocks 0-1 (tokens 0-31), pass 2 blocks 2-3, pass 3 blocks 4-5 (the last partial)
    assert sorted({(n.first_block, n.num_blocks) for n in notices}) == [(0, 2), (2, 2), (4, 2)]
    per_pass = -(-layers // per)   # a message never spans two passes: the last layer sends what is left
    assert len(notices) == 3 * per_pass and h.pieces == rx.pieces == 3 * per_pass
    for first in (0, 2, 4):  # every layer of every pass exactly once, in consecutive runs
        runs = sorted((n.layer, n.num_layers) for n in notices if n.first_block == first)
        assert [lay for lay, _ in runs] == list(range(0, layers, per)) and sum(k for _, k in runs) == layers
    assert h.bytes_sent == rx.bytes_received == 6 * layers * block_nbytes
    assert src.num_free_blocks == src.num_blocks and dst.num_free_blocks == dst.num_blocks


def test_staging_buffers_are_reused_from_one_handoff_to_the_next(tiny, monkeypatch):
    staging = Staging()
    monkeypatch.setattr(receiver, "STAGING", staging)
    for rid in ("a", "b"):
        src, dst = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=64))
        out, _, rx, _ = asyncio.run(handoff(src, dst, rid=rid, piece_bytes=1))  # a message per layer
        assert out == expected(tiny)
    assert staging.reused >= rx.pieces and staging.made <= rx.pieces  # the second handoff made none


def test_streamed_pieces_equal_the_pool_after_the_prefill(tiny):
    eng = Engine(tiny, EngineConfig(**CHUNKED))
    pieces = []
    eng.add_request("r", PROMPT, PARAMS, prefill_only=True)
    eng.stream_kv("r", 1, lambda p: pieces.append((p.layer, p.first_block, p.data.clone())))
    while not eng.step():
        pass
    export = eng.export_kv("r", first_block=1)
    for layer in range(tiny.config.num_layers):
        got = sorted((first, data) for lay, first, data in pieces if lay == layer)
        assert [f for f, _ in got] == [1, 2, 4]   # block 0 is the receiver's already
        assert np.array_equal(np.concatenate([d.numpy() for _, d in got]), export.layer(layer).numpy())


@pytest.mark.parametrize("piece_bytes", [0, 8 << 20], ids=["per-layer", "per-pass"])
def test_a_corrupted_byte_is_caught_every_time_and_resent(tiny, piece_bytes):
    """Every first send has one byte flipped: each is caught by its block checksum, only the
    bad block of the bad layer is sent again, and the output is unchanged."""
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    out, h, rx, bus = asyncio.run(handoff(src, dst, faults=Faults(corrupt_rate=1.0, corrupt_sends=1),
                                          piece_bytes=piece_bytes))
    assert out == expected(tiny)
    first_sends = 3 * (tiny.config.num_layers if piece_bytes == 0 else 1)
    assert rx.bad_blocks == first_sends == rx.resends == len(bus.of_type(KVResend))
    assert h.resent_blocks == first_sends   # one block per corrupted payload, not the whole message
    assert all(n.resend == 1 and n.num_layers == 1 for n in bus.of_type(KVLayer)[first_sends:])


def test_kv_that_stays_corrupt_fails_after_bounded_tries(tiny):
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    with pytest.raises(KVFailed, match="still corrupt after 2 sends"):
        asyncio.run(handoff(src, dst, faults=Faults(corrupt_rate=1.0, corrupt_sends=99), max_sends=2))
    assert src.num_free_blocks == src.num_blocks and dst.num_free_blocks == dst.num_blocks


def test_a_fingerprint_mismatch_is_refused_before_any_byte_moves(tiny):
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    with pytest.raises(KVFailed, match="fingerprint mismatch"):
        asyncio.run(handoff(src, dst, fingerprint="other-model"))
    assert src.num_free_blocks == src.num_blocks and dst.num_free_blocks == dst.num_blocks


def test_only_the_blocks_the_receiver_lacks_cross(tiny):
    """Second turn: the decode engine holds the first turn's blocks; only the rest is sent."""
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    turn1 = PROMPT[:50]
    out1, h1, _, _ = asyncio.run(handoff(src, dst, prompt=turn1, rid="t1"))
    out2, h2, rx, _ = asyncio.run(handoff(src, dst, prompt=PROMPT, rid="t2"))
    assert out2 == expected(tiny)
    block_nbytes, layers = dst.runner.kv[0][0].nbytes, tiny.config.num_layers
    assert h1.bytes_sent == 4 * layers * block_nbytes          # 50 tokens: 4 blocks
    assert h2.bytes_sent == (6 - 3) * layers * block_nbytes    # 3 full blocks cached on dst


def test_int8_encoding_moves_a_quarter_of_the_bytes_and_stays_within_half_a_step(tiny):
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    written = {}
    write = dst.write_kv

    def spy(layer, ids, data):
        written.setdefault(layer, []).append((ids[0], data.clone()))
        write(layer, ids, data)

    dst.write_kv = spy
    out, h, rx, bus = asyncio.run(handoff(src, dst, encoding="int8"))
    layers, kvh, hd = tiny.config.num_layers, tiny.config.num_kv_heads, tiny.config.head_dim
    int8_block = 2 * 16 * kvh * hd + (kvh * hd + 16 * kvh) * 4     # values + fp32 scales: K per channel, V per token
    assert h.bytes_sent == rx.bytes_received == 6 * layers * int8_block
    assert int8_block < dst.runner.kv[0][0].nbytes / 2.5                 # fp32 pool
    assert all(n.encoding == "int8" for n in bus.of_type(KVLayer)) and len(out) == PARAMS.max_tokens
    ref = Engine(tiny, EngineConfig(num_blocks=64))
    ref.add_request("x", PROMPT, PARAMS, prefill_only=True)
    while not ref.step():
        pass
    exact = ref.export_kv("x")
    for layer in range(layers):
        got = torch.cat([data for _, data in sorted(written[layer], key=lambda w: w[0])])
        want = exact.layer(layer)
        assert ((got - want).abs() <= _half_steps(want) + 1e-6).all() and not torch.equal(got, want)


def test_a_corrupted_int8_block_is_caught_too(tiny):
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    _, h, rx, _ = asyncio.run(handoff(src, dst, encoding="int8", faults=Faults(corrupt_rate=1.0), piece_bytes=0))
    assert rx.bad_blocks == h.resent_blocks == 3 * tiny.config.num_layers


def test_codec_round_trips():
    from pdserve.shared.kv import codec

    blocks = torch.randn(5, 2, 16, 3, 8) * torch.tensor([1.0, 10.0]).reshape(1, 2, 1, 1, 1)
    native = codec.encode("native", blocks)
    assert native.shape == (5, codec.block_nbytes("native", (2, 16, 3, 8), torch.float32))
    assert torch.equal(codec.decode("native", native, (2, 16, 3, 8), torch.float32), blocks)
    blocks[:, 0, :, :, 5] *= 30    # an outlier key channel: per-channel scales keep the others fine
    q = codec.encode("int8", blocks)
    assert q.shape == (5, codec.block_nbytes("int8", (2, 16, 3, 8), torch.float32)) == (5, 768 + (24 + 48) * 4)
    back = codec.decode("int8", q, (2, 16, 3, 8), torch.float32)
    assert ((back - blocks).abs() <= _half_steps(blocks) + 1e-6).all() and not torch.equal(back, blocks)


def _half_steps(blocks: torch.Tensor) -> torch.Tensor:
    """Half a quantization step for every value: keys per channel, values per token."""
    k = blocks[:, 0].abs().amax(dim=1, keepdim=True).expand_as(blocks[:, 0])
    v = blocks[:, 1].abs().amax(dim=3, keepdim=True).expand_as(blocks[:, 1])
    return torch.stack([k, v], dim=1) / 127 / 2


def test_notices_lost_with_the_bus_come_again_on_a_sync_and_no_payload_is_received_twice(tiny):
    """The bus loses every notice and the KVEnd of a handoff (a NATS restart); the decode
    side's KVSync has them published again; the payloads were waiting in the transport."""
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    bus = LocalBus()
    bus.lose = lambda subject: subject.startswith("pd.decode.d.kv")

    async def reconnect(bus, sender):
        while not bus.of_type(KVEnd):
            await asyncio.sleep(0.01)
        bus.lose = lambda subject: False
        await bus.publish(subjects.prefill_kv_sync("p"), KVSync(request_id="r"), secret=SECRET)
        await asyncio.sleep(0.05)
        await bus.publish(subjects.prefill_kv_sync("p"), KVSync(request_id="r"), secret=SECRET)  # a second round

    out, h, rx, bus = asyncio.run(handoff(src, dst, bus=bus, before_wait=reconnect))
    assert out == expected(tiny)
    assert len(bus.of_type(KVLayer)) == 3 * 3 and len(bus.of_type(KVEnd)) == 3   # each sent 3 times
    assert rx.pieces == h.pieces == 3 and rx.bytes_received == h.bytes_sent   # each payload received once
    assert src.num_free_blocks == src.num_blocks and dst.num_free_blocks == dst.num_blocks


def test_notices_the_bus_refuses_end_nothing_and_go_out_again_on_a_sync(tiny):
    """The bus raises on every notice and the KVEnd (away with its buffer full): the sender
    keeps them and its payloads go on; the decode side's KVSync has them published again."""
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    bus = LocalBus()
    bus.refuse = lambda subject: subject.startswith("pd.decode.d.kv")

    async def reconnect(bus, sender):
        while subjects.decode_kv_end("d") not in bus.refused:
            await asyncio.sleep(0.01)
        bus.refuse = lambda subject: False
        await bus.publish(subjects.prefill_kv_sync("p"), KVSync(request_id="r"), secret=SECRET)

    out, h, rx, bus = asyncio.run(handoff(src, dst, bus=bus, before_wait=reconnect))
    assert out == expected(tiny)
    assert len(bus.refused) == 3 + 1 and len(bus.of_type(KVLayer)) == 3 and len(bus.of_type(KVEnd)) == 1
    assert rx.pieces == h.pieces == 3 and not h.error   # each payload sent once, the handoff not failed


def test_an_ack_lost_with_the_bus_is_given_again_when_the_prefill_side_publishes_its_handoff_again(tiny):
    """The decode side's ack is lost (a NATS restart); the prefill worker, reconnected,
    publishes its open handoff again and the decode side, which has no receiver for it any
    more, answers with the ack it gave: the blocks are freed now, not when the lease ends."""
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    bus = LocalBus()
    bus.lose = lambda subject: subject == subjects.prefill_kv_ack("p")

    async def reconnect(bus, sender):
        async def later():
            while not bus.of_type(KVAck):
                await asyncio.sleep(0.01)
            bus.lose = lambda subject: False
            await sender.resync()
        asyncio.get_running_loop().create_task(later())

    t0 = time.monotonic()
    out, h, rx, bus = asyncio.run(handoff(src, dst, bus=bus, before_wait=reconnect))
    assert out == expected(tiny)
    acks = bus.of_type(KVAck)
    assert len(acks) == 2 and all(a.ok for a in acks) and len(bus.of_type(KVEnd)) == 2
    assert time.monotonic() - t0 < 5   # the lease is 10 s


def test_a_decode_side_answers_what_it_has_no_receiver_for(tiny):
    """Ends get the answer given (or a refusal); notices of an unknown request a refusal once."""
    async def scenario():
        bus = LocalBus()
        inbox = KVInbox(bus, "d")
        await inbox.start()
        await inbox.ack("p", KVAck(request_id="done", ok=True), SECRET)
        for rid in ("done", "done", "gone"):
            await bus.publish(subjects.decode_kv_end("d"), KVEnd(request_id=rid, ok=True, first_token=1,
                                                                 prefill_worker="p"))
        for _ in range(3):
            await bus.publish(subjects.decode_kv("d"), KVLayer(
                request_id="other", prefill_worker="p", fingerprint="f", tag=1, layer=0, num_blocks=1,
                first_block=0, checksums=[0]))
        await asyncio.sleep(0.05)
        return [(a.request_id, a.ok, a.error) for a in bus.of_type(KVAck)]

    assert asyncio.run(scenario()) == [("done", True, ""), ("done", True, ""), ("done", True, ""),
                                       ("gone", False, "no reservation"), ("other", False, "no reservation")]


def test_a_sender_other_than_the_receivers_is_refused_and_nothing_of_it_is_mixed_in(tiny):
    """A job moved off a prefill worker thought lost: whatever that worker still sends for the
    request is refused (it stops), and the receiver, waiting for the new worker, is untouched."""
    async def scenario():
        bus = LocalBus()
        dst = Engine(tiny, EngineConfig(num_blocks=64))
        rx = await receiving(dst, bus, "new")
        await bus.publish(subjects.decode_kv("d"), KVLayer(
            request_id="r", prefill_worker="lost", fingerprint=dst.fingerprint, tag=1 << 20, layer=0, num_blocks=1,
            first_block=0, checksums=[0]), secret=SECRET)
        await bus.publish(subjects.decode_kv_end("d"), KVEnd(request_id="r", ok=True, first_token=1,
                                                             prefill_worker="lost", kv_tag=1 << 20), secret=SECRET)
        await asyncio.sleep(0.05)
        return rx, [(a.request_id, a.ok, a.error) for a in bus.of_type(KVAck)]

    rx, acks = asyncio.run(scenario())
    assert acks == [("r", False, "moved to another handoff of the request")] * 2
    assert not rx.outcome.done() and not rx.tags and rx.first_token is None


def test_an_older_placements_handoff_from_the_same_sender_is_refused_and_its_answer_ends_only_it(tiny):
    """A failover placed on the same decode worker, its job on the same prefill worker: the
    old handoff's notices and end (another tag range) are refused without touching the new
    receiver, and the refusal (addressed by tag) ends the old handoff alone on the sender."""
    async def scenario():
        bus, stopped = LocalBus(), []

        async def given_up(job, reason):
            stopped.append((job.kv_tag, reason))

        dst = Engine(tiny, EngineConfig(num_blocks=64))
        rx = await receiving(dst, bus, "p", kv_tag=2 << 20)
        sender = KVSender(SenderSettings("p", dst.fingerprint), create_transport("fake"), bus,
                          WorkerHooks(None, given_up))
        await sender.start()
        job = PrefillJob(request_id="r", prompt_token_ids=PROMPT, sampling=Sampling(), decode_worker="d",
                         decode_address="x", decode_fingerprint=dst.fingerprint, first_block=0, kv_tag=1 << 20,
                         secret=SECRET)
        await sender.open(job)
        await bus.publish(subjects.decode_kv("d"), KVLayer(
            request_id="r", prefill_worker="p", fingerprint=dst.fingerprint, tag=(1 << 20) + 3, layer=0,
            num_blocks=1, first_block=0, checksums=[0]), secret=SECRET)
        await bus.publish(subjects.decode_kv_end("d"), KVEnd(request_id="r", ok=True, first_token=1,
                                                             prefill_worker="p", kv_tag=1 << 20), secret=SECRET)
        await bus.publish(subjects.prefill_kv_ack("p"), KVAck(request_id="r", ok=False, error="x", kv_tag=2 << 20),
                          secret=SECRET)
        await asyncio.sleep(0.05)
        return rx, sender.handoffs["r"].acked, stopped, [(a.kv_tag, a.error) for a in bus.of_type(KVAck)]

    rx, acked, stopped, acks = asyncio.run(scenario())
    assert not rx.outcome.done() and not rx.tags and rx.first_token is None
    assert sorted(acks) == [(1 << 20, "moved to another handoff of the request")] * 2 + [(2 << 20, "x")]
    assert acked.done() and not acked.result().ok and acked.result().kv_tag == 1 << 20  # ended by its own refusal
    assert stopped == [(1 << 20, "moved to another handoff of the request")]  # the other tag's ack ignored


def test_a_decode_side_that_gives_up_stops_the_prefill_side_once(tiny):
    """KVAck(not ok) before the end (the decode side's deadline, a cancel, a refusal): the
    sender hands the job to `given_up` (the worker aborts its compute), once."""
    async def scenario():
        bus, stopped = LocalBus(), []

        async def given_up(job, reason):
            stopped.append((job.request_id, reason))

        src = Engine(tiny, EngineConfig(num_blocks=64))
        sender = KVSender(SenderSettings("p", src.fingerprint), create_transport("fake"), bus,
                          WorkerHooks(None, given_up))
        await sender.start()
        job = PrefillJob(request_id="r", prompt_token_ids=PROMPT, sampling=Sampling(), decode_worker="d",
                         decode_address="x", decode_fingerprint=src.fingerprint, first_block=0, kv_tag=1 << 20,
                         secret=SECRET)
        await sender.open(job)
        for error in ("deadline passed", "cancelled"):
            ack = KVAck(request_id="r", ok=False, error=error, kv_tag=1 << 20)
            await bus.publish(subjects.prefill_kv_ack("p"), ack, secret=SECRET)
        await asyncio.sleep(0.05)
        return stopped, sender.handoffs["r"].acked.result()

    stopped, ack = asyncio.run(scenario())
    assert stopped == [("r", "deadline passed")] and not ack.ok


def test_a_payload_the_transport_loses_breaks_the_handoff_off_instead_of_failing_it_as_bad(tiny, monkeypatch):
    """The sender died mid-transfer: UCX fails the receive. The receiver fails with
    KVBrokeOff (the decode worker moves the job to another prefill worker), not as bad KV
    (which it would prefill itself). Its staging buffer is not given back: a transport may
    still write one whose receive failed or was given up."""
    staging = Staging()
    monkeypatch.setattr(receiver, "STAGING", staging)

    class Broken:
        async def recv(self, tag, out):
            raise OSError("Input/output error")

    async def scenario():
        bus = LocalBus()
        dst = Engine(tiny, EngineConfig(num_blocks=64))
        rx = await receiving(dst, bus, "p", transport=Broken())
        await bus.publish(subjects.decode_kv("d"), KVLayer(
            request_id="r", prefill_worker="p", fingerprint=dst.fingerprint, tag=(1 << 20) + 1, layer=0,
            num_blocks=1, first_block=0, checksums=[0]), secret=SECRET)
        with pytest.raises(KVBrokeOff, match="broke off: Input/output error"):
            await asyncio.wait_for(rx.wait(), 5)

    asyncio.run(scenario())
    assert staging.made == 1 and staging.idle_bytes == 0


@pytest.fixture
def segment_of():
    """Segments of prefill worker "p" (the handoffs' sender), closed after the test (its
    address is free again)."""
    made: list[Segment] = []

    def make(nbytes: int, owner: str = "p") -> Segment:
        made.append(Segment(nbytes, owner))
        return made[-1]

    yield make
    for segment in made:
        segment.close()


@pytest.mark.parametrize("piece_bytes", [0, 8 << 20], ids=["per-layer", "per-pass"])
def test_kv_to_the_same_host_goes_through_the_segment_and_its_regions_are_free_after_the_ack(tiny, piece_bytes,
                                                                                             segment_of):
    segment = segment_of(16 << 20)
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    out, h, rx, bus = asyncio.run(handoff(src, dst, piece_bytes=piece_bytes, segment=segment))
    assert out == expected(tiny)
    notices = bus.of_type(KVLayer)
    assert notices and all(n.segment is not None and n.segment.inode == segment.inode for n in notices)
    assert h.segment_bytes == h.bytes_sent == rx.bytes_received > 0
    assert segment.extents.used_bytes == 0 and segment.extents.free == [(0, 16 << 20)]
    assert not h.placed and segment.full == 0


def test_a_byte_corrupted_in_the_segment_is_caught_and_resent(tiny, segment_of):
    segment = segment_of(16 << 20)
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    out, h, rx, bus = asyncio.run(handoff(src, dst, faults=Faults(corrupt_rate=1.0, corrupt_sends=1),
                                          segment=segment))
    assert out == expected(tiny)
    assert rx.bad_blocks == 3 == len(bus.of_type(KVResend)) and h.resent_blocks == 3
    assert all(n.segment is not None for n in bus.of_type(KVLayer))  # the re-sends too
    assert segment.extents.used_bytes == 0


def test_a_full_segment_sends_over_the_transport_and_another_host_never_uses_it(tiny, segment_of):
    block_nbytes = Engine(tiny, EngineConfig(num_blocks=4)).runner.kv[0][0].nbytes
    segment = segment_of(4096)  # smaller than any payload
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    out, h, _, bus = asyncio.run(handoff(src, dst, piece_bytes=0, segment=segment))
    assert out == expected(tiny)
    assert all(n.num_layers * n.num_blocks * block_nbytes > 4096 for n in bus.of_type(KVLayer))
    assert all(n.segment is None for n in bus.of_type(KVLayer)) and h.segment_bytes == 0
    assert segment.full == len(bus.of_type(KVLayer))

    segment = segment_of(16 << 20, "p-2")  # room enough, but the decode worker is on another host
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    out, h, _, bus = asyncio.run(handoff(src, dst, piece_bytes=0, segment=segment, decode_host="elsewhere"))
    assert out == expected(tiny) and h.segment_bytes == 0 and segment.full == 0
    assert all(n.segment is None for n in bus.of_type(KVLayer))


def test_with_no_transport_the_segment_alone_carries_kv_on_one_host_and_another_hosts_handoff_fails(
        tiny, segment_of):
    """PD_KV_TRANSPORT=none (no UCX loaded): same-host KV goes through the segment as ever; KV the
    segment cannot carry fails its handoff, and the decode worker prefills the prompt itself."""
    segment = segment_of(16 << 20)
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    out, h, _, bus = asyncio.run(handoff(src, dst, segment=segment, transport="none"))
    assert out == expected(tiny) and h.segment_bytes == h.bytes_sent > 0
    assert all(n.segment is not None for n in bus.of_type(KVLayer))
    assert segment.extents.used_bytes == 0
    none = SameHost(create_transport("none"), segment)
    assert none.place("elsewhere", 64) is None and none.address == ""   # another host: it would go on a tag
    with pytest.raises(ConnectionError, match="no KV transport"):        # where nothing carries it: the
        asyncio.run(none.send("peer", 1, np.zeros(64, np.uint8)))        # handoff fails (its sender cancels)


def test_handoff_messages_without_the_placements_mac_are_dropped_and_counted_both_ways(tiny):
    """Another process on the bus (any worker's credentials publish on these subjects) tries
    to fail the handoff, end it with its own first token, or stop the sender: with no MAC,
    or another placement's, nothing changes on either side; the wildcard sender and tag of
    old ("" and 0) name no handoff."""
    from pdserve.shared import metrics

    other = "0f" * 16

    async def scenario():
        bus = LocalBus()
        dst = Engine(tiny, EngineConfig(num_blocks=64))
        rx = await receiving(dst, bus, "p")
        sender = KVSender(SenderSettings("p", dst.fingerprint), create_transport("fake"), bus, WorkerHooks(None))
        await sender.start()
        await sender.open(PrefillJob(request_id="r", prompt_token_ids=PROMPT, sampling=Sampling(), decode_worker="d",
                                     decode_address="x", decode_fingerprint=dst.fingerprint, first_block=0,
                                     kv_tag=1 << 20, secret=SECRET))
        for secret in ("", other):
            await bus.publish(subjects.decode_kv_end("d"), KVEnd(request_id="r", ok=False, error="forged",
                                                                 prefill_worker="p", kv_tag=1 << 20), secret=secret)
            await bus.publish(subjects.decode_kv_end("d"), KVEnd(request_id="r", ok=True, first_token=666,
                                                                 prefill_worker="p", kv_tag=1 << 20), secret=secret)
            await bus.publish(subjects.prefill_kv_ack("p"), KVAck(request_id="r", ok=False, error="forged",
                                                                  kv_tag=1 << 20), secret=secret)
            await bus.publish(subjects.prefill_kv_resend("p"), KVResend(request_id="r", layer=0, first_block=0,
                                                                        num_blocks=1, resend=1), secret=secret)
        wildcard = KVEnd(request_id="r", ok=False, error="wildcard")   # prefill_worker "", kv_tag 0
        await bus.publish(subjects.decode_kv_end("d"), wildcard, secret=SECRET)
        await asyncio.sleep(0.05)
        return rx, sender.handoffs["r"]

    before = metrics.FORGED_MESSAGES._value.get()
    rx, h = asyncio.run(scenario())
    assert not rx.outcome.done() and rx.end is None and rx.first_token is None
    assert not h.acked.done() and h.resent_blocks == 0
    assert metrics.FORGED_MESSAGES._value.get() == before + 8


@pytest.mark.parametrize("piece_bytes", [0, 8 << 20], ids=["per-layer", "per-pass"])
def test_kv_on_the_device_is_read_from_the_senders_pool_and_lands_as_the_host_paths_does(tiny, piece_bytes):
    """Device-direct KV on one host (pdserve/shared/engine/kv_device.py) with the CPU stand-in of the IPC
    handle, the prefill pool in shared memory: each notice names blocks of that pool and their sums, no
    payload moves, and the decode pool ends exactly as the host path leaves it."""
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    out, h, rx, bus = asyncio.run(handoff(src, dst, piece_bytes=piece_bytes, pool=kv_device.share(src.runner.kv)))
    assert out == expected(tiny)
    notices = bus.of_type(KVLayer)
    assert notices and all(n.device is not None and n.segment is None for n in notices)
    assert all(len(n.device.block_ids) == n.num_blocks for n in notices if n.device is not None)
    assert h.device_bytes == h.bytes_sent == rx.bytes_received > 0 and rx.bad_blocks == 0
    host_src, host_dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    host_out, host_h, _, _ = asyncio.run(handoff(host_src, host_dst, piece_bytes=piece_bytes))
    assert host_out == out and host_h.device_bytes == 0
    assert torch.equal(dst.runner.kv, host_dst.runner.kv)


def test_a_wrong_sum_on_the_device_path_is_refused_and_its_block_comes_over_the_host_path(tiny):
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    out, h, rx, bus = asyncio.run(handoff(src, dst, faults=Faults(corrupt_rate=1.0, corrupt_sends=1),
                                          pool=kv_device.share(src.runner.kv)))
    assert out == expected(tiny)
    first = [n for n in bus.of_type(KVLayer) if n.resend == 0]
    again = [n for n in bus.of_type(KVLayer) if n.resend > 0]
    assert len(first) == 3 and all(n.device is not None for n in first)   # (one per pass)
    assert rx.bad_blocks == rx.resends == h.resent_blocks == len(again) == 3
    assert all(n.device is None and n.num_blocks == 1 for n in again)


def test_kv_that_stays_wrong_on_the_device_path_fails_after_bounded_tries(tiny):
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    with pytest.raises(KVFailed, match="still corrupt after 2 sends"):
        asyncio.run(handoff(src, dst, faults=Faults(corrupt_rate=1.0, corrupt_sends=99), max_sends=2,
                            pool=kv_device.share(src.runner.kv)))


def test_the_device_path_is_taken_only_for_a_decode_worker_on_this_host_that_reads_pools(tiny):
    src, dst = Engine(tiny, EngineConfig(**CHUNKED)), Engine(tiny, EngineConfig(num_blocks=64))
    pool = kv_device.share(src.runner.kv)
    out, h, _, bus = asyncio.run(handoff(src, dst, pool=pool, decode_host="elsewhere"))
    assert out == expected(tiny) and h.device_bytes == 0
    assert all(n.device is None for n in bus.of_type(KVLayer))
