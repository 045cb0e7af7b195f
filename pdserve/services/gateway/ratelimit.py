"""Per-key rate limits: a token bucket per caller in Redis, shared by every gateway replica.

The bucket refills at `rate` units per second up to `burst`; each request takes its cost (the
request bucket: one per choice; the token bucket: prompt tokens plus n × max_tokens). The
arithmetic runs inside Redis (one Lua script, Redis's own clock), so replicas never race and
their clocks need not agree. Over the rate → 429 with Retry-After (when the cost is back).
Redis unreachable: requests pass unchecked (logged) when `fail_open`, else a 503.
"""

from __future__ import annotations

import logging
import math

from pdserve.services.gateway.errors import APIError
from pdserve.shared.state import Store

log = logging.getLogger("gateway.ratelimit")
BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1]) or burst
local ts = tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= cost then tokens = tokens - cost else wait = (cost - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""


def bucket_key(caller: str, unit: str = "requests") -> str:
    return f"pd:rate:{caller}" if unit == "requests" else f"pd:rate:{unit}:{caller}"


class RateLimit:
    def __init__(self, state: Store, rate_per_s: float, burst: int, unit: str = "requests", fail_open: bool = True):
        self.rate, self.burst, self.unit, self.fail_open = rate_per_s, max(1, burst), unit, fail_open
        self.script = state.script(BUCKET) if rate_per_s > 0 else None

    async def take(self, caller: str, cost: float = 1.0) -> None:
        """`cost` units for `caller` (a key's name, or the client address when the API is open);
        raises 429 when its bucket holds less. A cost over the burst is charged as the burst."""
        if self.script is None:
            return
        try:
            wait = float(await self.script(keys=[bucket_key(caller, self.unit)],
                                           args=[self.rate, self.burst, min(cost, self.burst)]))
        except Exception as e:  # noqa: BLE001 - Redis away
            if not self.fail_open:
                raise APIError(503, "The rate limit cannot be checked now (its store is away). Retry shortly.",
                               code="rate_limit_unavailable", headers={"Retry-After": "1"}) from None
            log.warning("rate limit unchecked (Redis: %s)", e)
            return
        if wait > 0:
            retry = max(1, math.ceil(wait))
            raise APIError(429, f"Rate limit reached: {self.rate:g} {self.unit}/s with bursts of {self.burst}. "
                                f"Retry after {retry} s.", code="rate_limit_exceeded",
                           headers={"Retry-After": str(retry)})

