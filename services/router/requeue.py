"""Requeue (decode worker → router, `pd.router.requeue`): the prefill worker computing a
request's KV is gone or late. The prompt's prefill is placed again onto the same decode worker,
among the other prefill workers (placement.place_prefill, as for a new request: prefix index,
queues, breakers) — or none fits (short prompt, breakers open, none left) and the decode worker
prefills it itself. Recorded as the request's `routed` again; the reply carries the prefill's
predicted time (the decode worker's KV deadline follows it)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from services.router import placement, policy
from services.router.errors import EXPECTED
from shared import metrics, tracing
from shared.bus import context_of
from shared.hashing import block_hashes
from shared.messages import Requeue, Requeued

if TYPE_CHECKING:
    from services.router.main import Router

log = logging.getLogger("router")


async def on_requeue(router: Router, msg: Msg) -> None:
    req = Requeue.decode(msg.data)
    with tracing.continued(router.tracer, "router.requeue", context_of(msg)) as span:
        span.set_attributes({"request_id": req.request_id, "decode_worker": req.decode_worker, "why": req.why,
                             "avoid_workers": req.avoid_workers, "attempt": req.attempt, "router": router.id})
        try:
            reply = await requeue(router, req)
        except Exception as e:  # Redis trouble: the decode worker prefills it itself
            log.error("%s: requeue failed: %r", req.request_id, e, exc_info=not isinstance(e, EXPECTED))
            reply = Requeued(request_id=req.request_id, reason=f"requeue failed: {e}")
        span.set_attributes({"prefill_worker": reply.prefill_worker or "", "reason": reply.reason})
        await router.bus.respond(msg, reply)


async def requeue(router: Router, req: Requeue) -> Requeued:
    pool = await router.pools.pool(req.model)
    decode = next((w for w in router.pools.registry.workers() if w.worker_id == req.decode_worker), None)
    if decode is None:
        return Requeued(request_id=req.request_id, reason=f"decode worker {req.decode_worker} not registered")
    tokens = [*req.prompt_token_ids, *req.generated_token_ids]
    hashes = block_hashes(tokens[:-1], pool.block_size, req.cache_salt)
    others = [p for p in pool.prefills if p.worker_id not in req.avoid_workers]
    fleet = placement.Fleet(pool.decodes, others, pool.block_size, await router.holding(pool, hashes))
    ask = placement.Ask(len(req.prompt_token_ids), 0, generated=len(req.generated_token_ids), attempt=req.attempt)
    books = router.bookings.books(time.monotonic(), decode.worker_id)
    chosen = placement.place_prefill(ask, decode, fleet, books, router.rules)
    prefill = chosen.prefill
    metrics.PLACEMENTS.labels(chosen.mode, "requeued").inc()
    if prefill is None:
        return Requeued(request_id=req.request_id, reason=chosen.reason)
    expected_s = policy.predicted_prefill_s(prefill, len(tokens))
    router.bookings.prefill(prefill, decode.worker_id, len(tokens), time.monotonic())
    reason = f"requeued from {req.avoid_workers[-1]} ({req.why}): {chosen.reason}"
    router.state.requests.note(req.request_id, "routed", by=router.id, attempt=req.attempt, prompt_tokens=len(tokens),
                      mode="remote", reason=reason, decode=decode.worker_id, prefill=prefill.worker_id)
    return Requeued(request_id=req.request_id, prefill_worker=prefill.worker_id, reason=reason,
                    expected_prefill_s=expected_s)
