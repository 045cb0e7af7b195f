"""One settings class per service, from the environment (prefix PD_) or arguments.

Validated once at start in each service's main and passed down; nothing below main reads
the environment. OpenTelemetry reads its own standard variables (OTEL_EXPORTER_OTLP_ENDPOINT…).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSuppress, SettingsConfigDict

from pdserve.shared.urls import cluster_target, nats_servers, sentinel_target

SMOLLM2_ID = "SmolLM2-135M-Instruct"


def model_id(source: str) -> str:
    """The id a model is served under by default: its own for `smollm2` and `gemma3-270m`, a local directory's
    or file's name (a .gguf without its suffix), or the Hugging Face Hub id as given."""
    if source == "smollm2":
        return SMOLLM2_ID
    if source == "gemma3-270m":
        return "gemma-3-270m"
    if source.startswith("fake:"):   # (the fake model's: pdserve/shared/engine/fake.py)
        return "fake-" + model_id(source.removeprefix("fake:"))
    path = Path(source)
    if path.exists():
        return path.stem if path.suffix == ".gguf" else path.resolve().name
    return source


# What nats-py buffers while its connection is away (its pending_size), flushed on reconnect; past
# it a publish raises, which a worker's step path counts and lets go (pdserve/shared/bus.py `tried`).
# nats-py's 2 MiB holds under a second of a busy decode worker's chunks (~300 bytes each); 8 MiB
# carries a NATS restart (reconnect in ~0.5-2 s) without a replay, and stays small beside a model.
NATS_PENDING_BYTES = 8 << 20

LEASE_BEATS = 3  # a registry entry (and a worker's prefix-index slot) lives this many heartbeats unrenewed


def lease_s(heartbeat_s: float) -> float:
    """How long a registry entry lives without a heartbeat: a dead process vanishes by itself."""
    return LEASE_BEATS * heartbeat_s


