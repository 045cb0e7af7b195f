"""Redis keys (prefix `pd:`) and typed accessors.

    pd:worker:<id>   WorkerInfo JSON, expires with the heartbeat lease (a dead worker vanishes)
    pd:workers       set: the ids registered (read with their entries in one call; never a keyspace scan)
    pd:req:<id>      hash: the latest event recorded (`phase`), the fields (mode, reason, workers) and a
                     timestamp per phase (expires after a day)
    pd:req:<id>:log  list: the request's events in order of arrival (shared/lifecycle.py)
    pd:deadlines     sorted set: requests in flight, scored by when their phase is overdue
    pd:owned:<gw>    set: requests whose client is connected to gateway <gw>
    pd:gateways      set: gateways with requests filed (what the supervisor checks)
    pd:session:<id>  the decode worker of a conversation's last turn (expires when idle)
    pd:route:<id>    hash: a request's placement as it is decided — its decode worker, then the
                     router's reply (router replicas answer a repeated request from it)
    pd:route:<id>:claim  the router placing the request now (expires: a dead router's lapses)
    pd:prefix:*      the prefix index: which workers' caches hold which blocks (shared/prefix_index.py)
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from shared.lifecycle import TERMINAL, Event, deadline_s
from shared.messages import WorkerInfo
from shared.notes import Note, Notes
from shared.urls import async_redis

log = logging.getLogger(__name__)
REQUEST_TTL_S = 24 * 3600
MAX_CONNECTIONS = 64  # per process
PREFILLED_ELSEWHERE = ("prefill_local",)  # phases after which a request's prefill job has nothing left to do


def worker_key(worker_id: str) -> str:
    return f"pd:worker:{worker_id}"


def request_key(request_id: str) -> str:
    return f"pd:req:{request_id}"


def placement_key(request_id: str, attempt: int) -> str:
    """A placement's name in the routers' records: a failover's is a new placement."""
    return f"{request_id}#{attempt}" if attempt else request_id


def log_key(request_id: str) -> str:
    return f"pd:req:{request_id}:log"


WORKERS = "pd:workers"
REGISTRY_SEQ = "pd:registry:seq"          # counts registry changes (heartbeats, departures)
REGISTRY_CHANGES = "pd:registry:changes"  # sorted set: worker id by the number of its latest change
REGISTRY_EPOCH = "pd:registry:epoch"      # set with the first change: a Redis that restarted empty has another
DEADLINES = "pd:deadlines"
# Deadlines are scored on Redis's clock, not the writer's: a fleet's hosts' clocks differ, and
# the supervisor (on another host) compares every deadline with one "now". ARGV: seconds from
# now, 'set' (any) or 'push' (only later, only those still there), the request ids.
SET_DEADLINES = """
local t = redis.call('TIME')
local at = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
for i = 3, #ARGV do
  if ARGV[2] == 'push' then redis.call('ZADD', KEYS[1], 'XX', 'GT', at, ARGV[i])
  else redis.call('ZADD', KEYS[1], at, ARGV[i]) end
end
"""
OVERDUE = """
local t = redis.call('TIME')
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', tonumber(t[1]) + tonumber(t[2]) / 1000000, 'LIMIT', 0, ARGV[1])
"""
GATEWAYS = "pd:gateways"   # gateways that have filed requests (the supervisor's list to check)


@dataclass
class RegistryChanges:
    epoch: str
    seq: int                                             # the latest change included
    full: bool                                           # every registered worker (a first read, a new epoch)
    entries: list[tuple[str, WorkerInfo | None, float]]  # (id, entry or None: gone, lease left in s)


def owned_key(gateway_id: str) -> str:
    return f"pd:owned:{gateway_id}"


def session_key(session_id: str) -> str:
    return f"pd:session:{session_id}"


def route_key(request_id: str) -> str:
    return f"pd:route:{request_id}"


