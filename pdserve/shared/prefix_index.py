"""The cluster's prefix index in Redis: which worker holds which KV blocks, found per block.

    pd:prefix:b:<n>       hash, one of BUCKETS: block hash (signed 64-bit) -> the slots holding
                          it, comma-separated ("7" or "7,12")
    pd:prefix:slots       hash: slot -> its holder's token (the worker incarnation writing it)
    pd:prefix:sizes       hash: slot -> blocks indexed under it
    pd:prefix:live:<s>    exists while slot s's worker refreshes it (its lease)
    pd:prefix:next        the last slot handed out (slots are never reused)

A *slot* is one life of one worker's prefix cache: a worker takes a new slot when it starts
and whenever its entries may have diverged from its cache (Redis restarted empty, an update
failed, its lease lapsed), then writes its whole cache under it (`snapshot`). Its registry
entry names its slot (`WorkerInfo.prefix_slot`), so a router reads only slots of live
workers; a dead slot's entries are removed in the background by `sweep` (router supervisor).

Each worker is the only writer of its slot: after every engine step it applies the step's
"stored" / "evicted" changes (CacheChange, in order) with one script call. Routers ask
`cached_blocks(workers, hashes)`: one script walks the prompt's blocks in order while some slot
still holds every block so far — its cost grows with the prompt's cached prefix, not with the
number of workers. The small hashes (BUCKETS of them, ≤128 fields each up to 16M indexed
blocks) keep Redis's compact encoding under its default settings: ~16-30 bytes per block at
1-10M blocks (measured by `make bench-scale`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import TypeVar

from redis.asyncio.client import Pipeline

from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.state import Store

log = logging.getLogger("prefix_index")
K = TypeVar("K", bound=Hashable)
BUCKETS = 1 << 17
SLOTS, SIZES, NEXT, SWEEP = "pd:prefix:slots", "pd:prefix:sizes", "pd:prefix:next", "pd:prefix:sweep"
UPDATE_CHUNK = 4096   # hashes per script call (a long call would hold up every other Redis client)
SWEEP_BUCKETS = 1024  # buckets cleaned per sweep step (a pass: 128 steps), in calls of SWEEP_CHUNK
SWEEP_CHUNK = 16


def bucket(n: int) -> str:
    """The key of bucket n (the lookup script names it the same way)."""
    return f"pd:prefix:b:{n}"


def bucket_key(block_hash: int) -> str:
    return bucket(block_hash % BUCKETS)


def live_key(slot: int | str) -> str:
    return f"pd:prefix:live:{slot}"


def field(block_hash: int) -> int:
    """The hash as a signed 64-bit integer: Redis stores it as an 8-byte integer, not 20 digits."""
    return block_hash - (1 << 64) if block_hash >= 1 << 63 else block_hash


def net_changes(changes: list[CacheChange]) -> tuple[list[int], list[int]]:
    """(hashes to add, hashes to remove): the last event per hash wins."""
    last: dict[int, str] = {}
    for e in changes:
        last[e.block_hash] = e.kind
    return ([h for h, k in last.items() if k == "stored"], [h for h, k in last.items() if k == "evicted"])


# KEYS: slots, sizes, next, live key prefix is built from the slot. ARGV: token, lease ms.
_TAKE = """
local slot = redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[1], slot, ARGV[1])
redis.call('HSET', KEYS[2], slot, 0)
redis.call('SET', 'pd:prefix:live:' .. slot, 1, 'PX', ARGV[2])
return slot
"""

# KEYS: slots, live key. ARGV: slot, token. Drops the lease only while the slot is this writer's
# (after a flush its old number may be another worker's live slot).
_RELEASE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('DEL', KEYS[2]) end
return 0
"""

# KEYS: slots, sizes, live key, then one bucket per hash. ARGV: slot, token, lease ms, adds, hashes.
# Returns the slot's size, or -1 when the slot is no longer this writer's (lost or swept).
_UPDATE = """
local slot, nadd = ARGV[1], tonumber(ARGV[4])
if redis.call('HGET', KEYS[1], slot) ~= ARGV[2] or redis.call('PEXPIRE', KEYS[3], ARGV[3]) == 0 then
  return -1
end
local delta = 0
for i = 4, #KEYS do
  local key, h = KEYS[i], ARGV[i + 1]
  local v = redis.call('HGET', key, h)
  local held = v and string.find(',' .. v .. ',', ',' .. slot .. ',', 1, true)
  if i - 3 <= nadd then
    if not v then
      redis.call('HSET', key, h, slot)
      delta = delta + 1
    elseif not held then
      redis.call('HSET', key, h, v .. ',' .. slot)
      delta = delta + 1
    end
  elseif held then
    local rest = string.sub(string.gsub(',' .. v .. ',', ',' .. slot .. ',', ','), 2, -2)
    if rest == '' then redis.call('HDEL', key, h) else redis.call('HSET', key, h, rest) end
    delta = delta - 1
  end
end
return redis.call('HINCRBY', KEYS[2], slot, delta)
"""

