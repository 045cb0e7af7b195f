"""A prefill worker's jobs as it takes them from JetStream (its pull consumer): as many as
it has room for, and a pause while JetStream cannot serve the consumer (its group electing a
leader as a cluster node goes or comes back: the jobs stay queued)."""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

log = logging.getLogger("prefill")
JETSTREAM_RETRY_S = 0.5  # a consumer JetStream cannot serve now is asked again after this


def queued_at(msg: Msg) -> float:
    """When a job was queued (JetStream's timestamp; now, if it has none)."""
    return msg.metadata.timestamp.timestamp() if msg.metadata.timestamp else time.time()


class JobIntake:
    def __init__(self) -> None:
        self.unavailable_since = 0.0  # when JetStream stopped serving this worker's consumer (0: it serves)

    async def fetch(self, pull: JetStreamContext.PullSubscription, room: int, wait_s: float) -> list[Msg]:
        """Up to `room` jobs waiting (none after `wait_s`)."""
        try:
            msgs = await pull.fetch(room, timeout=wait_s)
        except (TimeoutError, nats.errors.TimeoutError):  # no job waiting
            return []
        except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as e:
            # JetStream cannot serve this consumer for now: ask again shortly
            if not self.unavailable_since:
                self.unavailable_since = time.monotonic()
                log.warning("taking jobs: %s; asking again until JetStream serves", type(e).__name__)
            await asyncio.sleep(JETSTREAM_RETRY_S)
            return []
        if self.unavailable_since:
            log.warning("taking jobs again after %.1f s", time.monotonic() - self.unavailable_since)
            self.unavailable_since = 0.0
        return msgs