class Common(BaseSettings):
    # a value that fails validation is not echoed: URLs carry passwords
    model_config = SettingsConfigDict(env_prefix="PD_", extra="ignore", hide_input_in_errors=True)

    nats_url: str = Field("nats://127.0.0.1:4222", description="one server, or a cluster's separated by commas")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="redis://host:port/db, or the primary Sentinels "
                           "watch: redis+sentinel://[:password@]host:port,host:port/<service>[/db], or a Redis "
                           "Cluster's nodes: redis+cluster://[:password@]host:port,host:port (pdserve/shared/urls.py)")
    nats_pending_bytes: int = Field(NATS_PENDING_BYTES, ge=0, description="bytes of publishes kept while the NATS "
                                    "connection is away (flushed on reconnect); past them a publish fails: a "
                                    "worker's token chunk then waits in its chunk log for a replay (0: none kept)")
    enroll_token: str = Field("", description="this role's token with the deployment's identity issuer "
                              "(pdserve/services/issuer): the instance makes a key, is named after it and gets its "
                              "own NATS and Redis users (pdserve/shared/identity.py); empty: the users PD_NATS_URL and "
                              "PD_REDIS_URL name (the local stack)")
    stream_replicas: int = Field(1, ge=1, le=5, description="copies of each stream on the servers of a NATS "
                                 "cluster (JetStream): 3 on a 3-node cluster (the streams' keeper, `pdserve streams`, "
                                 "makes them)")
    prefix_index: Literal["events", "redis"] = Field(
        "events", description="where routers find which worker caches a prompt's blocks; events: workers publish "
        "their cache changes on NATS (JetStream) and each router keeps the index in memory "
        "(pdserve/services/router/prefix_follower.py), a placement asks no one; redis: each worker writes its prefix "
        "cache to Redis, a placement asks it (pdserve/shared/prefix_index.py). Set on routers and workers alike")
    model: str = Field("smollm2", description="smollm2, a .gguf file, a directory (config.json + *.safetensors) or "
                       "a Hugging Face Hub id (from the HF_HOME cache, downloaded there if absent)")
    model_name: str = Field("", description="the id clients ask for (default: the model's own name, model_id)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_format: Literal["text", "json"] = Field("text", description="json: one object per line, with trace_id "
                                                "and request_id (text lines carry them too, when in a request)")
    grammar_preload: bool = Field(True, description="gateway and workers: load the structured-output library (with "
                                  "torch: 2-3 s of CPU) beside the start, not on the first structured request")
    heartbeat_s: float = Field(1.0, gt=0, description=f"worker heartbeat period; the lease is {LEASE_BEATS}x this")
    otlp_endpoint: str | None = Field(None, validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT",
                                      description="OTLP/HTTP collector (Jaeger: http://host:4318)")
    trace_baggage_keys: str = Field("", description="W3C baggage entries (a client's, carried with the trace) "
                                    "copied onto every span as attributes: their keys, separated by commas")
    metrics_port: int = Field(9400, ge=0, description="/metrics, /health and /ready on this port, apart from the "
                              "gateway's API (0: off)")
    metrics_host: str = Field("0.0.0.0", description="address the metrics port listens on (its probes and "
                              "metrics are for the orchestrator and Prometheus: keep it off the public network)")
    stall_s: float = Field(30.0, gt=0, description="a request that does not advance this long (no token while "
                                                   "decoding; past its allowance before the first token) is moved "
                                                   "to another worker (the router's supervisor)")
    stall_min_prefill_tokens_per_s: float = Field(50.0, gt=0, description="before the first token a request is "
                                                  "allowed stall_s + its prompt at this rate")
    history_s: float = Field(600.0, ge=0, description="a finished request's events and summary stay in Redis this "
                             "long (its timeline; 0: removed when it ends); a request in flight keeps them")

    # a renamed setting: old name -> (new name, {old value: new value}); the old name keeps a field of its
    # own (hidden from --help), read for one release and copied onto the new one unless that is set too
    RENAMED: ClassVar[dict[str, tuple[str, dict[Any, Any]]]] = {}

    @model_validator(mode="after")
    def _renamed(self) -> Self:
        for old, (new, values) in self.RENAMED.items():
            value = getattr(self, old)
            if value is not None and new not in self.model_fields_set:
                setattr(self, new, values.get(value, value))
        return self

    @property
    def renamed(self) -> list[str]:
        """A warning for each old name set (logged at start, pdserve/shared/service.py)."""
        notes = []
        for old, (new, values) in self.RENAMED.items():
            if (value := getattr(self, old)) is None:
                continue
            was, name, now = f"PD_{old.upper()}", f"PD_{new.upper()}", getattr(self, new)
            heed = f"reads as {name}={now}" if values.get(value, value) == now else f"is ignored ({name}={now} is set)"
            notes.append(f"{was} is {name} now: {was}={value} {heed}")
        return notes

    @model_validator(mode="after")
    def _served_id(self) -> Self:
        self.model_name = self.model_name or model_id(self.model)
        return self

    @field_validator("nats_url")
    @classmethod
    def _nats_servers(cls, url: str) -> str:
        nats_servers(url)  # a malformed list fails the start, naming what is wrong
        return url

    @field_validator("redis_url")
    @classmethod
    def _redis_target(cls, url: str) -> str:
        sentinel_target(url)
        cluster_target(url)
        return url

    @model_validator(mode="after")
    def _index_on_one_redis(self) -> Self:
        if self.prefix_index == "redis" and cluster_target(self.redis_url) is not None:
            raise ValueError("PD_PREFIX_INDEX=redis needs one Redis (or a Sentinel-watched primary): its scripts "
                             "name keys a Redis Cluster may keep on other nodes; use PD_PREFIX_INDEX=events there")
        return self

    @property
    def lease_s(self) -> float:
        return lease_s(self.heartbeat_s)

    @property
    def absent_s(self) -> float:
        """How long a worker must be missing from the registry to count as gone: more than a
        heartbeat (a Redis restarted empty misses everyone until their next one; pdserve/shared/absence.py)."""
        return 1.5 * self.heartbeat_s


