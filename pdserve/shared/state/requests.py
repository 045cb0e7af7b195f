"""Request state: each request's events and summary, its deadline while in flight, the
supervisor's lease on judging it, and the gateway that owns it (its client's connection)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from redis.asyncio.client import Pipeline

from pdserve.shared.lifecycle import TERMINAL, Event, deadline_s
from pdserve.shared.notes import Note, Notes
from pdserve.shared.state.keys import (
    DEADLINES,
    ENDED,
    ENDED_KEEP_S,
    GATEWAYS,
    REQUEST_TTL_S,
    log_key,
    owned_key,
    request_key,
    supervisor_key,
)
from pdserve.shared.state.store import Store

# phases after which a request's prefill job has nothing left to do: prefilled on its decode worker, or ended
PREFILLED_ELSEWHERE = ("prefill_local", *sorted(TERMINAL))
# Deadlines are scored on Redis's clock, not the writer's: a fleet's hosts' clocks differ, and
# the supervisor (on another host) compares every deadline with one "now". A push (PUSH_DEADLINES) only
# moves a deadline later, and adds one a restarted Redis lost unless the request is among those that
# ended lately (ENDED, kept ENDED_KEEP_S: a push that lands after its request's end resurrects nothing).
# KEYS: the deadlines, the ended; ARGV: seconds from now, the request ids.
PUSH_DEADLINES = """
local t = redis.call('TIME')
local at = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
for i = 2, #ARGV do
  if not redis.call('ZSCORE', KEYS[2], ARGV[i]) then redis.call('ZADD', KEYS[1], 'GT', at, ARGV[i]) end
end
"""
# One event (Requests.record) in two scripts, one per hash tag (pdserve/shared/state/keys.py), queued on one
# round trip. NOTE, the request's own keys: its log, its summary; ARGV: the event (JSON), the TTL in flight, the
# TTL once ended (history), whether this event ends it, then the summary's fields and values. An event after the
# end (a late mark) keeps the history's TTL.
NOTE = """
local ttl = ARGV[2]
if ARGV[4] == '1' or """ + " or ".join(f"redis.call('HEXISTS', KEYS[2], 't_{p}') == 1" for p in sorted(TERMINAL)) + """
then ttl = ARGV[3] end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], unpack(ARGV, 5))
if tonumber(ttl) > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
else
  redis.call('DEL', KEYS[1], KEYS[2])
end
"""
# FLIGHT, the requests in flight: the deadlines, its gateway's requests, the gateways, the ended; ARGV: the
# request id, 'end' | 'deadline' | '', the deadline's seconds from now, 'file' | 'unfile' | '' (under its
# gateway), the gateway, how long an ended request stays among the ended. A deadline for a request that ended
# (a phase's event landing after the end) is not set.
FLIGHT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if ARGV[2] == 'end' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('ZADD', KEYS[4], now, ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[6]))
  redis.call('EXPIRE', KEYS[4], ARGV[6])
elseif ARGV[2] == 'deadline' and not redis.call('ZSCORE', KEYS[4], ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
end
if ARGV[4] == 'unfile' then
  redis.call('SREM', KEYS[2], ARGV[1])
elseif ARGV[4] == 'file' then
  redis.call('SADD', KEYS[2], ARGV[1])
  redis.call('SADD', KEYS[3], ARGV[5])
end
"""
OVERDUE = """
local t = redis.call('TIME')
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', tonumber(t[1]) + tonumber(t[2]) / 1000000, 'LIMIT', 0, ARGV[1])
"""