# take a request's placing, or renew it when this router holds it
_CLAIM = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# the claim taken or renewed, then the decode worker about to be asked noted on the placement
_HOLD = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
redis.call('HSET', KEYS[2], 'decode', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
"""

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
# not ARGV[1]; then ids whose lease lapsed leave the set and the change log):
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
  for j = i, math.min(i + 999, #ids) do keys[#keys + 1] = 'pd:worker:' .. ids[j] end
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


class State:
    def __init__(self, r: aioredis.Redis, stall_s: float = 30.0, min_prefill_tokens_per_s: float = 50.0):
        self.r = r
        self.stall_s, self.min_prefill_tokens_per_s = stall_s, min_prefill_tokens_per_s  # phase deadlines
        self.notes = Notes(self._send)
        self._scripts: dict[str, AsyncScript] = {}
        self._decoded: dict[bytes, WorkerInfo] = {}  # registry entries as last read: unchanged ones not decoded again

    @classmethod
    def connect(cls, url: str, stall_s: float = 30.0, min_prefill_tokens_per_s: float = 50.0) -> State:
        """One Redis or a Sentinel-watched primary (shared/urls.py); a blocking pool: a burst of
        concurrent calls waits for a connection instead of failing."""
        return cls(async_redis(url, MAX_CONNECTIONS), stall_s, min_prefill_tokens_per_s)

    @classmethod
    def for_service(cls, settings) -> State:
        """The store for a service: its URL and its phase-deadline settings (shared/config.Common)."""
        return cls.connect(settings.redis_url, settings.stall_s, settings.stall_min_prefill_tokens_per_s)

    async def close(self) -> None:
        await self.notes.flush(2)
        await self.r.aclose()
        sentinels = getattr(self.r.connection_pool, "sentinel_manager", None)  # (redis+sentinel://)
        if sentinels is not None:
            await sentinels.aclose()

    def script(self, source: str) -> AsyncScript:
        """A Lua script of this store (one object per source: its sha is computed once)."""
        if source not in self._scripts:
            self._scripts[source] = self.r.register_script(source)
        return self._scripts[source]

    async def pipelined(self, build, transaction: bool = False) -> list:
        """One round trip: `build(pipeline)` queues commands (scripts by `evalsha` of
        `script(...).sha`); a Redis that lost the scripts (restarted) gets them again, once."""
        for again in (False, True):
            async with self.r.pipeline(transaction=transaction) as p:
                build(p)
                try:
                    return await p.execute()
                except NoScriptError:
                    if again:
                        raise
            for script in list(self._scripts.values()):  # others may register scripts meanwhile
                await self.r.script_load(script.script)
        raise AssertionError("unreachable")

    # -- worker registry -------------------------------------------------------------------
    async def heartbeat(self, info: WorkerInfo, lease_s: float) -> None:
        await self._beat(info.worker_id, info.encode(), lease_s)

    async def deregister(self, worker_id: str) -> None:
        await self._beat(worker_id, b"", 0.0)

    async def _beat(self, worker_id: str, entry: bytes, lease_s: float) -> None:
        """The entry (or its removal), and its number in the change log the routers read."""
        await self.pipelined(lambda p: p.evalsha(
            self.script(_BEAT).sha, 5, worker_key(worker_id), WORKERS, REGISTRY_SEQ, REGISTRY_CHANGES, REGISTRY_EPOCH,
            entry, max(1, int(lease_s * 1000)), worker_id, uuid.uuid4().hex))

    async def registry_changes(self, epoch: str, since: int, whole: bool = False) -> RegistryChanges:
        """What changed in the registry after change number `since` of `epoch`: a round trip
        whose cost follows the changes, not the fleet (all of it when `whole`, or when `epoch`
        is not the current one: a first read, or a Redis that restarted empty)."""
        raw = await self.pipelined(lambda p: p.evalsha(
            self.script(_CHANGES).sha, 4, REGISTRY_SEQ, REGISTRY_CHANGES, REGISTRY_EPOCH, WORKERS, epoch, since,
            int(whole)))
        raw = raw[0]
        entries = []
        for i in range(3, len(raw), 3):
            value = raw[i + 1]
            info = (self._decoded.get(value) or WorkerInfo.decode(value)) if value else None
            if info is not None:
                self._decoded[value] = info
            entries.append((raw[i].decode(), info, int(raw[i + 2]) / 1e3))
        if len(self._decoded) > 4 * max(len(entries), 256):  # decoded entries of past reads
            self._decoded.clear()
        return RegistryChanges(raw[0].decode(), int(raw[1]), bool(raw[2]), entries)

    async def alive(self, worker_id: str) -> bool:
        """Its lease holds (it heartbeats, draining or not)."""
        return bool(await self.r.exists(worker_key(worker_id)))

    async def entries(self, worker_ids: list[str]) -> dict[str, WorkerInfo | None]:
        """The registry entries of `worker_ids` (None where the lease has lapsed): one round trip."""
        found = await self.r.mget([worker_key(w) for w in worker_ids])
        return {w: WorkerInfo.decode(raw) if raw else None for w, raw in zip(worker_ids, found)}

    async def present(self, worker_ids: list[str]) -> set[str]:
        """Those of `worker_ids` whose lease holds: one round trip."""
        async with self.r.pipeline(transaction=False) as p:
            for w in worker_ids:
                p.exists(worker_key(w))
            found = await p.execute()
        return {w for w, n in zip(worker_ids, found) if n}

    async def workers(self, role: str | None = None) -> list[WorkerInfo]:
        """The registered workers whose lease holds, by id: one call, whatever else Redis holds."""
        changes = await self.registry_changes("", 0, whole=True)
        return sorted((w for _, w, _ in changes.entries if w is not None and (role is None or w.role == role)),
                      key=lambda w: w.worker_id)

    # -- request state ---------------------------------------------------------------------
    def note(self, request_id: str, phase: str, by: str = "", attempt: int = 0, prompt_tokens: int = 0,
             also: Callable[[Pipeline], None] | None = None, at: float | None = None, **fields: str | int) -> None:
        """`record` in the background, its deadline from the phase: the caller never waits on
        Redis (a Redis away costs the request's history, logged, not its progress). `also`
        queues more writes on the same round trip. The event's time is `at` (default now), when
        it happened, not when the write gets to run (the timeline orders events from several
        processes by it). Queued for one writer (shared/notes.py): an event another process acts
        on is kept until written, a history-only one may be dropped while Redis is away."""
        if prompt_tokens:
            fields["prompt_tokens"] = prompt_tokens
        self.notes.add(Note(request_id, phase, by, attempt, deadline_s(phase, prompt_tokens, self.stall_s,
                                                                       self.min_prefill_tokens_per_s),
                            also, time.time() if at is None else at, fields))

    async def record(self, request_id: str, phase: str, by: str = "", attempt: int = 0,
                     deadline_s: float | None = None, also: Callable[[Pipeline], None] | None = None,
                     at: float | None = None, **fields: str | int) -> None:
        """A request entered `phase` (or a mark: failover, stalled) `at` (default: now): append
        the event to its log, update its summary, and set when the phase is overdue (or, at the
        end, clear it). A `received` with `owner` files the request under its gateway."""
        await self._send([Note(request_id, phase, by, attempt, deadline_s, also,
                               time.time() if at is None else at, fields)])

    async def _send(self, notes: list[Note]) -> None:
        async with self.r.pipeline(transaction=False) as p:
            for n in notes:
                _queue_note(p, n)
            await p.execute()

    async def request(self, request_id: str) -> dict[str, str]:
        raw = await self.r.hgetall(request_key(request_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def events(self, request_id: str) -> list[Event]:
        return [Event.model_validate_json(e) for e in await self.r.lrange(log_key(request_id), 0, -1)]

    async def progressed(self, request_ids: list[str], deadline_s: float) -> None:
        """These requests advanced: push their deadlines on (only those still in flight)."""
        if request_ids:
            await self.script(SET_DEADLINES)(keys=[DEADLINES], args=[deadline_s, "push", *request_ids])

    async def overdue(self, limit: int = 100) -> list[str]:
        return [r.decode() for r in await self.script(OVERDUE)(keys=[DEADLINES], args=[limit])]

    async def postpone(self, request_id: str, deadline_s: float) -> None:
        await self.script(SET_DEADLINES)(keys=[DEADLINES], args=[deadline_s, "push", request_id])

    async def forget(self, request_id: str) -> None:
        await self.r.zrem(DEADLINES, request_id)

    async def claim_supervision(self, request_id: str, holder: str, lease_s: float) -> bool:
        """One supervisor judges a request per lease (replicas skip it meanwhile)."""
        return bool(await self.r.set(request_key(request_id) + ":supervisor", holder, nx=True,
                                     px=int(lease_s * 1000)))

    async def owners(self) -> list[str]:
        """Gateways that have filed requests."""
        return [g.decode() for g in await self.r.smembers(GATEWAYS)]

    async def take_owned(self, gateway_id: str, count: int = 1000) -> list[str]:
        """Remove and return requests filed under a gateway (SPOP: replicas get disjoint ones);
        the gateway leaves the list once it has none."""
        taken = [r.decode() for r in await self.r.spop(owned_key(gateway_id), count) or []]
        if not taken:
            await self.r.srem(GATEWAYS, gateway_id)
        return taken

    # -- sessions --------------------------------------------------------------------------
    async def session_worker(self, session_id: str | None) -> str | None:
        if not session_id:
            return None
        v = await self.r.get(session_key(session_id))
        return v.decode() if v is not None else None

    async def set_session_worker(self, session_id: str, worker_id: str, ttl_s: float) -> None:
        await self.r.set(session_key(session_id), worker_id, px=int(ttl_s * 1000))

    # -- placements (idempotent routing) -----------------------------------------------------
    def queue_claim_route(self, p, request_id: str, router_id: str, lease_s: float) -> None:
        """Queue on pipeline `p`: take the placing of a request, or renew this router's hold on
        it; answers 1, or 0 when another router holds it."""
        p.evalsha(self.script(_CLAIM).sha, 1, route_key(request_id) + ":claim", router_id, int(lease_s * 1000))

    async def claim_route(self, request_id: str, router_id: str, lease_s: float) -> bool:
        return bool((await self.pipelined(lambda p: self.queue_claim_route(p, request_id, router_id, lease_s)))[0])

    async def hold_route(self, request_id: str, router_id: str, lease_s: float, decode: str, ttl_s: float) -> bool:
        """Renew the claim and note the decode worker about to be asked, in one call (a router
        taking over a lapsed claim asks that worker first); False if another router holds it."""
        key = route_key(request_id)
        return bool((await self.pipelined(lambda p: p.evalsha(
            self.script(_HOLD).sha, 2, key + ":claim", key, router_id, int(lease_s * 1000), decode,
            int(ttl_s * 1000))))[0])

    async def release_route(self, request_id: str) -> None:
        """Give up the placing (a refusal): the next attempt decides afresh."""
        await self.r.delete(route_key(request_id) + ":claim", route_key(request_id))

    @staticmethod
    def queue_note_route(p: Pipeline, request_id: str, ttl_s: float, **fields: str) -> None:
        key = route_key(request_id)
        p.hset(key, mapping=fields)
        p.pexpire(key, int(ttl_s * 1000))

    async def route(self, request_id: str) -> dict[str, str]:
        """What is known of a request's placement: {"decode": worker, "reply": RouteReply JSON}."""
        raw = await self.r.hgetall(route_key(request_id))
        return {k.decode(): v.decode() for k, v in raw.items()}


def _queue_note(p: Pipeline, n: Note) -> None:
    """The writes of one event (State.record) on pipeline `p`."""
    event = Event(t=n.at, event=n.phase, attempt=n.attempt, by=n.by, **n.fields)
    key, owner = request_key(n.request_id), str(n.fields.get("owner") or "")
    p.rpush(log_key(n.request_id), event.model_dump_json())
    p.expire(log_key(n.request_id), REQUEST_TTL_S)
    p.hset(key, mapping={"phase": n.phase, f"t_{n.phase}": f"{n.at:.6f}", "attempt": str(n.attempt),
                         **{k: str(v) for k, v in n.fields.items() if v not in ("", None)}})
    p.expire(key, REQUEST_TTL_S)
    if n.phase in TERMINAL:
        p.zrem(DEADLINES, n.request_id)
        if owner:
            p.srem(owned_key(owner), n.request_id)
    elif n.deadline_s is not None:
        p.eval(SET_DEADLINES, 1, DEADLINES, n.deadline_s, "set", n.request_id)  # (text: no NOSCRIPT to retry)
    if n.phase == "received" and owner:
        p.sadd(owned_key(owner), n.request_id)
        p.sadd(GATEWAYS, owner)
    if n.also is not None:
        n.also(p)
