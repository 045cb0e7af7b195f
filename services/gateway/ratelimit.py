"""Per-key rate limits: a token bucket per caller in Redis, shared by every gateway replica.

The bucket refills at `rate` requests per second up to `burst`; each request takes one. The
arithmetic runs inside Redis (one Lua script, Redis's own clock), so replicas never race and
their clocks need not agree. Over the rate → 429 with Retry-After (when one token is back).
Redis unreachable: requests pass unchecked (logged), rather than every caller refused.
"""

from __future__ import annotations

import logging
import math

from services.gateway.errors import APIError
from shared.state import State

log = logging.getLogger("gateway.ratelimit")
BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1]) or burst
local ts = tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""


def bucket_key(caller: str) -> str:
    return f"pd:rate:{caller}"


class RateLimit:
    def __init__(self, state: State, rate_per_s: float, burst: int):
        self.rate, self.burst = rate_per_s, max(1, burst)
        self.script = state.r.register_script(BUCKET) if rate_per_s > 0 else None

    async def take(self, caller: str) -> None:
        """One request for `caller` (a key's name, or the client address when the API is open);
        raises 429 when its bucket is empty."""
        if self.script is None:
            return
        try:
            wait = float(await self.script(keys=[bucket_key(caller)], args=[self.rate, self.burst]))
        except Exception as e:  # noqa: BLE001 - Redis away: serve rather than refuse everyone
            log.warning("rate limit unchecked (Redis: %s)", e)
            return
        if wait > 0:
            retry = max(1, math.ceil(wait))
            raise APIError(429, f"Rate limit reached: {self.rate:g} requests/s with bursts of {self.burst}. "
                                f"Retry after {retry} s.", code="rate_limit_exceeded",
                           headers={"Retry-After": str(retry)})