class Requests:
    def __init__(self, store: Store, stall_s: float = 30.0, min_prefill_tokens_per_s: float = 50.0,
                 history_s: float = 600.0):
        self.store = store
        self.stall_s, self.min_prefill_tokens_per_s = stall_s, min_prefill_tokens_per_s  # phase deadlines
        self.history_s = history_s  # how long a finished request's own keys stay
        self.notes = Notes(self._send)

    def note(self, request_id: str, phase: str, by: str = "", attempt: int = 0, prompt_tokens: int = 0,
             also: Callable[[Pipeline], None] | None = None, at: float | None = None, **fields: str | int) -> None:
        """`record` in the background, its deadline from the phase: the caller never waits on
        Redis (a Redis away costs the request's history, logged, not its progress). `also`
        queues more writes on the same round trip. The event's time is `at` (default now), when
        it happened, not when the write gets to run (the timeline orders events from several
        processes by it). Queued for one writer (pdserve/shared/notes.py): an event another process acts
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
        """One round trip. A Redis that lost the scripts runs none of the notes and the batch is sent
        again whole (`Store.pipelined`): only the `also` writes (idempotent) run twice (on a Redis
        Cluster where one node restarted alone, the notes on the others too: a log may then hold an
        event twice)."""
        shas = self.store.script(NOTE).sha, self.store.script(FLIGHT).sha

        def build(p: Pipeline) -> None:
            for n in notes:
                _queue_note(p, shas, n, self.history_s)
        await self.store.pipelined(build)

    async def summary(self, request_id: str) -> dict[str, str]:
        """The latest event recorded (`phase`), the fields and a timestamp per phase (`t_<phase>`)."""
        raw = await self.store.r.hgetall(request_key(request_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def events(self, request_id: str) -> list[Event]:
        return [Event.model_validate_json(e) for e in await self.store.r.lrange(log_key(request_id), 0, -1)]

    # -- deadlines and supervision ---------------------------------------------------------
    async def progressed(self, request_ids: list[str], deadline_s: float) -> None:
        """These requests advanced: push their deadlines on (one a restarted Redis lost is added again;
        none for a request that ended)."""
        if request_ids:
            await self.store.script(PUSH_DEADLINES)(keys=[DEADLINES, ENDED], args=[deadline_s, *request_ids])

    async def overdue(self, limit: int = 100) -> list[str]:
        return [r.decode() for r in await self.store.script(OVERDUE)(keys=[DEADLINES], args=[limit])]

    async def postpone(self, request_id: str, deadline_s: float) -> None:
        await self.progressed([request_id], deadline_s)

    async def forget(self, request_id: str) -> None:
        await self.store.r.zrem(DEADLINES, request_id)

    async def claim_supervision(self, request_id: str, holder: str, lease_s: float) -> bool:
        """One supervisor judges a request per lease (replicas skip it meanwhile)."""
        return bool(await self.store.r.set(supervisor_key(request_id), holder, nx=True,
                                           px=int(lease_s * 1000)))

    # -- gateway ownership -----------------------------------------------------------------
    async def owners(self) -> list[str]:
        """Gateways that have filed requests."""
        return [g.decode() for g in await self.store.r.smembers(GATEWAYS)]

    async def take_owned(self, gateway_id: str, count: int = 1000) -> list[str]:
        """Remove and return requests filed under a gateway (SPOP: replicas get disjoint ones);
        the gateway leaves the list once it has none."""
        taken = [r.decode() for r in await self.store.r.spop(owned_key(gateway_id), count) or []]
        if not taken:
            await self.store.r.srem(GATEWAYS, gateway_id)
        return taken


def _queue_note(p: Pipeline, shas: tuple[str, str], n: Note, history_s: float) -> None:
    """The writes of one event (Requests.record) on pipeline `p`: the NOTE script, FLIGHT's where the
    event moves a deadline or a filing (`shas`: theirs), and `also`; the request's own keys kept
    `history_s` once it has ended."""
    event = Event(t=n.at, event=n.phase, attempt=n.attempt, by=n.by, **n.fields)
    owner = str(n.fields.get("owner") or "")
    summary = {"phase": n.phase, f"t_{n.phase}": f"{n.at:.6f}", "attempt": str(n.attempt),
               **{k: str(v) for k, v in n.fields.items() if v not in ("", None)}}
    deadline = "end" if n.phase in TERMINAL else "deadline" if n.deadline_s is not None else ""
    filing = "unfile" if owner and n.phase in TERMINAL else "file" if owner and n.phase == "received" else ""
    p.evalsha(shas[0], 2, log_key(n.request_id), request_key(n.request_id), event.model_dump_json(), REQUEST_TTL_S,
              math.ceil(history_s), int(n.phase in TERMINAL), *(x for kv in summary.items() for x in kv))
    if deadline or filing:
        p.evalsha(shas[1], 4, DEADLINES, owned_key(owner or "-"), GATEWAYS, ENDED, n.request_id, deadline,
                  n.deadline_s if n.deadline_s is not None else 0, filing, owner, ENDED_KEEP_S)
    if n.also is not None:
        n.also(p)
