"""Typed, versioned messages that cross a process boundary, grouped by the service that receives them. Each carries
`request_id`; the trace context travels in the NATS headers. Encode with `.encode()`, decode with `Model.decode(b)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from pdserve.shared.engine.grammar import Grammar
from pdserve.shared.engine.logprobs import Logprob
from pdserve.shared.engine.sequence import SamplingParams

if TYPE_CHECKING:
    from pdserve.shared.engine.engine import RequestOutput


class Message(BaseModel):
    """Made in code: unknown fields are refused (a misspelt field is a bug). Decoded from the wire: fields this version
    does not know are ignored, so a newer service may add optional fields while older ones still run (rolling
    upgrades); a change older services cannot read safely raises `v`, which they refuse."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    v: Literal[1] = 1

    def encode(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        return cls.model_validate_json(data, extra="ignore")


class Sampling(Message):
    """Wire form of the engine's SamplingParams."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None
    cache_salt: str = ""  # the prefix cache's partition (a tenant's): hashing.py
    tenant: str = ""      # who asked (an API key's name, or a client address): the prefill queue's fairness
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative_tokens: int | None = None  # draft tokens per decode step (None: the worker's setting)

    def to_engine(self) -> SamplingParams:
        return SamplingParams(**self.model_dump(exclude={"v", "grammar"}), grammar=self.grammar)


# -- to the router ------------------------------------------------------------------------
class RouteRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    model: str
    session_id: str | None = None   # turns of one conversation (decode affinity)
    attempt: int = 0                # placements before this one (failover after a decode worker was lost)
    generated_token_ids: list[int] = []  # tokens already generated and streamed: continue after them
    avoid_workers: list[str] = []   # decode workers to try last (the one this request stalled on)
    secret: str = ""                # this placement's: its chunks' MACs (pdserve/shared/macs.py); its workers' only
    crashes: int = 0                # charged to it so far: its first passes run alone (pdserve/shared/quarantine.py)


class Requeue(Message):
    """decode worker → router, request/reply: the prefill worker computing this request's KV
    is gone (its lease lapsed) or late (no KV by the deadline). Which other prefill worker
    computes it now, for this decode worker's reservation? Answered with Requeued."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    decode_worker: str
    avoid_workers: list[str]              # prefill workers not to ask (gone, or late with this request's KV)
    why: Literal["gone", "late"] = "gone"  # what happened to the last one
    generated_token_ids: list[int] = []   # a failover's placement: tokens streamed before it
    attempt: int = 0
    cache_salt: str = ""                  # as its Sampling's


class Requeued(Message):
    request_id: str
    prefill_worker: str | None = None     # None: prefill on the decode worker (no other fits)
    reason: str = ""
    expected_prefill_s: float = 0.0       # as AdmitRequest's
    quarantined: bool = False             # it crashed workers (pdserve/shared/quarantine.py): fail it, `reason`
    crashes: int = 0                      # crashes charged to it now (the one left included): as RouteRequest's


# -- to the gateway -----------------------------------------------------------------------
class RouteReply(Message):
    request_id: str
    ok: bool
    mode: Literal["remote", "local"] | None = None   # where the prompt is prefilled
    reason: str = ""                                 # why this placement, or why refused
    prefill_worker: str | None = None
    decode_worker: str | None = None
    retry_after_s: float = 0.0                        # refused as over the TTFT objective: retry then


class TokenChunk(Message):
    """One step of output. `seq` is the index of the first token in `token_ids` among the
    generated tokens, so the gateway sees duplicates and gaps."""

    request_id: str
    seq: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    logprobs: list[Logprob] | None = None               # one per token in token_ids, when asked
    prompt_logprobs: list[Logprob | None] | None = None  # with seq 0, when asked (None: the first token's)
    attempt: int = 0      # the placement it was generated for: the gateway takes only its current one's
    worker: str = ""      # who published it
    quarantined: bool = False  # `error`: the request crashed workers and is not placed again (a 422)

    @classmethod
    def from_output(cls, out: RequestOutput, attempt: int, worker: str) -> TokenChunk:
        return cls(request_id=out.request_id, seq=out.num_generated_tokens - len(out.new_token_ids),
                   token_ids=out.new_token_ids, text=out.text, finished=out.finished, finish_reason=out.finish_reason,
                   prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_generated_tokens,
                   cached_tokens=out.num_cached_tokens, error=out.error, logprobs=out.logprobs,
                   prompt_logprobs=out.prompt_logprobs, attempt=attempt, worker=worker)


# -- to a decode worker -------------------------------------------------------------------
class AdmitRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    mode: Literal["remote", "local"]
    prefill_worker: str | None = None
    generated_token_ids: list[int] = []   # mode local, failover: prefilled with the prompt, count as generated
    attempt: int = 0                      # the request's placement number (a failover is a new admit)
    expected_prefill_s: float = 0.0       # remote: the prefill worker's queue + this prompt, predicted (0: unknown)
    secret: str = ""                      # the placement's (RouteRequest.secret): its chunks are signed with it
    crashes: int = 0                      # as RouteRequest's


class AdmitReply(Message):
    request_id: str
    ok: bool
    reason: str = ""
    first_block: int = 0      # blocks before this one are cached here: not to be sent
    num_blocks: int = 0       # blocks for the whole prompt
    kv_tag: int = 0           # UCX tag base for this request's KV messages


class SegmentRef(BaseModel):
    """Where a KV payload is in its sender's shared-memory segment (pdserve/shared/kv/segment.py): the
    segment's file (its inode: the one its owner hands over) and the offset."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    inode: int
    offset: int


class DeviceRef(BaseModel):
    """Where a KV payload is on its sender's device (pdserve/shared/engine/kv_device.py): its pool and blocks."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pool: str                 # the shared pool's handle (kv_device.PoolHandle, encoded)
    block_ids: list[int]      # the sender's blocks, in the notice's order (each layer's the same)


class KVLayer(Message):
    """prefill → decode: `num_layers` consecutive layers from `layer` of a run of blocks are on their way over the KV
    transport (payload on `tag`, layer-major: each layer's blocks in order), or are in the sender's shared-memory
    segment at `segment` or its pool at `device` (a decode worker on the same host that asked for it with
    PrefillJob.decode_host, decode_device). The receiver posts its receive (or copies from the segment or the device)
    when this arrives, checks the layout against its reservation and every block against its checksum before use."""

    request_id: str
    prefill_worker: str       # the sender: acks and re-send requests go to it alone
    fingerprint: str          # model, dtype and block layout of the sender
    tag: int                  # transport tag of the payload: kv_tag <= tag < kv_tag + TAG_SPAN
    layer: int
    first_block: int          # index among the prompt's blocks
    num_blocks: int
    checksums: list[int]      # xxh3-64 of each block's bytes as sent (encoded), layer-major (`device`: block_sums)
    resend: int = Field(0, alias="attempt")  # 0: the first send of these blocks, then 1.. (its name on the wire)
    encoding: Literal["native", "int8"] = "native"   # pdserve/shared/kv/codec.py
    num_layers: int = 1       # (an older receiver sees a checksum count that does not match: refused, never misread)
    segment: SegmentRef | None = None  # the payload is in the sender's segment (same host), not on `tag`
    device: DeviceRef | None = None    # the payload is in the sender's pool on its device (same host), not on `tag`


class KVEnd(Message):
    """prefill → decode: the last layer is sent (ok, with the first token), or the prefill side
    gives the handoff up (not ok: cancelled, fingerprint mismatch, send failure)."""

    request_id: str
    ok: bool
    first_token: int = -1
    first_logprob: Logprob | None = None   # the first token's log probabilities, when the request asks
    prompt_logprobs: list[Logprob | None] | None = None  # and the prompt's (the decode side's chunk log keeps them)
    error: str = ""
    prefill_worker: str = ""  # the sender (a decode side with no receiver answers it)
    kv_tag: int = 0           # the handoff's tag base


class Replay(Message):
    """gateway → decode worker, request/reply: publish again the request's chunks from `from_seq`
    (chunks lost on the bus, e.g. across a NATS restart); answered with ReplayReply."""

    request_id: str
    from_seq: int




class ReplayReply(Message):
    request_id: str
    ok: bool                  # the chunks from `from_seq` on are published again
    chunks: int = 0
    reason: str = ""          # why not: unknown here, or older than what is kept


# -- to a prefill worker ------------------------------------------------------------------
class PrefillJob(Message):
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    decode_worker: str
    decode_address: str       # the decode worker's UCX worker address, hex
    decode_fingerprint: str   # its model/dtype/block layout: the prefill side refuses a mismatch
    first_block: int
    kv_tag: int
    generated_token_ids: list[int] = []  # a failover: tokens streamed before it, prefilled with the prompt
    attempt: int = 0                     # the placement this job is for (a failover's is a new job)
    requeued: bool = False               # moved here off a prefill worker lost or frozen
    decode_host: str = ""                # the decode worker's host identity when it reads same-host KV (segment.py)
    decode_device: str = ""              # and its pool's kind ("cuda") when it reads the prefill worker's pool
    secret: str = ""                     # the placement's (RouteRequest.secret): its first token's chunk is signed
    crashes: int = 0                     # as RouteRequest's (or Requeued's, moved)


class KVAck(Message):
    """decode → prefill: the handoff ended (ok: the KV is committed; its blocks may be freed)."""

    request_id: str
    ok: bool
    error: str = ""
    kv_tag: int = 0           # the handoff answered (its tag base): another handoff of the request ignores it


CANCELLED = "cancelled"  # KVEnd.error of a handoff whose placement was cancelled (nothing should replace it)


class KVResend(Message):
    """decode → prefill: blocks that failed their checksum; send them again."""

    request_id: str
    layer: int
    first_block: int
    num_blocks: int
    resend: int = Field(alias="attempt")  # the re-send this is (1..; its name on the wire, as KVLayer's)


class Ping(Message):
    """Is a subscriber of this subject there? Answered by the subscriber's bus (pdserve/shared/bus.py),
    never handed to its handler; the server answers no responders for a process gone."""


class KVSync(Message):
    """decode -> prefill: the bus was away while this handoff was open, so notices may be lost; publish its KVLayer
    notices and its KVEnd again (the payloads wait in the transport under their tags; the receiver skips those had)."""

    request_id: str


# -- to the routers -----------------------------------------------------------------------
class KVOutcome(Message):
    """How a KV handoff over one prefill → decode path ended (the routers' circuit breakers)."""

    request_id: str
    prefill_worker: str
    decode_worker: str
    ok: bool
    reason: str = ""


# -- prefix caches, worker -> routers (PD_PREFIX_INDEX=events: pdserve/shared/prefix_events.py) ---------
class PrefixEvents(Message):
    """One worker's prefix-cache changes `first` < n <= `last` of its life `epoch` (counted from
    its start), netted: the hashes it holds now among them, and those it no longer holds."""

    worker_id: str
    epoch: str
    first: int
    last: int
    added: list[int] = []
    removed: list[int] = []


class PrefixSnapshotAsk(Message):
    """router -> worker, request/reply: page `page` of its whole prefix cache as taken for `ask`
    (page 0 takes it; the others are read from that copy). Answered with PrefixSnapshot."""

    router_id: str
    ask: str
    page: int = 0


class PrefixSnapshot(Message):
    """A page of a worker's prefix cache: every hash in it once its changes up to `seq` were
    counted (the events with `last` > seq apply on top)."""

    worker_id: str
    epoch: str
    seq: int
    hashes: list[int]
    page: int = 0
    pages: int = 1


# -- to the workers holding the request (pdserve/shared/holders.py) ---------------------------------
FINISHED_IN_PREFILL = "finished in prefill"  # Cancel.reason: only the decode side's reservation ends


class Cancel(Message):
    request_id: str
    reason: str = "client disconnected"
    before_attempt: int | None = None   # a failover: only placements older than this one stop


# -- to the gateway holding the request ------------------------------------------------------
class Stalled(Message):
    """The supervisor's word: the request's workers are alive but it has not advanced past
    its phase's deadline. The gateway moves it as it would from a lost worker."""

    request_id: str
    attempt: int          # the placement that stalled (a later one ignores the word)
    phase: str
    worker: str = ""


# -- to whoever watches the dead letters (the operator) -------------------------------------------
class DeadJob(Message):
    """A prefill job JetStream delivered `deliveries` times without an ack (pdserve/shared/quarantine.py)."""

    request_id: str
    prefill_worker: str   # the consumer that held it
    stream_seq: int
    deliveries: int
    job: str = ""         # the job as queued (PrefillJob JSON), when still in the stream


# -- in the state store ---------------------------------------------------------------------
class WorkerBatch(Message):
    """The requests of a worker's engine pass, recorded before it runs: a crash names them."""

    worker: str
    incarnation: str      # this life of the worker (its start): a crash is counted once per life
    requests: list[str]
    new: list[str] = []   # those on their first pass in this life


class WorkerInfo(Message):
    """A worker's registry entry (Redis, with a heartbeat lease)."""

    worker_id: str
    role: Literal["prefill", "decode", "router", "gateway"]
    model: str = ""
    fingerprint: str = ""
    ucx_address: str = ""     # hex of the UCX worker address (decode workers)
    block_size: int = 16
    total_blocks: int = 0
    free_blocks: int = 0
    growth_blocks: int = 0            # blocks its sequences may still take (each up to its max_tokens)
    running: int = 0
    waiting: int = 0                  # queued, or (decode) waiting for their KV
    queued_tokens: int = 0            # prompt tokens waiting to be computed
    prefill_tokens_per_s: float = 0.0  # measured (recent prefill passes); 0: not yet measured
    draining: bool = False            # stopping: finishes what it holds, takes nothing new
    step_s: float = 0.0               # how long the engine's current step has run (0: between steps)
    slowest_step_s: float = 0.0       # how long a step may take now (EngineHost.slowest_step_s): far longer is hung
    prefix_slot: int = 0              # its slot in the prefix index (pdserve/shared/prefix_index.py); 0: none
    prefix_epoch: str = ""            # the life its prefix events carry (pdserve/shared/prefix_events.py); "": none
    prefix_seq: int = 0               # the prefix-cache changes it has published in that life
    cached_blocks: int = 0            # blocks in its prefix cache
