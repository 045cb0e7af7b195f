"""The worker registry: each worker's entry under a heartbeat lease, and every heartbeat and
departure numbered in a change log, so a router reads only what changed since its last read
(pdserve/services/router/registry.py)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from pdserve.shared import metrics
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.state.keys import REGISTRY_CHANGES, REGISTRY_EPOCH, REGISTRY_SEQ, WORKER_PREFIX, WORKERS, worker_key
from pdserve.shared.state.store import Store

log = logging.getLogger(__name__)

# a heartbeat (ARGV[1] the entry) or a departure (ARGV[1] empty), numbered in the change log
_BEAT = """
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SADD', KEYS[2], ARGV[3])
end
local n = redis.call('INCR', KEYS[3])
if n == 1 then redis.call('SET', KEYS[5], ARGV[4]) end
redis.call('ZADD', KEYS[4], n, ARGV[3])
"""

# the registry changes after ARGV[2] (all registered ids when ARGV[3] is '1' or the epoch is
# not ARGV[1]; then ids whose lease lapsed leave the set and the change log; ARGV[4] the entries'
# key prefix, whose keys share the others' slot):
# {epoch, seq, full, then per id: id, entry ('' gone), lease left in ms}
_CHANGES = """
local seq = tonumber(redis.call('GET', KEYS[1]) or '0')
local epoch = redis.call('GET', KEYS[3]) or ''
local full = (ARGV[3] == '1' or epoch ~= ARGV[1] or tonumber(ARGV[2]) > seq) and 1 or 0
local ids
if full == 1 then
  ids = redis.call('SMEMBERS', KEYS[4])
else
  ids = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[2], '+inf')
end
local out = {epoch, seq, full}
for i = 1, #ids, 1000 do
  local keys = {}
  for j = i, math.min(i + 999, #ids) do keys[#keys + 1] = ARGV[4] .. ids[j] end
  local values = redis.call('MGET', unpack(keys))
  for j, v in ipairs(values) do
    local id = ids[i + j - 1]
    out[#out + 1] = id
    if v then
      out[#out + 1] = v
      out[#out + 1] = redis.call('PTTL', keys[j])
    else
      out[#out + 1] = ''
      out[#out + 1] = 0
      if full == 1 then
        redis.call('SREM', KEYS[4], id)
        redis.call('ZREM', KEYS[2], id)
      end
    end
  end
end
return out
"""


def decoded(worker_id: str, value: bytes) -> WorkerInfo | None:
    """The entry under `worker_id`'s key; None (and counted) when it cannot be read (another
    version's, or made up) or names another worker: such an entry costs its worker its place in
    the fleet, never a reader its read of the others."""
    try:
        info = WorkerInfo.decode(value)
    except ValueError as e:  # (pydantic's ValidationError, JSON's errors)
        why = f"unreadable: {str(e).splitlines()[0]}"
    else:
        if info.worker_id == worker_id:
            return info
        why = f"names {info.worker_id!r}"
    metrics.BAD_REGISTRY_ENTRIES.inc()
    log.warning("registry entry of %r skipped: %s", worker_id, why)
    return None


@dataclass
class Changes:
    epoch: str
    seq: int                                             # the latest change included
    full: bool                                           # every registered worker (a first read, a new epoch)
    entries: list[tuple[str, WorkerInfo | None, float]]  # (id, entry or None: gone, lease left in s)


class Registry:
    def __init__(self, store: Store):
        self.store = store
        self._decoded: dict[bytes, WorkerInfo] = {}  # entries as last read: unchanged ones not decoded again

    async def heartbeat(self, info: WorkerInfo, lease_s: float) -> None:
        await self._beat(info.worker_id, info.encode(), lease_s)

    async def deregister(self, worker_id: str) -> None:
        await self._beat(worker_id, b"", 0.0)

    async def _beat(self, worker_id: str, entry: bytes, lease_s: float) -> None:
        """The entry (or its removal), and its number in the change log the routers read."""
        await self.store.pipelined(lambda p: p.evalsha(
            self.store.script(_BEAT).sha, 5, worker_key(worker_id), WORKERS, REGISTRY_SEQ, REGISTRY_CHANGES,
            REGISTRY_EPOCH, entry, max(1, int(lease_s * 1000)), worker_id, uuid.uuid4().hex))

    async def changes(self, epoch: str, since: int, whole: bool = False) -> Changes:
        """What changed in the registry after change number `since` of `epoch`: a round trip
        whose cost follows the changes, not the fleet (all of it when `whole`, or when `epoch`
        is not the current one: a first read, or a Redis that restarted empty)."""
        raw = await self.store.call(lambda p: p.evalsha(
            self.store.script(_CHANGES).sha, 4, REGISTRY_SEQ, REGISTRY_CHANGES, REGISTRY_EPOCH, WORKERS, epoch,
            since, int(whole), WORKER_PREFIX))
        entries = []
        for i in range(3, len(raw), 3):
            worker_id, value = raw[i].decode(), raw[i + 1]
            info = (self._decoded.get(value) or decoded(worker_id, value)) if value else None
            if info is not None:
                self._decoded[value] = info
            entries.append((worker_id, info, int(raw[i + 2]) / 1e3))
        if len(self._decoded) > 4 * max(len(entries), 256):  # decoded entries of past reads
            self._decoded.clear()
        return Changes(raw[0].decode(), int(raw[1]), bool(raw[2]), entries)

    async def alive(self, worker_id: str) -> bool:
        """Its lease holds (it heartbeats, draining or not)."""
        return bool(await self.store.r.exists(worker_key(worker_id)))

    async def entries(self, worker_ids: list[str]) -> dict[str, WorkerInfo | None]:
        """The registry entries of `worker_ids` (None where the lease has lapsed): one round trip."""
        found = await self.store.r.mget([worker_key(w) for w in worker_ids])
        return {w: decoded(w, raw) if raw else None for w, raw in zip(worker_ids, found)}

    async def present(self, worker_ids: list[str]) -> set[str]:
        """Those of `worker_ids` whose lease holds: one round trip."""
        found = await self.store.pipelined(lambda p: [p.exists(worker_key(w)) for w in worker_ids])
        return {w for w, n in zip(worker_ids, found) if n}

    async def workers(self, role: str | None = None) -> list[WorkerInfo]:
        """The registered workers whose lease holds, by id: one call, whatever else Redis holds."""
        changes = await self.changes("", 0, whole=True)
        return sorted((w for _, w, _ in changes.entries if w is not None and (role is None or w.role == role)),
                      key=lambda w: w.worker_id)
