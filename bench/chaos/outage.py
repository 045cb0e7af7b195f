"""`nats-outage` (bench/chaos/scenarios.py): NATS unreachable for OUTAGE_S under steady decode.

On a stack of its own, made for pressure: the fake model (pdserve/shared/engine/fake.py: the real
engine and KV, no weights) stepping as fast as this machine runs it, REQUESTS streams of
MAX_TOKENS tokens, and the workers' NATS buffer (PD_NATS_PENDING_BYTES) at PENDING_BYTES, which
the decode workers' chunks fill within the first steps of the outage. Every request is decoding
when nats-server is killed (none could be placed while it is away); it is started again
OUTAGE_S later. The decode workers step on, their publishes refused once the buffer is full
(pd_bus_publish_errors_total), every chunk kept in their chunk log; once the gateway is back
on the bus its replays complete each stream. Reported beside the common figures: the decode
rate of the load without faults (`tokens_per_s`: its tokens over its span), how long the
outage lasted (`outage_s`), how long into it the decode workers still held running sequences
(`decoding_s`, from their registry entries: Redis stays up), and the publishes they counted
refused (`publish_errors`).
"""

from __future__ import annotations

import asyncio
import time

from bench.chaos.fleet import pools
from bench.chaos.load import Outcome
from pdserve.local.stack import Stack

OUTAGE_SCENARIOS = ("nats-outage",)
OUTAGE_S = 10.0
PENDING_BYTES = 64 << 10   # ~200 chunks: full within a few steps of two decode workers
REQUESTS, MAX_TOKENS = 64, 600
DECODE_WORKERS = ("decode-0", "decode-1")


def stack_shape() -> dict:
    """StackConfig fields and the load of the outage's stack (over the chaos defaults)."""
    return {"model": "fake:smollm2", "kv_blocks": 1536, "prefill_kv_blocks": 256,
            "env": {"PD_NATS_PENDING_BYTES": str(PENDING_BYTES)},
            "requests": REQUESTS, "max_tokens": MAX_TOKENS}


def tokens_per_s(reference: list[Outcome]) -> float:
    """The load without faults: its tokens over the span from its first token to its last."""
    times = [t for o in reference for t in o.times]
    span = max(times) - min(times) if times else 0.0
    return round(sum(len(o.ids) for o in reference) / span, 1) if span > 0 else 0.0


async def through(stack: Stack, reference: list[Outcome]) -> dict:
    """NATS is down (killed by `strike`): OUTAGE_S watching the decode workers' registry
    entries, then nats-server started again; the outage's figures."""
    down_at = time.monotonic()
    decoding_s = 0.0
    while (now := time.monotonic()) - down_at < OUTAGE_S:
        entries = await asyncio.to_thread(pools, stack)
        if any(entries.get(w, {}).get("running") for w in DECODE_WORKERS):
            decoding_s = now - down_at
        await asyncio.sleep(0.25)
    stack.restart("nats")
    outage_s = time.monotonic() - down_at
    errors = sum([await asyncio.to_thread(stack.metric_total, w, "pd_bus_publish_errors_total")
                  for w in DECODE_WORKERS])
    return {"outage_s": round(outage_s, 1), "decoding_s": round(decoding_s, 1), "publish_errors": int(errors),
            "tokens_per_s": tokens_per_s(reference), "pending_bytes": PENDING_BYTES}


def summary(r: dict) -> str:
    return (f"  outage: {r['outage_s']} s, decode workers still running sequences {r['decoding_s']} s into it; "
            f"load without faults {r['tokens_per_s']} tokens/s; {r['publish_errors']} publishes refused "
            f"(buffer {r['pending_bytes']} bytes); replays {r['moved'].get('replays:replayed', 0)}")
