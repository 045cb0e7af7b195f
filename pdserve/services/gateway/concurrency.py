"""Per-key concurrency: a caller's requests in flight, counted across every gateway in Redis.

A caller's requests are a sorted set (`pd:inflight:<caller>`) of their choices (`<rid>:<i>`)
scored by when each lease ends, on Redis's clock. A request joins when its choices still fit
under the limit (one Lua script: lapsed leases removed, the rest counted, the request added),
leaves when its answer ends (however it ends: done, an error, the client gone), and its gateway
renews the leases of the requests it serves every heartbeat, so the places of a gateway that
died are free again within one lease (a renewal adds a lease a restarted Redis lost: the count is
whole again within a heartbeat). Over the limit → 429. Redis away: requests pass
unchecked when `fail_open` (logged), else a 503, as for the rate limits.
"""

from __future__ import annotations

import logging

from pdserve.services.gateway.errors import APIError
from pdserve.shared.state import Store
from pdserve.shared.tasks import Background

log = logging.getLogger("gateway.concurrency")
_NOW = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"
JOIN = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) + #ARGV - 2 > tonumber(ARGV[1]) then return 0 end
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""
RENEW = _NOW + """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
"""


def inflight_key(caller: str) -> str:
    return f"pd:inflight:{caller}"


class Concurrency:
    def __init__(self, state: Store, limit: int, lease_s: float, fail_open: bool):
        self.state, self.limit, self.lease_ms, self.fail_open = state, limit, int(lease_s * 1000), fail_open
        self.taken: dict[str, tuple[str, list[str]]] = {}  # request id -> (caller, its members)
        self.leaving = Background(log, "leaving the in-flight count")

    async def join(self, caller: str, request_id: str, choices: int) -> None:
        """Count the request's `choices` for `caller`: a 429 when they do not fit under the limit."""
        if self.limit <= 0:
            return
        if choices > self.limit:
            raise APIError(400, f"n={choices} is more requests in flight than this key may have ({self.limit}).",
                           param="n")
        members = [f"{request_id}:{i}" for i in range(choices)]
        try:
            ok = await self.state.script(JOIN)(keys=[inflight_key(caller)], args=[self.limit, self.lease_ms, *members])
        except Exception as e:  # noqa: BLE001 - Redis away
            if not self.fail_open:
                raise APIError(503, "The concurrency limit cannot be checked now (its store is away). Retry "
                                    "shortly.", code="concurrency_limit_unavailable",
                               headers={"Retry-After": "1"}) from None
            log.warning("concurrency limit unchecked (Redis: %s)", e)
            return
        if not ok:
            raise APIError(429, f"Too many requests in flight: this key may have {self.limit} at once (each choice "
                                "counts). Retry when one ends.", code="concurrency_limit_exceeded",
                           headers={"Retry-After": "1"})
        self.taken[request_id] = (caller, members)

    def leave(self, request_id: str) -> None:
        """The request ended: its places are free (in the background; the lease is the backstop)."""
        taken = self.taken.pop(request_id, None)
        if taken is not None:
            caller, members = taken
            self.leaving.start(self.state.call(lambda p: p.zrem(inflight_key(caller), *members)))

    async def renew(self) -> None:
        """Every heartbeat: the leases of the requests this gateway serves, one round trip."""
        callers: dict[str, list[str]] = {}
        for caller, members in self.taken.values():
            callers.setdefault(caller, []).extend(members)
        if callers:
            renew = self.state.script(RENEW)
            await self.state.pipelined(lambda p: [p.evalsha(renew.sha, 1, inflight_key(c), self.lease_ms, *m)
                                                  for c, m in callers.items()])
