"""Prefill side of KV handoffs: stream each computed layer to the decode worker, keep the
blocks until it acknowledges (the lease), answer its re-send requests.

One Handoff per request:
1. `open(job, ctx)` before the prompt is queued: returns the sink for `Engine.stream_kv`, or
   None when the decode worker's fingerprint (model, dtype, block layout) differs from ours —
   then KVEnd(not ok) goes out at once and nothing streams.
2. KVPieces (one layer each, handed over from the engine thread while the pass goes on) are
   gathered into a batch of consecutive layers until it holds `piece_bytes` or the pass's
   last layer is in (`batch_ready`); each batch is encoded (pdserve/shared/kv/codec.py), checksummed
   per block, announced by one KVLayer notice on NATS and sent over the transport on a fresh
   tag — or, to a decode worker on this host, written into this worker's shared-memory
   segment (pdserve/shared/kv/segment.py) where the notice says, and not sent at all; its region is
   held until the handoff ends. Where both pools are on a device (device-direct: the decode worker
   says `decode_device`, pdserve/shared/engine/kv_device.py), the layers stay in the pool: the
   notice names their blocks and carries sums computed on the device, and the decode worker reads
   them itself; re-sent blocks take the host path. A short prompt costs one message, not one per layer: each
   message takes event-loop time (and the GIL) from the pass it overlaps.
   A KVAck(not ok) at any time — the decode side gave up (its deadline, a cancel, a refusal)
   — ends the handoff and is passed to `given_up`: the prefill worker stops computing.
3. `finish(rid, first_token, lease_s)` after the prompt's last pass: KVEnd(ok, first token
   and, when the request asks, its log probabilities and the prompt's),
   then wait for the KVAck; KVResend requests are answered meanwhile (re-read from the pool,
   re-send n, fresh tag). The lease ends at the ack, at `lease_s`, or at `cancel`. Acks and
   re-send requests come to this worker alone (`pd.prefill.<id>.kv.ack`, `.kv.resend`): each
   notice names its sender.
4. `cancel(rid, reason)`: KVEnd(not ok) — the explicit failure message — and the lease ends.
5. After a reconnect of either side's bus (KVSync from the decode side, or `resync` here): the
   notices and KVEnd published so far go out again; the payloads are still in the transport.
   A decode side with no receiver for them answers with the ack it gave, or a refusal.
The caller frees the request's blocks once `finish` returns; the handoff's segment regions
are given back then too (or at `drop`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from nats.aio.msg import Msg
from opentelemetry import context, trace

from pdserve.shared import macs, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.config import PrefillSettings
from pdserve.shared.engine import kv_device
from pdserve.shared.engine.kv_io import KVPiece, OnDevice
from pdserve.shared.engine.logprobs import Logprob
from pdserve.shared.kv import codec
from pdserve.shared.kv.base import TAG_SPAN, KVTransport, block_checksums
from pdserve.shared.messages import DeviceRef, KVAck, KVEnd, KVLayer, KVResend, KVSync, PrefillJob, SegmentRef
from pdserve.shared.tasks import Background

log = logging.getLogger("kv.sender")
ReadBlocks = Callable[[str, int, int, int], Awaitable[torch.Tensor]]  # rid, layer, first, n
GivenUp = Callable[[PrefillJob, str], Coroutine[Any, Any, None]]  # the job, the decode side's reason


@dataclass
class Handoff:
    job: PrefillJob
    ctx: context.Context | None                  # trace context carried by the notices
    acked: asyncio.Future                        # the decode side's KVAck
    new_endpoint: bool                           # no endpoint to this peer existed before
    same_host: bool = False                      # payloads go into this worker's segment when they fit
    device: bool = False                         # streamed layers stay in the pool: the decode side reads them
    next_tag: int = 0
    sends: set[asyncio.Task] = field(default_factory=set)
    pieces: int = 0
    bytes_sent: int = 0
    segment_bytes: int = 0                       # of those, placed in the segment
    device_bytes: int = 0                        # of those, read by the decode side from the pool
    resent_blocks: int = 0
    error: str = ""                              # why the prefill side gave it up
    batch: list[KVPiece] = field(default_factory=list)  # layers not handed over yet (engine thread only)
    batch_bytes: int = 0
    notices: list[KVLayer] = field(default_factory=list)  # published, for a KVSync
    end: KVEnd | None = None                     # published
    placed: list[SegmentRef] = field(default_factory=list)  # segment regions, the handoff's until it ends
    closed: bool = False                         # finished or dropped: nothing more is placed


@dataclass(frozen=True)
class SenderSettings:
    """Who sends and how: this worker's id and model fingerprint, the sends a block gets, the
    payloads' encoding, and how many bytes of consecutive layers one message gathers."""

    worker_id: str
    fingerprint: str
    max_sends: int = 3
    encoding: codec.Encoding = "native"
    piece_bytes: int = 8 << 20

    @classmethod
    def for_prefill(cls, settings: PrefillSettings, worker_id: str, fingerprint: str) -> SenderSettings:
        return cls(worker_id, fingerprint, settings.kv_max_sends, settings.kv_transfer_encoding,
                   settings.kv_piece_bytes)


@dataclass(frozen=True)
class WorkerHooks:
    """What the sender asks of its prefill worker: blocks read again from the pool (a re-send),
    and word that the decode side ended a handoff not ok before its ack (stop computing it)."""

    read_blocks: ReadBlocks
    given_up: GivenUp | None = None


class KVSender:
    def __init__(self, settings: SenderSettings, transport: KVTransport, bus: Bus, worker: WorkerHooks):
        self.settings, self.transport, self.bus, self.worker = settings, transport, bus, worker
        self.giving_up = Background(log, "give-up")
        self.handoffs: dict[str, Handoff] = {}
        self.posts = Background(log, "KV notice + payload", logging.DEBUG)  # under way (failures: _send's)

    async def start(self) -> None:
        control = subjects.prefill_control(self.settings.worker_id)
        await self.bus.subscribe(control["kv_ack"], self.on_ack)
        await self.bus.subscribe(control["kv_resend"], self.on_resend)
        await self.bus.subscribe(control["kv_sync"], self.on_sync)

    # -- 1. open -------------------------------------------------------------------------------
    async def open(self, job: PrefillJob, ctx: context.Context | None = None) -> Callable[[KVPiece], None] | None:
        loop = asyncio.get_running_loop()
        if (older := self.handoffs.get(job.request_id)) is not None:  # (the worker ends one before taking
            self._close(older)                                         # the next; never two at once)
        same_host = job.decode_host == self.transport.host != ""
        h = Handoff(job, ctx, loop.create_future(), not self.transport.has_endpoint(job.decode_address), same_host,
                    device=same_host and job.decode_device == self.transport.device != "" and
                    self.transport.pool_handle != "")
        self.handoffs[job.request_id] = h
        if job.decode_fingerprint != self.settings.fingerprint:
            await self.cancel(job.request_id, f"fingerprint mismatch: decode {job.decode_fingerprint}, "
                                              f"prefill {self.settings.fingerprint}")
            return None
        def sink(piece: KVPiece) -> None:  # on the engine thread
            h.batch.append(piece)
            h.batch_bytes += piece.data.nbytes
            if batch_ready(h.batch_bytes, piece.last, self.settings.piece_bytes):
                batch, h.batch, h.batch_bytes = h.batch, [], 0
                loop.call_soon_threadsafe(self._start_send, h, batch, 0)
        return OnDevice(sink) if h.device else sink

    # -- 2. pieces -----------------------------------------------------------------------------
    def _start_send(self, h: Handoff, pieces: list[KVPiece], resend: int) -> None:
        if h.acked.done() or h.error or h.closed:
            return
        task = asyncio.create_task(self._send(h, pieces, resend))
        h.sends.add(task)
        task.add_done_callback(h.sends.discard)

    async def _send(self, h: Handoff, pieces: list[KVPiece], resend: int) -> None:
        """One message: consecutive layers of one run of blocks."""
        try:
            if pieces[-1].ready is not None:  # the gathers or the layers' kernels may still be running
                await asyncio.to_thread(pieces[-1].ready.synchronize)  # (recorded in order on one stream)
            made: tuple[KVLayer, np.ndarray | None] | None
            if h.device and pieces[0].block_ids:   # (a re-read names no blocks: it takes the host path)
                made = await self._on_device(h, pieces, resend)
            else:
                made = self._on_host(h, pieces, resend)
            if made is None or h.closed:
                return
            notice, payload = made
            h.pieces += 1
            # notice and payload go together: a cancellation between them would leave the decode
            # side a posted receive that nothing answers
            await asyncio.shield(self.posts.start(self._post(h, notice, payload)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever broke, the send is cancelled (the decode side prefills locally)
            log.warning("%s: KV send failed: %s", h.job.request_id, e)
            await self.cancel(h.job.request_id, f"send failed: {e}")

    def _on_host(self, h: Handoff, pieces: list[KVPiece], resend: int) -> tuple[KVLayer, np.ndarray] | None:
        """The notice and payload of pieces encoded on the host, checksummed with xxh3 (None: the
        handoff closed meanwhile)."""
        # (layers x n_blocks, bytes) on the host: for "native" on CPU a view of the pool when
        # it is one layer; a device tensor is staged to the host (checksums are of host bytes)
        rows = [codec.encode(self.settings.encoding, p.data) for p in pieces]
        if h.closed:
            return None
        ref, host = self._place(h, rows)
        h.bytes_sent += host.nbytes  # counted when handed over: the ack may beat the send's completion
        h.segment_bytes += host.nbytes if ref else 0
        notice = self._notice(h, pieces, resend, block_checksums(host), segment=ref)
        return notice, np.ascontiguousarray(host).reshape(-1)

    async def _on_device(self, h: Handoff, pieces: list[KVPiece], resend: int) -> tuple[KVLayer, None]:
        """The notice of pieces left in the pool for the decode side to read (device-direct): their
        blocks, and sums of their bytes computed on the device; no payload. Fault injection makes
        one sum wrong, as a changed byte would."""
        sums = await asyncio.to_thread(lambda: [s for p in pieces for s in kv_device.block_sums(p.data)])
        if self.transport.faults.strikes(resend):
            sums[random.randrange(len(sums))] ^= 1
            self.transport.corrupted += 1
        nbytes = sum(p.data.nbytes for p in pieces)
        h.bytes_sent += nbytes
        h.device_bytes += nbytes
        ref = DeviceRef(pool=self.transport.pool_handle, block_ids=list(pieces[0].block_ids))
        return self._notice(h, pieces, resend, sums, device=ref), None

    def _notice(self, h: Handoff, pieces: list[KVPiece], resend: int, checksums: list[int],
                segment: SegmentRef | None = None, device: DeviceRef | None = None) -> KVLayer:
        if h.next_tag >= TAG_SPAN:
            raise RuntimeError("handoff used up its tag range")
        tag, h.next_tag = h.job.kv_tag + h.next_tag, h.next_tag + 1
        first = pieces[0]
        return KVLayer(request_id=h.job.request_id, prefill_worker=self.settings.worker_id,
                       fingerprint=self.settings.fingerprint, tag=tag, layer=first.layer, num_layers=len(pieces),
                       first_block=first.first_block, num_blocks=first.num_blocks, checksums=checksums,
                       resend=resend, encoding=self.settings.encoding, segment=segment, device=device)

    def _place(self, h: Handoff, rows: list[np.ndarray]) -> tuple[SegmentRef | None, np.ndarray]:
        """The payload's bytes: where the transport places it for the decode worker to read in
        place (same host: a region of the segment, the handoff's until it ends) when it can,
        else in memory of their own (sent on its tag)."""
        region = self.transport.place(h.job.decode_host, sum(r.nbytes for r in rows)) if h.same_host else None
        if region is None:
            return None, rows[0] if len(rows) == 1 else np.concatenate(rows)
        ref, out = region
        h.placed.append(ref)
        host = out.reshape(-1, rows[0].shape[1])
        np.concatenate(rows, out=host)
        return ref, host

    async def _post(self, h: Handoff, notice: KVLayer, payload: np.ndarray | None) -> None:
        if notice.segment is not None or notice.device is not None:  # read in place: the transport's faults here
            await self.transport.faults.delay()
            if h.closed:  # its region (its blocks) may be another handoff's by now: nothing more of it goes out
                return
            if payload is not None:  # (the segment's bytes; a device notice's sums took their fault already)
                self.transport.corrupted += self.transport.faults.apply_in_place(payload, notice.resend)
        h.notices.append(notice)  # (the bus away: published again on the decode side's KVSync, or `resync`)
        await self.bus.tried("kv", self.bus.publish(subjects.decode_kv(h.job.decode_worker), notice, ctx=h.ctx,
                                                    secret=h.job.secret))
        if notice.segment is None and payload is not None:   # (a device notice has none: its blocks are read)
            await self.transport.send(h.job.decode_address, notice.tag, payload, notice.resend)

    async def on_resend(self, msg: Msg) -> None:
        req = KVResend.decode(msg.data)
        h = self.handoffs.get(req.request_id)
        if h is None or h.acked.done() or req.resend >= self.settings.max_sends \
                or not macs.signed_with(h.job.secret, msg):
            return
        try:
            data = await self.worker.read_blocks(req.request_id, req.layer, req.first_block, req.num_blocks)
        except (KeyError, ValueError) as e:  # freed meanwhile, or a range we never sent
            await self.cancel(req.request_id, f"cannot re-send: {e}")
            return
        h.resent_blocks += req.num_blocks
        trace.get_current_span(h.ctx).add_event("resend", {"layer": req.layer, "first_block": req.first_block,
                                                           "blocks": req.num_blocks, "resend": req.resend})
        self._start_send(h, [KVPiece(req.request_id, req.layer, req.first_block, data)], req.resend)

    async def on_sync(self, msg: Msg) -> None:
        """The decode side's bus was away while this handoff was open."""
        if (h := self.handoffs.get(KVSync.decode(msg.data).request_id)) is not None \
                and macs.signed_with(h.job.secret, msg):
            await self.publish_again(h)

    async def resync(self) -> None:
        """This worker's bus was away: every open handoff again (the decode side's answer, or
        what it had of the handoff, may be lost)."""
        for h in list(self.handoffs.values()):
            await self.publish_again(h)

    async def publish_again(self, h: Handoff) -> None:
        """Every notice and the end so far, again: a few small messages (the payloads wait in
        the transport under their tags; the receiver skips notices it has had)."""
        if h.acked.done():
            return
        for notice in list(h.notices):
            await self.bus.tried("kv", self.bus.publish(subjects.decode_kv(h.job.decode_worker), notice, ctx=h.ctx,
                                                        secret=h.job.secret))
        if h.end is not None:
            await self.bus.tried("kv_end", self.bus.publish(subjects.decode_kv_end(h.job.decode_worker), h.end,
                                                            ctx=h.ctx, secret=h.job.secret))

    # -- 3. finish: the lease ------------------------------------------------------------------
    async def finish(self, rid: str, first_token: int, lease_s: float, logprob: Logprob | None = None,
                     prompt_logprobs: list[Logprob | None] | None = None) -> KVAck:
        """KVEnd(ok), then the decode side's answer; the handoff is over when this returns."""
        h = self.handoffs[rid]
        try:
            if not h.error:
                await self._end(h, True, first_token=first_token, logprob=logprob, prompt_logprobs=prompt_logprobs)
            try:
                return await asyncio.wait_for(asyncio.shield(h.acked), lease_s)
            except TimeoutError:
                stuck = any(not t.done() for t in h.sends)
                await self._end(h, False, error="lease expired")
                if stuck:  # payloads never left: do not reuse that peer's endpoint
                    await self.transport.forget(h.job.decode_address)
                return KVAck(request_id=rid, ok=False, error=f"lease of {lease_s:g} s expired")
        finally:
            self._close(h)

    def drop(self, rid: str) -> Handoff | None:
        """Forget a handoff whose request ended before its last pass (its sends stop)."""
        h = self.handoffs.get(rid)
        if h is not None:
            self._close(h)
        return h

    def _close(self, h: Handoff) -> None:
        """The handoff is over: its sends stop, its segment regions are free to be written again."""
        h.closed = True
        for task in h.sends:
            task.cancel()
        if self.handoffs.get(h.job.request_id) is h:
            del self.handoffs[h.job.request_id]
        for ref in h.placed:
            self.transport.release(ref)
        h.placed.clear()

    # -- 4. failure ----------------------------------------------------------------------------
    async def cancel(self, rid: str, reason: str) -> None:
        h = self.handoffs.get(rid)
        if h is None:
            return
        h.error = h.error or reason
        await self._end(h, False, error=reason)
        if not h.acked.done():
            h.acked.set_result(KVAck(request_id=rid, ok=False, error=reason))

    async def on_ack(self, msg: Msg) -> None:
        ack = KVAck.decode(msg.data)
        h = self.handoffs.get(ack.request_id)
        if h is not None and not h.acked.done() and ack.kv_tag == h.job.kv_tag \
                and macs.signed_with(h.job.secret, msg):  # (another handoff's, or no placement's: not this)
            h.acked.set_result(ack)
            if not ack.ok and self.worker.given_up is not None:  # the decode side gave up: stop computing too (in
                self.giving_up.start(self.worker.given_up(h.job, ack.error))  # a task: it waits for the engine step)

    async def _end(self, h: Handoff, ok: bool, first_token: int = -1, error: str = "", logprob: Logprob | None = None,
                   prompt_logprobs: list[Logprob | None] | None = None) -> None:
        if h.end is not None:
            return
        h.error = h.error or error
        h.end = KVEnd(request_id=h.job.request_id, ok=ok, first_token=first_token, first_logprob=logprob,
                      prompt_logprobs=prompt_logprobs, error=error,
                      prefill_worker=self.settings.worker_id, kv_tag=h.job.kv_tag)
        await self.bus.tried("kv_end", self.bus.publish(subjects.decode_kv_end(h.job.decode_worker), h.end,
                                                        ctx=h.ctx, secret=h.job.secret))  # (kept, as the notices)


def batch_ready(batch_bytes: int, last_layer: bool, piece_bytes: int) -> bool:
    """Whether the layers gathered so far go out now: at the pass's last layer, or once they
    hold `piece_bytes` (so a long prompt still streams while its pass runs)."""
    return last_layer or batch_bytes >= piece_bytes
