"""NATS: connect, publish / request / respond with trace headers, the prefill work queue, drain."""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import context

from pdserve.shared import macs, metrics, subjects, tracing
from pdserve.shared.config import NATS_PENDING_BYTES
from pdserve.shared.grants import inbox
from pdserve.shared.identity import Enrollment
from pdserve.shared.macs import Signed
from pdserve.shared.messages import Message, Ping, PrefillJob
from pdserve.shared.tls import client_context
from pdserve.shared.urls import nats_inbox, nats_servers

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
PING_HEADER = "Pd-Ping"  # a Ping: answered here, not by the subscription's handler
ERRORS_LOGGED_EVERY_S = 10.0  # publishes that fail while the bus is away: one warning per period, not per token


class Bus:
    def __init__(self, nc: nats.NATS, clock: Callable[[], float] = time.monotonic):
        self.nc = nc
        self.js = nc.jetstream()
        self.clock = clock
        self.failed, self.warned_at = 0, -ERRORS_LOGGED_EVERY_S  # publishes failed since the last warning

    @property
    def reconnects(self) -> int:
        """Reconnections so far: messages to or from this client around one may be lost."""
        return self.nc.stats["reconnects"]

    @classmethod
    async def connect(cls, url: str, name: str, tls: ssl.SSLContext | None = None,
                      me: Enrollment | None = None, pending_bytes: int = NATS_PENDING_BYTES) -> Bus:
        """`tls`: this client's (default: from PD_TLS_*, pdserve/shared/tls.py; none there: plain). `me`:
        this instance's enrollment (pdserve/shared/identity.py): it connects with its key and its role's
        token, as the user the identity issuer names after the key; none: PD_NATS_URL's user.
        `pending_bytes`: what is buffered while the connection is away (PD_NATS_PENDING_BYTES)."""
        auth = {"nkeys_seed_str": me.key.seed.decode(), "token": me.token} if me else {}
        async def on_error(e: Exception) -> None:
            log.warning("nats: %s", e)

        async def on_reconnect() -> None:
            log.warning("nats: reconnected")

        nc = await nats.connect(nats_servers(url), name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                error_cb=on_error, reconnected_cb=on_reconnect, pending_size=pending_bytes,
                                inbox_prefix=inbox(me.name) if me else nats_inbox(url), tls=tls or client_context(),
                                **auth)
        return cls(nc)

    async def enroll_redis(self, me: Enrollment, url: str, timeout: float = 10) -> str:
        """PD_REDIS_URL as instance `me`: its Redis user made by the identity issuer."""
        reply = await self.nc.request(subjects.IDENTITY_REDIS, me.redis_request(), timeout=timeout)
        if reply.data != b"ok":
            raise RuntimeError(f"the identity issuer made no Redis user for {me.name}: {reply.data.decode()}")
        return me.redis_url(url)

    async def publish(self, subject: str, msg: Message, ctx: context.Context | None = None, secret: str = "") -> None:
        """`secret`: a placement's (pdserve/shared/macs.py): the message goes with its MAC."""
        data, headers = msg.encode(), tracing.inject(ctx)
        if secret:
            headers[macs.HEADER] = macs.mac(secret, data)
        await self.nc.publish(subject, data, headers=headers)

    async def publish_signed(self, subject: str, signed: Signed, ctx: context.Context | None = None) -> None:
        """A token chunk with its MAC (pdserve/shared/macs.py)."""
        await self.nc.publish(subject, signed.data, headers={**tracing.inject(ctx), macs.HEADER: signed.mac})

    async def tried(self, what: str, publishing: Awaitable[None]) -> bool:
        """Await a publish (a JetStream ack is one too) of a worker's step path, which a bus
        error never ends: the connection away with its buffer full, or closed, is logged (once
        per ERRORS_LOGGED_EVERY_S, with a count), counted in pd_bus_publish_errors_total{what}
        and returned as False. For what the caller keeps and publishes again when asked (token
        chunks: the chunk log; KV notices: a KVSync) or what has a deadline behind it."""
        try:
            await publishing
        except nats.errors.Error as e:
            metrics.BUS_PUBLISH_ERRORS.labels(what).inc()
            self.failed += 1
            if (now := self.clock()) - self.warned_at >= ERRORS_LOGGED_EVERY_S:
                log.warning("nats: %s not published (%r); %d publishes failed since the last such warning; "
                            "going on without them", what, e, self.failed)
                self.failed, self.warned_at = 0, now
            return False
        return True

    async def request(self, subject: str, msg: Message, reply_type: type[M], timeout: float) -> M:
        reply = await self.nc.request(subject, msg.encode(), timeout=timeout, headers=tracing.inject())
        return reply_type.decode(reply.data)

    async def heard(self, subject: str, timeout: float) -> bool | None:
        """Whether anything subscribes to `subject`: True when its bus answered a Ping, False
        when the server says no responders (it closes a killed process's connection at once,
        long before its lease lapses), None — no verdict — on silence (a process whose event
        loop is stuck) or with this connection away."""
        try:
            await self.nc.request(subject, Ping().encode(), timeout=timeout, headers={PING_HEADER: "1"})
        except nats.errors.NoRespondersError:
            return False
        except Exception:  # noqa: BLE001 - timed out, or this connection away
            return None
        return True

    async def respond(self, request: Msg, msg: Message) -> None:
        await self.nc.publish(request.reply, msg.encode(), headers=tracing.inject())

    async def subscribe(self, subject: str, handler: Callable[[Msg], Awaitable[None]], queue: str = "") -> Subscription:
        """`handler` gets every message but a Ping, which is answered here."""
        async def on_message(msg: Msg) -> None:
            if msg.headers and PING_HEADER in msg.headers:
                if msg.reply:
                    await self.nc.publish(msg.reply, b"")
                return
            await handler(msg)
        return await self.nc.subscribe(subject, queue=queue, cb=on_message)

    async def queue_prefill(self, prefill_worker: str, job: PrefillJob, ctx: context.Context | None = None) -> None:
        """Put a job on that prefill worker's queue (awaits the stream's ack); a second job for
        the same handoff (request, attempt and KV tag: a repeated admit) is dropped by the
        stream (JetStream de-duplication by message id)."""
        msg_id = f"prefill:{job.request_id}:{job.attempt}:{job.kv_tag}"
        await self.js.publish(subjects.prefill_jobs(prefill_worker), job.encode(),
                              headers={**tracing.inject(ctx), "Nats-Msg-Id": msg_id})

    async def wait_stream(self, name: str, period_s: float = 0.5) -> None:
        """Until stream `name` exists: the operator makes the streams (pdserve/shared/streams.py), a
        service only reads their configuration."""
        for asked in itertools.count():
            try:
                await self.js.stream_info(name)
                return
            except (nats.js.errors.NotFoundError, nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError,
                    nats.errors.NoRespondersError) as e:
                if asked % 20 == 0:
                    log.warning("stream %s not there yet (%s): the operator makes it (pdserve streams)", name, e)
            await asyncio.sleep(period_s)

    async def close(self) -> None:
        if self.nc.is_connected:
            await self.nc.drain()


def context_of(msg: Msg) -> context.Context:
    """The trace context a message carried."""
    return tracing.extract(dict(msg.headers or {}))


RESYNC_ROUNDS = 3   # periods after a reconnect that re-state open exchanges (the peer may reconnect later)


async def after_reconnects(bus: Bus, period_s: float, action: Callable[[], Awaitable[None]],
                           rounds: int = RESYNC_ROUNDS) -> None:
    """Forever: in each of the `rounds` periods after a reconnection of `bus`, `action()` once.
    What either side published while one was away is lost, and the other may reconnect up to
    a few periods later."""
    seen, left = bus.reconnects, 0
    while True:
        await asyncio.sleep(period_s)
        if bus.reconnects != seen:
            seen, left = bus.reconnects, rounds
        if left:
            left -= 1
            try:
                await action()
            except Exception as e:  # noqa: BLE001 - away again: the next round tries
                log.warning("after reconnect: %s", e)
