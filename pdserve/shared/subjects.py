"""Every NATS subject and stream name, in one place. Names are `pd.<component>.<verb>`."""

ROUTE = "pd.router.route"                       # gateway -> router, request/reply
REQUEUE = "pd.router.requeue"                   # decode -> router, request/reply: a lost prefill worker's job
ROUTER_QUEUE = "router"                         # queue group: router replicas share the load

IDENTITY_REDIS = "pd.identity.redis"            # instance -> identity issuer, request/reply: its Redis ACL user
ISSUER_QUEUE = "issuer"                         # queue group: issuer replicas share the requests
AUTH_CALLOUT = "$SYS.REQ.USER.AUTH"             # nats-server -> identity issuer: a connection to authorize

PREFILL_STREAM = "PD_PREFILL"                   # JetStream work queue of prefill jobs
PREFILL_JOBS = "pd.prefill.jobs.>"
PREFILL_DEAD = "pd.prefill.dead"                # router -> whoever watches (the operator): DeadJob
# the server -> the routers: a job of a prefill worker's consumer delivered max_deliver times, unacked
JOB_MAX_DELIVERIES = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{PREFILL_STREAM}.*"


def prefill_jobs(worker: str) -> str:
    """Jobs for one prefill worker (the router picks the worker)."""
    return f"pd.prefill.jobs.{worker}"


def decode_admit(worker: str) -> str:
    """router -> decode worker, request/reply: reserve KV blocks (or run the prefill locally)."""
    return f"pd.decode.{worker}.admit"


def decode_kv(worker: str) -> str:
    """prefill -> decode worker: KVLayer notices (each payload goes over the KV transport)."""
    return f"pd.decode.{worker}.kv"


def decode_kv_end(worker: str) -> str:
    """prefill -> decode worker: KVEnd, the handoff's last word (first token, or failure)."""
    return f"pd.decode.{worker}.kv.end"


def decode_replay(worker: str) -> str:
    """gateway -> decode worker, request/reply: publish a request's chunks again from a seq."""
    return f"pd.decode.{worker}.replay"


def decode_cancel(worker: str) -> str:
    """gateway, prefill -> decode worker: Cancel of a request placed there, with the placement's MAC."""
    return f"pd.decode.{worker}.cancel"


def prefill_cancel(worker: str) -> str:
    """gateway -> prefill worker: Cancel of a request whose job it was given, with the placement's MAC."""
    return f"pd.prefill.{worker}.cancel"


def decode_supervisor_cancel(worker: str) -> str:
    """a router's supervisor -> decode worker: Cancel of a request given up (its gateway lost,
    or stalled and not moved); only routers may publish it (pdserve/shared/grants.py), so it needs no MAC."""
    return f"pd.decode.{worker}.cancel.supervisor"


def prefill_supervisor_cancel(worker: str) -> str:
    """a router's supervisor -> prefill worker: as decode_supervisor_cancel."""
    return f"pd.prefill.{worker}.cancel.supervisor"


def prefill_kv_ack(worker: str) -> str:
    """decode -> prefill worker: KVAck, the KV arrived and was verified (or refused): free it."""
    return f"pd.prefill.{worker}.kv.ack"


def prefill_kv_resend(worker: str) -> str:
    """decode -> prefill worker: KVResend, blocks that failed their checksum."""
    return f"pd.prefill.{worker}.kv.resend"


def prefill_kv_sync(worker: str) -> str:
    """decode -> prefill worker: KVSync, the bus was away while the handoff was open."""
    return f"pd.prefill.{worker}.kv.sync"


def decode_control(worker: str) -> dict[str, str]:
    """What one decode worker subscribes to for the requests it holds, by message. Each is
    addressed to the workers of the request alone, so what a request costs the bus does not
    grow with the fleet (tests/integration/test_control_fanout.py)."""
    return {"cancel": decode_cancel(worker), "supervisor_cancel": decode_supervisor_cancel(worker)}


def prefill_control(worker: str) -> dict[str, str]:
    """What one prefill worker subscribes to for the requests it holds, by message."""
    return {"cancel": prefill_cancel(worker), "supervisor_cancel": prefill_supervisor_cancel(worker),
            "kv_ack": prefill_kv_ack(worker),
            "kv_resend": prefill_kv_resend(worker), "kv_sync": prefill_kv_sync(worker)}


def tokens(request_id: str) -> str:
    """Token chunks of one request, with sequence numbers, to the gateway."""
    return f"pd.tokens.{request_id}"


def stalled(request_id: str) -> str:
    """Lifecycle events of one request."""
    return f"pd.stalled.{request_id}"


KV_OUTCOMES = "pd.kv.outcomes"                  # decode -> routers: how each KV handoff ended (breakers)

PREFIX_STREAM = "PD_PREFIX"                     # JetStream: each worker's prefix-cache changes (PD_PREFIX_INDEX=events)
PREFIX_EVENTS = "pd.prefix.events.*"


def prefix_events(worker: str) -> str:
    """worker -> routers (PREFIX_STREAM): PrefixEvents of one worker's prefix cache, in order."""
    return f"pd.prefix.events.{worker}"


def prefix_snapshot(worker: str) -> str:
    """router -> worker, request/reply: its whole prefix cache (PrefixSnapshot), a page per ask."""
    return f"pd.prefix.snapshot.{worker}"
