"""A request's life as phases, and what to do when one lasts too long (pure functions).

Each service appends an event when a request enters a phase it runs (pdserve/shared/state/requests.py keeps
them in Redis, in order of arrival):

    received      gateway    owner = the gateway holding the client's connection
    routed        router     mode local/remote, decode (and prefill) worker, reason; attempt n
    prefilling    prefill    the job left the queue and computes (remote prefill)
    transferring  prefill    the last layer is computed; the rest of the KV is on its way
    prefill_local decode     the handoff failed (or the prefill worker was lost): prefilled there
    decoding      decode     the sequence produced its first token on the decode worker
    finished / failed / cancelled    gateway (terminal)

plus events that are not phases: `failover` (gateway, a new attempt), `replayed` (gateway:
chunks lost on the bus asked again of the decode worker) and `stalled` (supervisor). A
failover starts the phases again under the next attempt, so the request's status is the
furthest phase of its latest attempt, unless it has ended.

Deadlines: every phase between placement and the end has one, and the writer sets it when it
records the phase; a decode worker pushes a request's deadline on while tokens come. A
request overdue with its gateway alive is stalled (a worker that heartbeats but does not
advance: a hung step, a lost job) — the supervisor tells the gateway, which moves it like a
lost worker. A request whose gateway is gone has no one to read its tokens — the
supervisor cancels it everywhere.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict

Phase = Literal["received", "routed", "prefilling", "transferring", "prefill_local", "decoding",
                "finished", "failed", "cancelled"]
PHASES: tuple[str, ...] = get_args(Phase)
TERMINAL = frozenset({"finished", "failed", "cancelled"})
MARKS = ("failover", "stalled", "replayed")  # events that are not phases
RANK = {p: i for i, p in enumerate(PHASES)}
PLACEMENT_TIMEOUT_S = 5.0        # a hop between phases before the first token, on top of the work


class Event(BaseModel):
    model_config = ConfigDict(extra="allow")  # phase-specific fields (mode, reason, decode, ...)

    t: float            # wall clock (seconds since the epoch) when it happened
    event: str          # a phase, or one of MARKS
    attempt: int = 0
    by: str = ""        # the service that recorded it

    @property
    def fields(self) -> dict:
        return dict(self.model_extra or {})


class Summary(BaseModel):
    phase: str = "unknown"
    attempt: int = 0            # the placement the phase belongs to
    latest_attempt: int = 0     # the newest placement begun (a failover may be on its way)
    stalled_attempt: int = -1   # the newest placement the supervisor has reported stalled
    since: float = 0.0          # when the phase began
    owner: str = ""             # the gateway with the client
    decode: str = ""            # decode worker of the latest placement
    prefill: str = ""


def summarize(events: list[Event]) -> Summary:
    """The request's status from its events (in any order)."""
    s = Summary()
    attempt_of_phase = -1
    for e in sorted(events, key=lambda e: e.t):
        f = e.fields
        s.owner = f.get("owner", s.owner)
        s.latest_attempt = max(s.latest_attempt, e.attempt)
        if e.event == "stalled":
            s.stalled_attempt = max(s.stalled_attempt, e.attempt)
        if e.event in TERMINAL:
            return s.model_copy(update={"phase": e.event, "since": e.t, "attempt": max(s.attempt, e.attempt)})
        if e.event not in RANK:
            continue
        if e.attempt > attempt_of_phase or (e.attempt == attempt_of_phase and RANK[e.event] >= RANK[s.phase]):
            s.phase, s.since, s.attempt, attempt_of_phase = e.event, e.t, e.attempt, e.attempt
            if e.event == "routed":
                s.decode, s.prefill = f.get("decode", ""), f.get("prefill", "")
    return s


def deadline_s(phase: str, prompt_tokens: int, stall_s: float, min_prefill_tokens_per_s: float) -> float | None:
    """How long a request may stay in `phase` before it counts as stalled (None: no limit).
    Before the first token the prompt's compute is allowed at a slow rate, on top of a stall
    period (the KV deadline and a local prefill fit within it); decoding may go `stall_s`
    without a token."""
    if phase in ("routed", "prefilling", "transferring", "prefill_local"):
        return stall_s + PLACEMENT_TIMEOUT_S + prompt_tokens / min_prefill_tokens_per_s
    if phase == "decoding":
        return stall_s
    return None  # received: the gateway is placing it (and gives up itself); terminal: over


def kv_deadline_s(expected_prefill_s: float, factor: float, floor_s: float, ceiling_s: float) -> float:
    """How long a decode worker waiting for a handoff's KV lets the prefill worker's engine
    step run with no KV coming before it counts that worker as frozen: `factor` x the
    prefill's predicted time (the prefill worker's queue and the prompt's uncached part at its
    measured rate), within [floor_s, ceiling_s]; unknown (0): the ceiling. A frozen prefill
    worker is found out in about that time, not a fixed 30 s; a busy one (its steps come and
    go) is waited for up to the ceiling with no KV."""
    if expected_prefill_s <= 0:
        return ceiling_s
    return min(ceiling_s, max(floor_s, factor * expected_prefill_s))


Verdict = Literal["forget", "wait", "stalled", "abandoned", "unheeded"]


def verdict(s: Summary, owner_alive: bool, decode_alive: bool) -> Verdict:
    """What the supervisor does with an overdue request.

    forget     it has ended, or its events are gone (expired): the deadline entry is stale
    abandoned  its gateway is gone: nobody reads its tokens; cancel it everywhere
    wait       the gateway is placing it (first or again after a failover), or its decode
               worker is gone (the gateway moves it on the lease; no second signal)
    stalled    its workers are alive but it does not advance: tell the gateway to move it
    unheeded   reported stalled before and still not moved: no gateway acts on it (its end
               was never recorded, or its stream never started) — cancel it everywhere
    """
    if s.phase in TERMINAL or s.phase == "unknown":
        return "forget"
    if s.owner and not owner_alive:
        return "abandoned"
    if s.phase == "received" or s.latest_attempt > s.attempt or not decode_alive:
        return "wait"
    return "unheeded" if s.stalled_attempt >= s.attempt else "stalled"