# ARGV[1]: "bucket:hash bucket:hash ..." in prompt order (one argument: packing a hundred is the
# router's largest cost of the call; the buckets are named in the script). Returns [slot, leading blocks, ...]
# for every slot holding the first block: walks on while some slot holds every block so far. A
# block whose holders are written as the block before's (a prefix shared by many workers, stored
# in the same order) is not parsed again: the cost is the prompt's length plus the holders' count
# once per change, not blocks x holders.
_LOOKUP = """
local holders, prev, last, out = nil, nil, 0, {}
local i = 0
for bucket, h in string.gmatch(ARGV[1], '(%d+):(%-?%d+)') do
  i = i + 1
  local v = redis.call('HGET', 'pd:prefix:b:' .. bucket, h)
  if not v then break end
  if v ~= prev then
    local now, any = {}, false
    for s in string.gmatch(v, '[^,]+') do
      if holders == nil or holders[s] then
        now[s], any = true, true
      end
    end
    if holders ~= nil then
      for s in pairs(holders) do
        if not now[s] then out[s] = last end
      end
    end
    if not any then
      holders = nil
      break
    end
    holders, prev = now, v
  end
  last = i
end
if holders ~= nil then
  for s in pairs(holders) do out[s] = last end
end
local flat = {}
for s, n in pairs(out) do
  flat[#flat + 1] = s
  flat[#flat + 1] = n
end
return flat
"""

# KEYS: buckets. ARGV: dead slots. Removes them from every entry of those buckets.
_SWEEP = """
local dead = {}
for _, s in ipairs(ARGV) do  -- a number reused since the pass began (Redis flushed) is live: kept
  if redis.call('EXISTS', 'pd:prefix:live:' .. s) == 0 then dead[s] = true end
end
local removed = 0
for _, key in ipairs(KEYS) do
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local keep, changed = {}, false
    for s in string.gmatch(all[i + 1], '[^,]+') do
      if dead[s] then changed = true else keep[#keep + 1] = s end
    end
    if changed then
      removed = removed + 1
      if #keep == 0 then
        redis.call('HDEL', key, all[i])
      else
        redis.call('HSET', key, all[i], table.concat(keep, ','))
      end
    end
  end
end
return removed
"""


class PrefixPublisher:
    """A worker's writer: batches applied in order by one task, off the step loop."""

    def __init__(self, state: Store, worker_id: str, lease_s: float,
                 snapshot: Callable[[], Awaitable[list[int]]] | None = None):
        self.state, self.worker_id, self.lease_ms = state, worker_id, int(lease_s * 1000)
        self.snapshot = snapshot  # every hash in the engine's prefix cache now
        self.slot = 0             # 0: none yet (the registry entry says so)
        self.token = ""
        self.size = 0             # blocks indexed under the slot after the last update
        self.queue: asyncio.Queue[list[CacheChange]] = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self._take, self._update, self._release = state.script(_TAKE), state.script(_UPDATE), state.script(_RELEASE)

    def registry_fields(self) -> dict[str, int]:
        """What the worker's registry entry says of it: the slot its entries are under."""
        return {"prefix_slot": self.slot}

    async def start(self) -> None:
        await self._new_slot()
        self.task = asyncio.create_task(self._run())

    def publish(self, changes: list[CacheChange]) -> None:
        if changes:
            self.queue.put_nowait(changes)

    async def _run(self) -> None:
        resync = False
        while True:
            try:  # idle: still refresh the slot's lease
                changes = [await asyncio.wait_for(self.queue.get(), self.lease_ms / 3000)]
            except TimeoutError:
                changes = []
            while not self.queue.empty():
                changes.append(self.queue.get_nowait())
            try:
                if resync:
                    await self._rewrite()  # the changes taken above happened before it: in it already
                    resync = False
                    continue
                add, remove = net_changes([e for batch in changes for e in batch])
                resync = not await self._apply(add, remove)
                if resync:  # not ours any more (maybe another worker's after a flush): name none until rewritten
                    self.slot = 0
            except Exception as e:  # noqa: BLE001 - Redis away: routing loses precision, not correctness
                log.warning("prefix index update failed: %s", e)
                resync = True

    async def _new_slot(self) -> None:
        self.token = f"{self.worker_id}:{uuid.uuid4().hex[:8]}"
        self.slot = int(await self._take(keys=[SLOTS, SIZES, NEXT], args=[self.token, self.lease_ms]))
        self.size = 0

    async def _apply(self, add: list[int], remove: list[int]) -> bool:
        """Write the changes under the slot (in chunks); False when the slot is no longer ours."""
        changes = [(h, True) for h in add] + [(h, False) for h in remove]
        for start in range(0, max(len(changes), 1), UPDATE_CHUNK):
            chunk = changes[start:start + UPDATE_CHUNK]
            adds = [h for h, a in chunk if a]
            hashes = adds + [h for h, a in chunk if not a]
            size = await self._update(
                keys=[SLOTS, SIZES, live_key(self.slot)] + [bucket_key(h) for h in hashes],
                args=[self.slot, self.token, self.lease_ms, len(adds)] + [field(h) for h in hashes])
            if size < 0:
                return False
            self.size = int(size)
        return True

    async def _rewrite(self) -> None:
        """A new slot with the whole cache: entries of the old one may differ from it."""
        old, old_token = self.slot, self.token
        hashes = sorted(set(await self.snapshot())) if self.snapshot is not None else []
        await self._new_slot()
        await self._release_slot(old, old_token)  # the sweeper cleans its entries
        if not await self._apply(hashes, []):
            raise RuntimeError(f"prefix slot {self.slot} lost while being written")
        log.info("prefix index: %d blocks rewritten under slot %d (was %d)", len(hashes), self.slot, old)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        await self._release_slot(self.slot, self.token)  # its entries are swept

    async def _release_slot(self, slot: int, token: str) -> None:
        await self._release(keys=[SLOTS, live_key(slot)], args=[slot, token])


