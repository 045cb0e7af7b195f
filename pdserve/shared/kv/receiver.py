"""Decode side of one request's KV handoff: nothing unverified ever reaches the pool.

1. Made at admission, with the reservation (which of this engine's blocks to fill) and the
   tag range the sender must use.
2. Each KVLayer notice (one or more consecutive layers of a run of blocks): check the
   fingerprint, tag and layout against the reservation, then
   receive the payload (posted only now, when it is on its way) into a staging
   buffer (reused: pdserve/shared/kv/staging.py) — or copy it there from the sender's shared-memory
   segment when the notice says where (same host: pdserve/shared/kv/segment.py) — and check every
   block against its checksum; or, for a notice that names blocks of the sender's pool on its
   device (device-direct: pdserve/shared/engine/kv_device.py), gather them from that pool into a
   buffer on the device and check their sums there. Good blocks are decoded (native or
   int8, pdserve/shared/kv/codec.py) and written into the reservation; bad ones are asked for again
   (KVResend to the notice's sender, fresh tag) up to `max_sends` sends in all, then the
   handoff fails.
3. KVEnd: the first token — or the sender's explicit failure. Notices and ends of another
   handoff — from a sender other than the receiver's (a job moved off a prefill worker thought
   lost), or under another tag range (an older placement's) — are refused, never mixed in.
   Notices lost with the bus are published again on the decode worker's KVSync; a notice
   whose tag was had already is skipped.
4. `wait()` returns the first token once every layer of every expected block is verified and
   written and KVEnd(ok) is in; it raises KVFailed on any failure. The caller owns the
   deadline, the commit and the ack.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from nats.aio.msg import Msg

from pdserve.shared import macs, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.engine import kv_device
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.kv_io import Reservation
from pdserve.shared.kv import codec
from pdserve.shared.kv.base import TAG_SPAN, KVTransport, block_checksums
from pdserve.shared.kv.staging import Staging
from pdserve.shared.messages import CANCELLED, DeviceRef, KVAck, KVEnd, KVLayer, KVResend, KVSync

log = logging.getLogger("kv.receiver")
WriteBlocks = Callable[[int, list[int], torch.Tensor], None]  # layer, block ids, data
STAGING = Staging()  # this process's staging buffers, shared by its receivers (one event loop)


class KVFailed(RuntimeError):
    pass


class KVCancelled(KVFailed):
    """The prefill side ended the handoff because its placement was cancelled."""


class KVBrokeOff(KVFailed):
    """A payload never came: the transport failed its receive (the sender died mid-transfer,
    or the connection to it broke). Nothing bad was received; the sender may be gone."""


@dataclass(frozen=True)
class HandoffTerms:
    """One handoff as admission set it up: the blocks it fills, the tag range its sender must
    use, that sender (when known), and how many sends a block gets before the handoff fails."""

    reservation: Reservation
    kv_tag: int
    prefill_worker: str
    max_sends: int = 3
    secret: str = ""          # the placement's: both ways of the handoff signed with it (pdserve/shared/macs.py)


@dataclass(frozen=True)
class TargetPool:
    """The decode engine's KV pool as a receiver sees it: what a notice must match, how a
    block is laid out, and how verified blocks are written into it."""

    fingerprint: str
    num_layers: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    write: WriteBlocks

    @classmethod
    def of(cls, engine: Engine) -> TargetPool:
        pool = engine.runner.kv
        return cls(engine.fingerprint, pool.shape[0], tuple(pool.shape[2:]), pool.dtype, engine.write_kv)


class KVReceiver:
    def __init__(self, terms: HandoffTerms, pool: TargetPool, transport: KVTransport, bus: Bus):
        self.prefill_worker, self.secret = terms.prefill_worker, terms.secret  # the sender, the placement's secret
        self.res, self.kv_tag, self.max_sends = terms.reservation, terms.kv_tag, terms.max_sends
        self.pool, self.transport, self.bus = pool, transport, bus
        self.have = np.zeros((pool.num_layers, self.res.num_blocks - self.res.first_block), dtype=bool)
        self.end: KVEnd | None = None  # KVEnd(ok): the first token (and its log probabilities)
        self.outcome: asyncio.Future = asyncio.get_running_loop().create_future()  # the first token, or KVFailed
        self.tasks: set[asyncio.Task] = set()
        self.tags: set[int] = set()              # notices had (a KVSync publishes them again)
        self.bytes_received = self.pieces = self.bad_blocks = self.resends = 0

    @classmethod
    def for_engine(cls, engine: Engine, reservation: Reservation, kv_tag: int, transport: KVTransport,
                   bus: Bus, prefill_worker: str, max_sends: int = 3, secret: str = "") -> KVReceiver:
        return cls(HandoffTerms(reservation, kv_tag, prefill_worker, max_sends, secret), TargetPool.of(engine),
                   transport, bus)

    @property
    def rid(self) -> str:
        return self.res.request_id

    async def wait(self) -> int:
        self._check_done()
        return await self.outcome

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if not self.outcome.done():
            self.outcome.cancel()

    # -- notices -------------------------------------------------------------------------------
    def on_layer(self, notice: KVLayer) -> None:
        if self.outcome.done() or notice.tag in self.tags:
            return
        self.tags.add(notice.tag)
        task = asyncio.create_task(self._receive(notice))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def on_end(self, end: KVEnd) -> None:
        if not end.ok:
            self.fail(f"prefill side gave up: {end.error}", KVCancelled if end.error == CANCELLED else KVFailed)
            return
        self.end = end
        self._check_done()

    # -- one payload ---------------------------------------------------------------------------
    async def _receive(self, n: KVLayer) -> None:
        try:
            start = self._check(n)
            if n.device is not None:
                await self._pull(n, n.device, start)
            else:
                await self._take(n, start)
            self._check_done()
        except asyncio.CancelledError:
            raise
        except KVBrokeOff as e:
            self.fail(str(e), KVBrokeOff)
        except Exception as e:  # noqa: BLE001 - whatever broke, the handoff fails (the decode side prefills locally)
            self.fail(str(e) or type(e).__name__)

    async def _take(self, n: KVLayer, start: int) -> None:
        """A payload on the host path: received on its tag, or copied from the sender's segment."""
        nb = n.num_blocks
        row_bytes = codec.block_nbytes(n.encoding, self.pool.block_shape, self.pool.dtype)
        staged = STAGING.take(n.num_layers * nb * row_bytes)
        try:
            if n.segment is None:
                await self.transport.recv(n.tag, staged)
            else:   # (from the placed prefill worker's segment: no other)
                await self.transport.read(self.prefill_worker, n.segment, staged)
        except Exception as e:  # noqa: BLE001 - UCX's error types, or the segment gone: the peer failed
            raise KVBrokeOff(f"KV from {n.prefill_worker} broke off: {e or type(e).__name__}") from e
        try:
            buf = staged.reshape(n.num_layers * nb, row_bytes)
            self.bytes_received += buf.nbytes
            await self._store(n, start, block_checksums(buf), lambda a, b: codec.decode(
                n.encoding, buf[a:b], self.pool.block_shape, self.pool.dtype))
        finally:
            STAGING.give(staged)  # received in full: nothing writes it any more

    async def _pull(self, n: KVLayer, ref: DeviceRef, start: int) -> None:
        """A device notice's blocks, read from the sender's pool into a buffer on the device (off the event
        loop: the gather and the sums wait for the device), then stored as a received payload's."""
        layers, shape, dtype = (n.layer, n.num_layers), self.pool.block_shape, self.pool.dtype
        if len(ref.block_ids) != n.num_blocks:
            raise KVFailed(f"{len(ref.block_ids)} pool blocks named for {n.num_blocks}")

        def read() -> tuple[torch.Tensor, list[int]]:
            rows = self.transport.read_device(self.prefill_worker, ref, layers, shape, dtype)
            return rows, kv_device.block_sums(rows)
        try:
            rows, sums = await asyncio.to_thread(read)
        except OSError as e:   # (the pool cannot be opened here: its owner gone, or another kind)
            raise KVBrokeOff(f"KV from {n.prefill_worker}'s pool broke off: {e}") from e
        self.bytes_received += rows.nbytes
        await self._store(n, start, sums, lambda a, b: rows[a:b])

    async def _store(self, n: KVLayer, start: int, sums: list[int], blocks: Callable[[int, int], torch.Tensor]) -> None:
        """Verified blocks of a received payload into the reservation; bad ones asked for again.
        `sums`: each block's checksum as received (layer-major); `blocks(a, b)`: blocks [a, b) of it."""
        nb = n.num_blocks
        self.pieces += 1
        good = np.array([a == b for a, b in zip(sums, n.checksums)]).reshape(n.num_layers, nb)
        if not good.all():
            self.bad_blocks += int((~good).sum())
            if n.resend + 1 >= self.max_sends:
                raise KVFailed(f"layers {n.layer}+{n.num_layers}: {int((~good).sum())} blocks still corrupt "
                               f"after {n.resend + 1} sends")
            log.warning("%s: layers %d+%d: %d corrupt blocks; asking for them again", self.rid, n.layer,
                        n.num_layers, (~good).sum())
        for i, layer in enumerate(range(n.layer, n.layer + n.num_layers)):
            for a, b in _runs(good[i], True):  # verified blocks go into the reservation
                ids = list(self.res.block_ids[start + a:start + b])
                self.pool.write(layer, ids, blocks(i * nb + a, i * nb + b))
                self.have[layer, start + a:start + b] = True
            for a, b in _runs(good[i], False):  # asked for again, one layer at a time
                self.resends += 1
                await self.bus.publish(subjects.prefill_kv_resend(n.prefill_worker), KVResend(
                    request_id=self.rid, layer=layer, first_block=n.first_block + a, num_blocks=b - a,
                    resend=n.resend + 1), secret=self.secret)

    def _check(self, n: KVLayer) -> int:
        """The notice against the reservation; returns its first block's index in `have`."""
        if n.fingerprint != self.pool.fingerprint:
            raise KVFailed(f"model fingerprint {n.fingerprint} != {self.pool.fingerprint}")
        if not self.kv_tag <= n.tag < self.kv_tag + TAG_SPAN:
            raise KVFailed(f"tag {n.tag} outside this handoff's range")
        start = n.first_block - self.res.first_block
        if not (0 <= n.layer and n.num_layers > 0 and n.layer + n.num_layers <= self.have.shape[0]
                and 0 <= start and n.num_blocks > 0 and start + n.num_blocks <= self.have.shape[1]
                and len(n.checksums) == n.num_layers * n.num_blocks):
            raise KVFailed(f"layers {n.layer}+{n.num_layers}, blocks {n.first_block}+{n.num_blocks}: outside the "
                           f"reservation "
                           f"({self.have.shape[0]} layers, blocks {self.res.first_block}..{self.res.num_blocks})")
        return start

    def _check_done(self) -> None:
        if not self.outcome.done() and self.first_token is not None and self.have.all():
            self.outcome.set_result(self.first_token)

    @property
    def first_token(self) -> int | None:
        return None if self.end is None else self.end.first_token

    def fail(self, reason: str, failure: type[KVFailed] = KVFailed) -> None:
        if not self.outcome.done():
            self.outcome.set_exception(failure(reason))


