"""A request's latency as its client sees it, observed as its chunks pass on to the client:
time to first token, inter-token latency, time per output token, end-to-end, first token to
last, and a finished request's sizes and finish reason (definitions in pdserve/shared/metrics.py).
Each observation carries the request's trace id as an exemplar."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from pdserve.shared import metrics
from pdserve.shared.messages import TokenChunk


async def timed(chunks: AsyncIterator[TokenChunk], arrived: float, mode: str, trace_id: str | None,
                clock: Callable[[], float] = time.monotonic) -> AsyncIterator[TokenChunk]:
    """Pass `chunks` through, timing them from `arrived` (time.monotonic() at the request's
    arrival). End-to-end and TPOT are observed only for a request that finished."""
    ex = metrics.exemplar(trace_id)
    first: float | None = None
    last = arrived
    tokens = 0
    async for chunk in chunks:
        if chunk.token_ids:
            now = clock()
            if first is None:
                first = now
                metrics.TTFT.labels(mode).observe(now - arrived, ex)
            else:
                metrics.ITL.labels(mode).observe(now - last, ex)
            last = now
            tokens += len(chunk.token_ids)
            metrics.OUTPUT_TOKENS.inc(len(chunk.token_ids))
        yield chunk
        if chunk.finished and first is not None:
            metrics.E2E.labels(mode).observe(last - arrived, ex)
            metrics.DECODE_SECONDS.labels(mode).observe(last - first, ex)
            metrics.FINISHED.labels(chunk.finish_reason or "stop").inc()
            metrics.REQUEST_PROMPT_TOKENS.observe(chunk.prompt_tokens)
            metrics.REQUEST_OUTPUT_TOKENS.observe(tokens)
            if tokens > 1:
                metrics.TPOT.labels(mode).observe((last - first) / (tokens - 1), ex)
