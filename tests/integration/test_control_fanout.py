"""A request's cancel, KV ack and KV re-send reach the workers holding it and no other, over a
real nats-server: a fleet of N prefill and N decode workers, each on its own connection and
subscribed as the services subscribe (subjects.prefill_control / decode_control). What one
request costs the bus does not grow with the fleet."""

from __future__ import annotations

import asyncio
from collections import Counter

import nats
import pytest

from pdserve.shared import subjects
from pdserve.shared.bus import Bus
from pdserve.shared.holders import Holders
from pdserve.shared.messages import Cancel, KVAck, KVResend

DECODE, PREFILL = "decode-1", "prefill-2"   # the workers holding the request


async def deliveries(url: str, n: int) -> Counter:
    """(worker, message) -> how many times it was delivered, for one request's cancel (to both
    its workers, the way the gateway and the supervisor send it), ack and re-send (decode →
    prefill)."""
    counts: Counter = Counter()

    async def worker(name: str, control: dict[str, str]):
        nc = await nats.connect(url, name=name)
        for kind, subject in control.items():
            async def on(msg, key=(name, kind)):
                counts[key] += 1
            await nc.subscribe(subject, cb=on)
        await nc.flush()
        return nc

    fleet = await asyncio.gather(*[worker(f"decode-{i}", subjects.decode_control(f"decode-{i}")) for i in range(n)],
                                 *[worker(f"prefill-{i}", subjects.prefill_control(f"prefill-{i}"))
                                   for i in range(n)])
    bus = await Bus.connect(url, "sender")
    holders = Holders()
    holders.add(DECODE, PREFILL)
    await holders.cancel(bus, Cancel(request_id="r"))
    await bus.publish(subjects.prefill_kv_ack(PREFILL), KVAck(request_id="r", ok=True))
    await bus.publish(subjects.prefill_kv_resend(PREFILL),
                      KVResend(request_id="r", layer=0, first_block=0, num_blocks=1, attempt=1))
    await bus.nc.flush()
    await asyncio.gather(*[nc.flush() for nc in fleet])   # each connection has read what was sent to it
    await asyncio.sleep(0.2)                              # and each callback has run
    await bus.close()
    await asyncio.gather(*[nc.close() for nc in fleet])
    return counts


@pytest.mark.parametrize("n", [4, 256])
def test_each_control_message_is_delivered_once_to_the_worker_holding_the_request(nats_url, n):
    counts = asyncio.run(deliveries(nats_url, n))
    assert counts == {(DECODE, "cancel"): 1, (PREFILL, "cancel"): 1, (PREFILL, "kv_ack"): 1,
                      (PREFILL, "kv_resend"): 1}


def test_a_subject_the_fleet_shares_is_counted_once_per_worker(nats_url, monkeypatch):
    """The measure sees fan-out: workers subscribed to a wildcard all get every message."""
    for name in ("decode_control", "prefill_control"):
        monkeypatch.setattr(subjects, name, lambda worker, control=getattr(subjects, name): control("*"))  # noqa: B008
    counts = asyncio.run(deliveries(nats_url, 16))
    per_kind = Counter()
    for (_, kind), times in counts.items():
        per_kind[kind] += times
    assert per_kind == {"cancel": 2 * 16, "kv_ack": 16, "kv_resend": 16}