class KVInbox:
    """One decode worker's KV notices (`pd.decode.<w>.kv`, `.kv.end`), routed to the receiver
    of their request. For a request with no receiver here (cancelled, expired, done, never
    admitted) the first notice or end gets KVAck(not ok, "no reservation") unless it was
    answered before, and each end gets the answer given (the sender may have lost it with
    the bus, and publishes its handoff again after a reconnect). Either ends its lease."""

    def __init__(self, bus: Bus, worker_id: str, answers_kept: int = 10_000):
        self.bus, self.worker_id = bus, worker_id
        self.receivers: dict[str, KVReceiver] = {}
        self.answers: OrderedDict[str, tuple[KVAck, str]] = OrderedDict()  # the latest acks given (and the
        # secret they were signed with), by request
        self.answers_kept = answers_kept

    async def start(self) -> None:
        await self.bus.subscribe(subjects.decode_kv(self.worker_id), self.on_layer)
        await self.bus.subscribe(subjects.decode_kv_end(self.worker_id), self.on_end)

    def add(self, rx: KVReceiver) -> KVReceiver:
        self.receivers[rx.rid] = rx
        return rx

    def close(self, rid: str) -> None:
        if (rx := self.receivers.pop(rid, None)) is not None:
            rx.close()

    async def ack(self, prefill_worker: str, ack: KVAck, secret: str) -> None:
        """The decode side's answer to a handoff, signed with its placement's secret (none: a
        request never held here), kept to be given again."""
        self.answers[ack.request_id] = ack, secret
        self.answers.move_to_end(ack.request_id)
        while len(self.answers) > self.answers_kept:
            self.answers.popitem(last=False)
        # (the bus away: the sender publishes its end again after a reconnect and gets this answer again)
        await self.bus.tried("kv_ack", self.bus.publish(subjects.prefill_kv_ack(prefill_worker), ack, secret=secret))

    async def sync(self) -> None:
        """After this worker's bus reconnected: each waiting receiver asks its sender for the
        notices and end again (KVSync)."""
        for rx in list(self.receivers.values()):
            if rx.prefill_worker and not rx.outcome.done():
                await self.bus.tried("kv_sync", self.bus.publish(subjects.prefill_kv_sync(rx.prefill_worker),
                                                                 KVSync(request_id=rx.rid), secret=rx.secret))

    async def on_layer(self, msg: Msg) -> None:
        notice = KVLayer.decode(msg.data)
        kv_tag = notice.tag - notice.tag % TAG_SPAN
        if (rx := self.receivers.get(notice.request_id)) is None:
            await self.answer(notice.request_id, notice.prefill_worker, kv_tag)
        elif not macs.signed_with(rx.secret, msg):
            return
        elif self.belongs(rx, notice.prefill_worker, kv_tag):
            rx.on_layer(notice)
        else:
            await self.refuse_other(rx, notice.prefill_worker, kv_tag)

    async def on_end(self, msg: Msg) -> None:
        end = KVEnd.decode(msg.data)
        if (rx := self.receivers.get(end.request_id)) is None:
            if end.prefill_worker:
                await self.answer(end.request_id, end.prefill_worker, end.kv_tag, again=True)
        elif not macs.signed_with(rx.secret, msg):
            return
        elif self.belongs(rx, end.prefill_worker, end.kv_tag):
            rx.on_end(end)
        else:
            await self.refuse_other(rx, end.prefill_worker, end.kv_tag)

    @staticmethod
    def belongs(rx: KVReceiver, sender: str, kv_tag: int) -> bool:
        """Whether a notice or end from `sender` for handoff `kv_tag` is `rx`'s: its sender and its
        tag range exactly — not when the job moved off a prefill worker thought lost (what that
        worker still sends), nor an older placement's handoff of the same request (a failover's)."""
        return sender == rx.prefill_worker and kv_tag == rx.kv_tag

    async def refuse_other(self, rx: KVReceiver, sender: str, kv_tag: int) -> None:
        """A handoff of the request that is not `rx`'s (signed with the same secret: the same
        placement, its job moved off `sender`) is told to stop."""
        if not sender:
            return
        await self.bus.publish(subjects.prefill_kv_ack(sender), KVAck(
            request_id=rx.rid, ok=False, error="moved to another handoff of the request", kv_tag=kv_tag),
            secret=rx.secret)

    async def answer(self, rid: str, prefill_worker: str, kv_tag: int, again: bool = False) -> None:
        """To the sender of handoff `kv_tag` of a request with no receiver here: a refusal if
        that handoff was never answered, else (`again`) the answer it was given."""
        given = self.answers.get(rid)
        if given is None or given[0].kv_tag not in (0, kv_tag):
            await self.ack(prefill_worker, KVAck(request_id=rid, ok=False, error="no reservation", kv_tag=kv_tag),
                           given[1] if given else "")
        elif again:
            await self.ack(prefill_worker, *given)


def _runs(mask: np.ndarray, value: bool) -> list[tuple[int, int]]:
    """[start, end) runs where mask == value."""
    runs, start = [], None
    for i, m in enumerate(mask):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs
