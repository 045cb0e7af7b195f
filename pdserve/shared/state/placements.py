"""Placements (idempotent routing): a router claims a request's placing before deciding it, and
notes the decode worker asked, then its reply; router replicas answer a repeat from it, and a
router taking over a lapsed claim asks that worker first."""

from __future__ import annotations

from redis.asyncio.client import Pipeline

from pdserve.shared.state.keys import claim_key, route_key
from pdserve.shared.state.store import Store

# the claim taken or renewed, then the decode worker about to be asked noted on the placement
_RENEW = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
redis.call('HSET', KEYS[2], 'decode', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
"""


# the claim taken or renewed; when it is this router's, the decode worker about to be asked noted on the
# placement unless one is noted (another replica's, which a takeover asks first) or it is placed; answers
# the claim (1 or 0) and the placement as it was before
_BEGIN = """
local claimed = 0
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  claimed = 1
elseif redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  claimed = 1
end
local known = redis.call('HGETALL', KEYS[2])
if claimed == 1 and ARGV[3] ~= '' and #known == 0 then
  redis.call('HSET', KEYS[2], 'decode', ARGV[3])
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return {claimed, known}
"""


class Placements:
    def __init__(self, store: Store):
        self.store = store

    async def begin(self, request_id: str, router_id: str, lease_s: float, decode: str, ttl_s: float
                    ) -> tuple[bool, dict[str, str]]:
        """One round trip: take the placing (or renew this router's), note `decode` as the worker about
        to be asked when nothing is noted yet; (claimed, what was known of the placement before:
        `decode` a takeover asks first, `reply` a repeat is answered with)."""
        key = route_key(request_id)
        claimed, known = await self.store.call(lambda p: p.evalsha(
            self.store.script(_BEGIN).sha, 2, claim_key(request_id), key, router_id, int(lease_s * 1000), decode,
            int(ttl_s * 1000)))
        return bool(claimed), {known[i].decode(): known[i + 1].decode() for i in range(0, len(known), 2)}

    async def renew(self, request_id: str, router_id: str, lease_s: float, decode: str, ttl_s: float) -> bool:
        """Renew the claim and note the decode worker about to be asked, in one call (a router
        taking over a lapsed claim asks that worker first); False if another router has it."""
        key = route_key(request_id)
        return bool(await self.store.call(lambda p: p.evalsha(
            self.store.script(_RENEW).sha, 2, claim_key(request_id), key, router_id, int(lease_s * 1000), decode,
            int(ttl_s * 1000))))

    async def release(self, request_id: str) -> None:
        """Give up the placing (a refusal): the next attempt decides afresh."""
        await self.store.r.delete(claim_key(request_id), route_key(request_id))  # (one slot)

    @staticmethod
    def queue_note(p: Pipeline, request_id: str, ttl_s: float, **fields: str) -> None:
        """Queue on pipeline `p`: `fields` noted on the placement (the router's reply)."""
        key = route_key(request_id)
        p.hset(key, mapping=fields)
        p.pexpire(key, int(ttl_s * 1000))

    async def read(self, request_id: str) -> dict[str, str]:
        """What is known of a request's placement: {"decode": worker, "reply": RouteReply JSON}."""
        raw = await self.store.r.hgetall(route_key(request_id))
        return {k.decode(): v.decode() for k, v in raw.items()}
