"""A request that crashes workers (pure decisions): charged each crash, failed at the second.

A worker records its engine pass's requests before a pass whose requests differ from the last it
recorded (`WorkerBatch`, pdserve/shared/batches.py), so whoever moves a request off a lost worker — the
gateway (a decode worker), a router's requeue (a prefill worker) — can tell whether the request
was in the pass that died. A crash is charged to the pass's requests on their first pass in that
worker's life (a request that crashes a worker mostly does so as it joins a pass: its prompt, its
first decode step), or to all of them when none is new. Charges are a set of `worker@life` per
request, so two observers of one crash count it once. At MAX_CRASHES the request is not placed
again: it fails with STATUS, not a 5xx, which clients and SDKs retry, each retry crashing another
worker; not a 400 either, which names a field the client got wrong.

A request charged a crash carries the count to its next workers (RouteRequest, AdmitRequest,
PrefillJob, Requeued `crashes`), whose schedulers run its first passes alone (`runs_alone`): a
request that shared the poison's pass, and was charged with it, never meets it in a pass again.

A prefill job JetStream delivers JOB_MAX_DELIVERIES times unacked (its worker died with it
each time, and no requeue dropped it) goes to the dead letters (pdserve/services/router/dead_letters.py).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: the engine's scheduler imports this module, without pydantic)
    from pdserve.shared.lifecycle import Summary
    from pdserve.shared.messages import WorkerBatch

MAX_CRASHES = 2          # crashes charged to one request: then it is failed, not placed again
STATUS = 422             # the client's request is well formed, and cannot be served
CODE = "request_quarantined"
ALONE_STEPS = 4          # decode steps a request charged a crash runs alone on a worker, after its prompt


def suspects(batch: WorkerBatch) -> set[str]:
    """The requests a crash during `batch`'s pass is charged to."""
    return set(batch.new or batch.requests)


def crash_of(batch: WorkerBatch) -> str:
    """One crash's name: the worker and its life (a restart under the same id is another)."""
    return f"{batch.worker}@{batch.incarnation}"


def quarantined(crashes: Collection[str]) -> bool:
    return len(crashes) >= MAX_CRASHES


def runs_alone(crashes: int, generated_here: int) -> bool:
    """Whether a request's next engine pass holds it alone, with `generated_here` tokens made on this
    worker: once charged a crash, its prompt and its first ALONE_STEPS decode steps run in passes of
    their own, taking turns with the others' passes. A poison crashes as it joins a pass (the charge
    rule's premise), so its next crash is charged to it alone, never to a request that shared the
    first one. Not to its end: a crash in a pass with none new charges every request in it, and each
    of those taking a pass per token to its end would cost its next worker most of its throughput."""
    return crashes > 0 and generated_here <= ALONE_STEPS


def message(crashes: Collection[str]) -> str:
    """What the client reads: which workers the request crashed, and that retrying will not help."""
    workers = ", ".join(sorted({c.split("@", 1)[0] for c in crashes}))
    return (f"The request crashed {len(crashes)} workers ({workers}) and is not placed again; the same request "
            "would crash the next one. Report it with its request id.")


def waits_on(s: Summary, prefill_worker: str, attempt: int) -> bool:
    """Whether a request still waits on its prefill job at `prefill_worker` (a dead letter's:
    the job is delivered no more, so the request is moved as a stalled one is)."""
    return s.phase in ("routed", "prefilling") and s.prefill == prefill_worker and s.attempt == attempt