class GatewaySettings(Common):
    gateway_id: str = Field("", description="its instance's name: each start registers as <name>_<random> "
                            "(default name: gateway)")
    gateway_host: str = Field("127.0.0.1", description="address the HTTP API listens on (other than loopback: "
                              "API keys or allow_open)")
    gateway_port: int = Field(8000, description="port the HTTP API listens on")
    route_timeout_s: float = Field(10.0, gt=0, description="router reply deadline")
    token_timeout_s: float = Field(120.0, gt=0, description="longest wait for the next token")
    placement_retry_s: float = Field(30.0, ge=0, description="while no decode worker can take a request (none up, "
                                     "none with room, no router), keep asking this long before answering 503")
    failover_check_s: float = Field(1.0, gt=0, description="after this long without a token, check that the "
                                    "request's decode worker still holds its lease (lost: continue elsewhere)")
    drain_s: int = Field(30, gt=0, description="on SIGTERM, new connections are refused and the streams open "
                           "are finished for up to this long, then closed")
    chat_template: str = Field("", description="a Jinja chat template, or the path of a file holding one, "
                               "rendered instead of the model's own (vLLM's --chat-template)")
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto", description="how the model writes tool calls (vLLM's --tool-call-parser names); auto: the format "
        "its chat template asks for (Llama 3.x: llama3_json), else hermes")
    max_request_bytes: int = Field(1 << 20, gt=0, description="largest request body accepted (413 beyond)")
    keep_alive_s: int = Field(75, gt=0, description="an idle client connection is closed after this long (longer "
                                "than clients' and load balancers' own idle timeouts, so they close first)")
    head_timeout_s: float = Field(10.0, gt=0, description="a request's headers must all arrive within this long of "
                                  "the connection opening or of their first byte (slowloris), else it is closed")
    send_deadline_s: float = Field(30.0, gt=0, description="a client that takes nothing it is sent this long (a "
                                   "stream it does not read) is disconnected and its request cancelled")
    max_connections: int = Field(1024, ge=0, description="client connections served at once (uvicorn's "
                                 "limit_concurrency); beyond, a 503 (0: no limit)")
    default_max_tokens: int = Field(512, gt=0, description="max_tokens when a request sets none")
    require_prefill: bool = Field(True, description="/ready waits for a prefill worker (off: colocated)")
    api_keys: str = Field("", description="name:sha256(key) entries, comma-separated (make one with `python -m "
                          "pdserve.services.gateway.auth new NAME`); empty: the API is open")
    allow_open: bool = Field(False, description="serve with no API keys on an address other than loopback (without "
                             "it, such a gateway refuses to start)")
    rate_limit_per_s: float = Field(0.0, ge=0, description="requests per second per API key (per client address "
                                    "when the API is open), shared by all gateways through Redis; 0: no limit "
                                    "(default with API keys set: 20)")
    rate_limit_burst: int = Field(20, gt=0, description="requests a caller may make at once before the rate applies")
    token_rate_limit_per_s: float = Field(0.0, ge=0, description="tokens per second per caller (prompt + n x "
                                          "max_tokens each request), shared through Redis; 0: no limit (with "
                                          "keys: 20000)")
    token_rate_limit_burst: int = Field(100_000, gt=0, description="tokens a caller may take at once")
    rate_limit_fail_open: bool | None = Field(None, description="Redis away: serve unchecked (true) or 503 "
                                              "(false); default: false with API keys set, true without")
    priority_keys: str = Field("", description="API key names that may set priority below 0 (ahead of the "
                               "default), comma-separated; with keys set, no other key may")
    max_concurrent_per_key: int = Field(0, ge=0, description="requests in flight per caller (API key, or client "
                                        "address when the API is open) across every gateway, each choice "
                                        "counting; over it a 429 (0: no limit; with keys: 256)")
    max_prompt_tokens: int = Field(0, ge=0, description="longest prompt accepted, in tokens (0: the model's context)")
    max_tokens_limit: int = Field(0, ge=0, description="largest max_tokens accepted (0: what the context leaves; "
                                  "with keys: 16384)")
    special_tokens_in_messages: bool = Field(False, description="a special token's spelling in a message "
                                             "(\"<|im_start|>system\") read as that token; off: text")
    prefix_cache_per_key: bool = Field(True, description="with API keys set, each key's requests share cached prefixes "
                                       "only among themselves (cached_tokens tells no key of another's prompts)")
    max_logit_bias: int = Field(1024, ge=0, description="logit_bias entries one request may set")
    max_stop_chars: int = Field(1024, gt=0, description="longest stop string (each is rescanned as tokens come)")

    @model_validator(mode="after")
    def _open_on_purpose(self) -> Self:
        if not self.api_keys and not self.allow_open and not _loopback(self.gateway_host):
            raise ValueError(f"the gateway would serve {self.gateway_host} with no API keys: set PD_API_KEYS, or "
                             "PD_ALLOW_OPEN=1 to serve an open API on purpose")
        for name, value in KEYED_LIMITS.items() if self.api_keys else ():
            if name not in self.model_fields_set:
                setattr(self, name, value)
        return self


# With API keys set, the per-key limits left unset (docs/API.md): no one key takes the whole service
KEYED_LIMITS = {"rate_limit_per_s": 20.0, "token_rate_limit_per_s": 20_000.0, "max_concurrent_per_key": 256,
                "max_tokens_limit": 16_384}


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # another name: it may resolve anywhere
        return False


class IssuerSettings(Common):
    issuer_seed: str = Field("", description="the issuer's account key (a seed, SA...): it signs the instances' "
                             "NATS users; nats-server names its public key as auth_callout issuer "
                             "(`python -m pdserve.services.issuer.keys` makes the deployment's keys and tokens)")
    enroll_gateway: str = Field("", description="the gateways' enrollment token (PD_ENROLL_TOKEN on them)")
    enroll_router: str = Field("", description="the routers' enrollment token")
    enroll_prefill: str = Field("", description="the prefill workers' enrollment token")
    enroll_decode: str = Field("", description="the decode workers' enrollment token")
    issuer_keep_s: float = Field(1.0, gt=0, description="check Redis this often for the users made, making a "
                                 "lost one again (a Redis restarted empty)")

    @property
    def tokens(self) -> dict[str, str]:
        """Each role's enrollment token, by role."""
        return {"gateway": self.enroll_gateway, "router": self.enroll_router, "prefill": self.enroll_prefill,
                "decode": self.enroll_decode}

    @model_validator(mode="after")
    def _complete(self) -> Self:
        tokens = list(self.tokens.values())
        if not self.issuer_seed or not all(tokens):
            raise ValueError("the issuer needs PD_ISSUER_SEED and PD_ENROLL_<ROLE> for every role")
        if len(set(tokens)) < len(tokens):
            raise ValueError("each role needs an enrollment token of its own (PD_ENROLL_<ROLE>)")
        return self


class StreamsSettings(Common):
    keep_s: float = Field(5.0, ge=0, description="check the streams again this often, making a missing one again "
                          "(0: once, then exit)")


class RouterSettings(Common):
    router_id: str = Field("", description="registry id (default: router-<random>)")
    admit_timeout_s: float = Field(5.0, gt=0, description="longest wait for a decode worker's answer to an admit")
    local_prefill_below: int = Field(0, ge=0, description="prompts shorter than this are prefilled "
                                     "on the decode worker (0: always remote when a prefill worker is up)")
    placement: Literal["remote", "cheapest"] = Field(
        "cheapest", description="where prompts are prefilled; cheapest: the prefill pool unless the prompt would "
        "queue there (pool_queue_factor), then the cheaper of the pool and the decode worker, stalls of its "
        "streams included (policy.local_or_remote); remote: the prefill pool whenever one is up (and the prompt "
        "is not below local_prefill_below)")
    pool_queue_factor: float = Field(4.0, ge=0, description="placement=cheapest: the prefill pool takes a prompt "
                                     "while the work queued before it there is at most this many times its own; "
                                     "beyond, the cheaper of the pool and the decode worker")
    stall_weight: float = Field(1.0, ge=0, description="placement=cheapest: weight of the delay a local prefill "
                                "causes each running stream")
    prefill_choice: Literal["soonest", "round_robin"] = Field(
        "soonest", description="which prefill worker takes a prompt; soonest: the one predicted to have its "
        "first token soonest (its queue, its cached prefix, its rate; recompute_weight); round_robin: in turn")
    recompute_weight: float = Field(8.0, ge=0, description="prefill_choice=soonest: weight of recomputing tokens "
                                    "another worker already caches (0: fastest first token per request; "
                                    "`make eval-router` sweeps it)")
    default_prefill_tokens_per_s: float = Field(1000.0, gt=0, description="prefill rate assumed for a worker "
                                                "that has not measured its own yet")
    ttft_slo_s: float = Field(0.0, ge=0, description="refuse (429, Retry-After) a request whose predicted time to "
                              "first token exceeds this; 0: admit everything")
    session_ttl_s: float = Field(3600.0, gt=0, description="a conversation's decode worker is remembered this "
                                 "long after its last turn")
    breaker_failures: int = Field(5, gt=0, description="failed KV handoffs on one prefill -> decode path within "
                                  "breaker_window_s (and no fewer than its successes) that open its breaker")
    breaker_window_s: float = Field(30.0, gt=0, description="the window breaker_failures are counted in")
    breaker_cooldown_s: float = Field(10.0, gt=0, description="an open path is avoided this long, then probed")
    affinity_slack: int = Field(4, ge=0, description="a conversation stays on its decode worker while that "
                                "runs at most this many more sequences than the least loaded")
    supervise_s: float = Field(1.0, gt=0, description="the supervisor's round: overdue requests, lost gateways")
    max_worker_blocks: int = Field(1 << 20, gt=0, description="a worker's registry entry claims at most this many "
                                   "KV blocks (more is taken as this: pdserve/services/router/registry.py)")
    max_prefill_tokens_per_s: float = Field(1e6, gt=0, description="a worker's registry entry claims at most this "
                                            "prefill rate (more is taken as this)")
    max_routes_in_flight: int = Field(256, gt=0, description="placements one router works on at once; beyond, a "
                                      "request is refused at once (the gateway asks again shortly, maybe "
                                      "another replica) instead of queueing behind an overloaded router")

    RENAMED = {"prefill_mode": ("placement", {"cost": "cheapest"}),
               "prefill_policy": ("prefill_choice", {"cost": "soonest"})}
    prefill_mode: CliSuppress[Literal["remote", "cost"] | None] = Field(None, description="placement's old name")
    prefill_policy: CliSuppress[Literal["cost", "round_robin"] | None] = Field(None, description="old prefill_choice")


class WorkerSettings(Common):
    worker_id: str = Field("", description="registry id (default: <role>-<random>)")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1…")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="weights, activations and the KV pool (auto: bfloat16 on CUDA, float32 on CPU)")
    kv_blocks: int | None = Field(None, gt=0, description="KV pool size in blocks of 16 tokens (CPU: 2048)")
    kv_memory_fraction: float = Field(0.9, gt=0, le=1, description="CUDA, no kv_blocks: the share of the device's "
                                      "memory the worker keeps within, its KV pool taking what the weights leave")
    max_num_seqs: int | None = Field(None, gt=0, description="sequences running at once (CPU: 64, CUDA: 256)")
    max_batched_tokens: int | None = Field(None, gt=0, description="tokens in one pass (CPU: 2048, CUDA: 8192)")
    prefill_chunk: int | None = Field(None, gt=0, description="a prompt's tokens in one pass (CPU: 512, CUDA: 2048)")
    mixed_batches: bool = Field(True, description="decode tokens and prompt chunks share a pass; off: they alternate")
    speculative_tokens: int = Field(0, ge=0, le=16, description="draft tokens a decode step (speculative.py); 0: off")
    threads: int = Field(0, ge=0, description="torch threads (0: torch's default)")
    kernels: str = Field("auto", description="auto, torch, triton, triton-unsplit or c (engine/kernels/__init__.py)")
    core_board: str = Field("", description="a file that the workers sharing this host's cores map: prefill "
                            "workers lend their threads to a decode worker between passes (pdserve/shared/cores.py)")
    weights: Literal["auto", "fp32", "native"] = Field(
        "auto", description="native: a GGUF's own blocks computed with as they are (CPU, float32; "
        "pdserve/shared/engine/weights.py); fp32: every matrix dequantized; auto: native for a GGUF on CPU, else fp32")
    pair_any_weights: bool = Field(False, description="exchange KV with workers computing with the other weights' "
                                   "format (their KV differs in its last bits); set on both pools")
    pass_target_ms: float = Field(0.0, ge=0, description="a mixed pass's step-time objective (pass_time.py); 0: off")
    kv_transport: Literal["ucx", "none"] = Field("ucx", description=(
        "KV between hosts (and on one host when it does not fit the segment): ucx; none: the same-host segment only, "
        "no UCX loaded (KV it cannot carry is prefilled on the decode worker)"))
    ucx_progress_mode: Literal["blocking", "polling", "thread", "thread-polling"] = Field(
        "thread", description="ucxx progress; blocking/polling are faster per transfer but spin a core after one")
    ucx_error_handling: bool = Field(True, description="UCX peer-failure handling on KV endpoints (off: shared "
                                     "memory on one host, but a sender killed mid-transfer can crash receivers)")
    kv_segment_bytes: int = Field(256 << 20, ge=0, description="KV between workers on one host through shared "
                                  "memory (pdserve/shared/kv/segment.py): a prefill worker's segment this large, a "
                                  "decode worker reads from them; 0: over the transport")
    kv_segment_scope: str = Field("", description="names this deployment's segments on a host (their sockets are "
                                  "in the network namespace's abstract namespace): two deployments sharing one "
                                  "need two; set alike on both pools")
    kv_max_sends: int = Field(3, ge=1, description="sends of a KV block that fails its checksum, then "
                              "the decode worker prefills locally")
    kv_fault_corrupt_rate: float = Field(0.0, ge=0, le=1, description="fault injection: fraction of KV "
                                         "payloads sent with one byte flipped (0: off)")
    kv_fault_corrupt_sends: int = Field(1, ge=0, description="fault injection: corrupt only a block's "
                                        "first sends, this many (resend numbers below it)")
    kv_fault_delay_s: float = Field(0.0, ge=0, description="fault injection: hold each KV payload send this long")
    fault_engine_hang_after_steps: int = Field(0, ge=0, description="fault injection: the engine step after "
                                               "this many never returns (heartbeats go on)")
    fault_engine_raise_after_steps: int = Field(0, ge=0, description="fault injection: the engine step after "
                                                "this many raises (the worker leaves and exits)")
    fault_crash_on_prompt: str = Field("", description="fault injection: the process dies (os._exit) as a prompt "
                                       "with this text joins an engine pass")
    grammar_compile_threads: int = Field(2, gt=0, description="grammars compiled at once, beside the engine "
                                         "thread (the others queue)")
    grammar_compile_timeout_s: float = Field(30.0, gt=0, description="a request whose grammar is not compiled "
                                             "this long after it arrived fails (its error says so)")
    grammar_compiles_per_tenant: int = Field(2, gt=0, description="grammars of one tenant (API key) compiled "
                                             "at once; its others wait for them, not in front of other keys'")
    fake_step_s: float = Field(0.0, ge=0, description="tests: the fake model's (PD_MODEL=fake:smollm2, "
                               "pdserve/shared/engine/fake.py) sleep per forward pass, a step time")