def by_slot(workers: list[WorkerInfo]) -> dict[int, WorkerInfo]:
    """The workers by the slot their registry entry names (made once per registry read)."""
    return {w.prefix_slot: w for w in workers if w.prefix_slot}


def by_worker(holders: Mapping[K, WorkerInfo], held: Mapping[K, int]) -> dict[str, tuple[int, int]]:
    """For the workers holding some of the prompt: (how many leading blocks of it they hold,
    how many blocks their cache holds), from a lookup's answer by slot (or, from the memory
    index, by worker id). Its cost follows the holders found, not the fleet: a worker absent
    from `holders` (the pool's) holds none."""
    return {w.worker_id: (n, w.cached_blocks) for key, n in held.items() if (w := holders.get(key)) is not None}


def queue_lookup(state: Store, p: Pipeline, hashes: list[int]) -> None:
    """Queue the lookup on pipeline `p` (run with `Store.pipelined`); its answer goes to `held_by_slot`."""
    p.evalsha(state.script(_LOOKUP).sha, 0, " ".join(f"{h % BUCKETS}:{field(h)}" for h in hashes))


async def lookup(state: Store, hashes: list[int]) -> dict[int, int]:
    """Slot -> how many leading blocks of `hashes` it holds (slots holding none are absent)."""
    if not hashes:
        return {}
    return held_by_slot((await state.pipelined(lambda p: queue_lookup(state, p, hashes)))[0])


async def cached_blocks(state: Store, workers: list[WorkerInfo], hashes: list[int]) -> dict[str, tuple[int, int]]:
    return by_worker(by_slot(workers), await lookup(state, hashes))


def held_by_slot(answer: list) -> dict[int, int]:
    return {int(answer[i]): int(answer[i + 1]) for i in range(0, len(answer), 2)}


async def sweep(state: Store, holder: str, period_s: float) -> int:
    """One step of removing dead slots' entries (a slot whose live key is gone): a pass over
    every bucket in steps of SWEEP_BUCKETS, for the dead slots found when the pass began; at
    its end those slots are forgotten. Returns the entries changed. Router replicas call it
    every `period_s` and take turns (one step per period); a step's calls are short, so Redis
    keeps answering other clients between them."""
    if not await state.call(lambda p: p.set(SWEEP + ":turn", holder, nx=True, px=int(period_s * 900))):
        return 0
    raw = await state.call(lambda p: p.hgetall(SWEEP))
    dead, cursor = raw.get(b"dead", b"").decode(), int(raw.get(b"cursor", b"0"))
    if not dead:
        slots = [s.decode() for s in await state.call(lambda p: p.hkeys(SLOTS))]
        alive = await state.pipelined(lambda p: [p.exists(live_key(s)) for s in slots])
        dead = ",".join(s for s, a in zip(slots, alive) if not a)
        if not dead:
            return 0
        cursor = 0
    script, removed = state.script(_SWEEP), 0
    end = min(cursor + SWEEP_BUCKETS, BUCKETS)
    for start in range(cursor, end, SWEEP_CHUNK):
        keys = [bucket(n) for n in range(start, min(start + SWEEP_CHUNK, end))]
        removed += int(await script(keys=keys, args=dead.split(",")))
    if end >= BUCKETS:  # pass done: the slots are gone from every bucket
        gone = dead.split(",")
        await state.pipelined(lambda p: (p.hdel(SLOTS, *gone), p.hdel(SIZES, *gone), p.delete(SWEEP)),
                              transaction=True)
    else:
        await state.call(lambda p: p.hset(SWEEP, mapping={"dead": dead, "cursor": end}))
    return removed
