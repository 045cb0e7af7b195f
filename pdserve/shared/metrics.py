"""Prometheus metrics of every service, in one place: names, labels, buckets.

Each process exports the metrics of its role on `/metrics` on `PD_METRICS_PORT` (default 9400;
the gateway's too, apart from its API). Latency histograms carry the
request's trace id as an exemplar (shown in the OpenMetrics format, which Prometheus asks
for), so a slow bucket leads to its trace in Jaeger.

Definitions (as vLLM's serving benchmark): time to first token from the request's arrival;
inter-token latency = the gap before each later chunk of tokens; time per output token =
(end-to-end − TTFT) / (output tokens − 1).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from pdserve.shared import probes
from pdserve.shared.messages import WorkerInfo

log = logging.getLogger(__name__)

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
           20.0, 30.0, 60.0, 120.0)
TOKEN = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
         5.0)

# -- gateway: each request as its client sees it (mode: remote or local, the last placement's) ---
TTFT = Histogram("pd_time_to_first_token_seconds", "From the request's arrival to its first token",
                 ["mode"], buckets=LATENCY)
ITL = Histogram("pd_inter_token_latency_seconds", "Gap before each token chunk after the first", ["mode"],
                buckets=TOKEN)
TPOT = Histogram("pd_time_per_output_token_seconds", "(end-to-end - TTFT) / (output tokens - 1)", ["mode"],
                 buckets=TOKEN)
E2E = Histogram("pd_e2e_request_latency_seconds", "From the request's arrival to its last token", ["mode"],
                buckets=LATENCY)
REQUESTS = Counter("pd_requests", "Requests by how they ended", ["outcome"])  # finished, failed, cancelled
FINISHED = Counter("pd_finished_requests", "Requests that finished, by finish reason", ["finish_reason"])
DECODE_SECONDS = Histogram("pd_decode_seconds", "From a request's first token to its last", ["mode"],
                           buckets=LATENCY)
SIZE = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
REQUEST_PROMPT_TOKENS = Histogram("pd_request_prompt_tokens", "Prompt tokens of each finished request",
                                  buckets=SIZE)
REQUEST_OUTPUT_TOKENS = Histogram("pd_request_output_tokens", "Output tokens of each finished request",
                                  buckets=SIZE)
OUTPUT_TOKENS = Counter("pd_output_tokens", "Tokens streamed to clients")
FAILOVERS = Counter("pd_failovers", "Requests moved to another decode worker", ["why"])
QUARANTINED = Counter("pd_quarantined_requests", "Requests failed, not placed again, after crashing workers "
                      "(pdserve/shared/quarantine.py)", ["lost"])   # the role of the worker lost last: decode, prefill
REPLAYS = Counter("pd_replays", "Token streams with chunks lost on the bus, asked again of their decode worker",
                  ["outcome"])   # replayed, refused (then moved)

# -- router ------------------------------------------------------------------------------------
PLACEMENTS = Counter("pd_placements", "Placement decisions", ["mode", "reason"])
ROUTE_SECONDS = Histogram("pd_route_seconds", "Time to place a request (admit included)", buckets=LATENCY)
SUPERVISOR_ACTIONS = Counter("pd_supervisor_actions", "Requests the supervisor acted on",
                             ["action"])  # stalled, abandoned (gateway lost), unheeded (stalled, not moved)
DEAD_JOBS = Counter("pd_dead_prefill_jobs", "Prefill jobs delivered JOB_MAX_DELIVERIES times without an ack "
                    "(put on pd.prefill.dead)")

# -- workers (role: prefill or decode) ------------------------------------------------------------
KV_BLOCKS = Gauge("pd_kv_blocks", "KV cache blocks", ["role", "state"])              # free, used
SEQUENCES = Gauge("pd_sequences", "Sequences in the engine", ["role", "state"])      # running, waiting
QUEUED_TOKENS = Gauge("pd_queued_prompt_tokens", "Prompt tokens waiting to be computed", ["role"])
STEP_SECONDS = Histogram("pd_engine_step_seconds", "Engine steps", ["role", "kind"], buckets=LATENCY)
LENT_STEPS = Counter("pd_lent_thread_steps", "Decode steps run on a prefill worker's threads too (PD_CORE_BOARD)")
STALE_CHUNKS = Counter("pd_stale_chunks", "Token chunks the gateway dropped: from a placement the request has "
                       "left (a worker still publishing after its request moved)")
SEND_DEADLINE_CLOSES = Counter("pd_send_deadline_closes", "Client connections the gateway closed because the client "
                               "took nothing it was sent for PD_SEND_DEADLINE_S (their requests cancelled)")
FORGED_CHUNKS = Counter("pd_forged_chunks", "Token chunks the gateway dropped: no secret of the request's placements "
                        "verifies them (made up, or moved from another request: pdserve/shared/macs.py)")
FORGED_MESSAGES = Counter("pd_forged_messages", "A placement's messages dropped (its KV handoff's, its cancels): its "
                          "secret does not verify them (pdserve/shared/macs.py)")
BAD_REGISTRY_ENTRIES = Counter("pd_bad_registry_entries", "Registry entries skipped: unreadable, or naming another "
                               "worker than their key's (pdserve/shared/state/registry.py)")
CLAMPED_REGISTRY_ENTRIES = Counter("pd_clamped_registry_entries", "Registry entries whose capacity was over the "
                                   "router's bounds and taken as the bound (pdserve/services/router/registry.py)")
BUS_PUBLISH_ERRORS = Counter("pd_bus_publish_errors", "Publishes on a worker's step path NATS did not take (its "
                             "connection away with its buffer full, or closed): the worker goes on", ["what"])
REPLAYED_CHUNKS = Counter("pd_replayed_chunks", "Token chunks published again for a gateway that lost them")
PROMPT_TOKENS = Counter("pd_prompt_tokens", "Prompt tokens prefilled (cached ones included)", ["role"])
CACHED_TOKENS = Counter("pd_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", ["role"])
DECODE_PREFILLS = Counter("pd_decode_prefills", "Prompts prefilled on a decode worker, by why",
                          ["why"])  # placed (colocated, short), resumed (failover, no prefill worker), fallback
REQUEUED_JOBS = Counter("pd_requeued_prefill_jobs", "Prefill jobs of a lost prefill worker put on another's queue")
PREFILL_QUEUE_SECONDS = Histogram("pd_prefill_queue_seconds", "A prefill job's wait on its worker's queue",
                                  buckets=LATENCY)
PREFILL_SECONDS = Histogram("pd_prefill_seconds", "A prefill job's compute: taken to its first token",
                            buckets=LATENCY)

# -- KV transfer (prefill side: sent; decode side: received) -------------------------------------
KV_BYTES = Counter("pd_kv_transfer_bytes", "KV bytes sent to decode workers (transport "
                   "'segment': placed in shared memory for one on the same host; 'device': read from the pool "
                   "by one on the same host with its pool on a GPU too)", ["transport"])
KV_SECONDS = Histogram("pd_kv_transfer_seconds", "A handoff's exposed part: from the prefill's last layer to the "
                       "decode side's ack (earlier layers stream while later ones compute)", buckets=LATENCY)
KV_FAILURES = Counter("pd_kv_transfer_failures", "Handoffs that ended without the decode side's ack")
KV_RESENT = Counter("pd_kv_transfer_resent_blocks", "Blocks sent again after a failed checksum")
KV_RECEIVED = Counter("pd_kv_received_bytes", "KV bytes received and verified")
# the router's prefix index in memory (PD_PREFIX_INDEX=events: pdserve/services/router/prefix_follower.py)
PREFIX_FEEDS = Gauge("pd_prefix_index_feeds", "Workers' feeds into the router's prefix index, by state",
                     ["state"])  # following, awaiting_snapshot (its events held until the snapshot is in)
PREFIX_BLOCKS = Gauge("pd_prefix_index_blocks", "Block hashes in the router's prefix index")
PREFIX_EVENTS = Counter("pd_prefix_index_events", "Prefix events applied to the router's index")
PREFIX_SNAPSHOTS = Counter("pd_prefix_index_snapshots", "Workers' snapshots taken into the router's index")
# the identity issuer (pdserve/services/issuer)
ISSUED = Counter("pd_identities", "The identity issuer's answers: NATS connections let in or refused, Redis "
                 "users made or refused", ["what", "outcome"])


def exemplar(trace_id: str | None) -> dict[str, str] | None:
    return {"trace_id": trace_id} if trace_id else None


def worker(info: WorkerInfo) -> None:
    """A worker's gauges, from the registry entry it is about to publish."""
    role = info.role
    KV_BLOCKS.labels(role, "free").set(info.free_blocks)
    KV_BLOCKS.labels(role, "used").set(info.total_blocks - info.free_blocks)
    SEQUENCES.labels(role, "running").set(info.running)
    SEQUENCES.labels(role, "waiting").set(info.waiting)
    QUEUED_TOKENS.labels(role).set(info.queued_tokens)


def openmetrics_names_kept(accept: str) -> str:
    """`accept` (a scrape's Accept header) asking for OpenMetrics with names as they are: without
    an `escaping` of its own, prometheus_client escapes every `:` in a sample's name (`vllm:...`
    reached Prometheus 2.x as `vllm_...`, which vLLM's dashboards do not query), while its HELP and
    TYPE lines keep it."""
    return ",".join(f"{part};escaping=allow-utf-8" if part.split(";")[0].strip() == "application/openmetrics-text"
                    and "escaping=" not in part else part for part in accept.split(","))


def serve(port: int, host: str = "0.0.0.0") -> int:
    """`/metrics` on its own port (every service's; the gateway's API port serves none), with
    `/health` and `/ready` beside it (pdserve/shared/probes.py). Returns the port, 0 when off or taken
    (logged: metrics are not worth a failed start)."""
    if not port:
        return 0
    scrape = make_wsgi_app(REGISTRY)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        probe = probes.answer(environ.get("PATH_INFO", ""))
        if probe is None:
            environ["HTTP_ACCEPT"] = openmetrics_names_kept(environ.get("HTTP_ACCEPT", ""))
            return scrape(environ, start_response)
        status, body = probe
        start_response(f"{status} {'OK' if status == 200 else 'Service Unavailable'}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    try:
        server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    except OSError as e:
        log.warning("metrics not served on %s:%d: %s", host, port, e)
        return 0
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return port


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - scrapes and probes are not logged
        pass