class PrefillSettings(WorkerSettings):
    max_jobs: int = Field(64, gt=0, description="prefill jobs taken at once (the engine orders those by "
                          "priority and length; JetStream keeps the rest first come)")
    kv_ack_timeout_s: float = Field(30.0, gt=0, description="lease: blocks are kept this long for the decode side")
    kv_piece_bytes: int = Field(8 << 20, ge=0, description="consecutive layers of a pass go to the decode "
                                "worker in one KV message until it holds this many bytes (0: one message per "
                                "layer); short prompts then cost one message, long ones still stream")
    kv_transfer_encoding: Literal["native", "int8"] = Field(
        "native", description="KV bytes on the wire: as in the pool, or int8 with per-block scales (4x fewer "
        "than fp32; quality cost in `make bench-transfer`)")


class DecodeSettings(WorkerSettings):
    kv_timeout_s: float = Field(30.0, gt=0, description="longest wait for a handoff's KV with none coming; "
                                "then its job moves to another prefill worker, or is prefilled here")
    kv_timeout_factor: float = Field(3.0, gt=0, description="a prefill worker whose engine step has run this "
                                     "many times the prefill's predicted time (within [kv_min_timeout_s, "
                                     "kv_timeout_s]) with no KV coming is frozen: the job moves")
    kv_min_timeout_s: float = Field(5.0, gt=0, description="shortest step that counts a prefill worker frozen")
    failover_seqs: int = Field(64, ge=0, description="sequences taken beyond max_num_seqs for streams moved off "
                               "a lost worker: a client mid-stream comes before a new request (KV blocks still "
                               "bound them; new requests wait until the batch is back under max_num_seqs)")
