"""Every NATS subject and stream name, in one place. Names are `pd.<component>.<verb>`."""

ROUTE = "pd.router.route"                       # gateway -> router, request/reply
ROUTER_QUEUE = "router"                         # queue group: router replicas share the load

PREFILL_STREAM = "PD_PREFILL"                   # JetStream work queue of prefill jobs
PREFILL_JOBS = "pd.prefill.jobs.>"


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


def tokens(request_id: str) -> str:
    """Token chunks of one request, with sequence numbers, to the gateway."""
    return f"pd.tokens.{request_id}"


def events(request_id: str) -> str:
    """Lifecycle events of one request."""
    return f"pd.events.{request_id}"


KV_OUTCOMES = "pd.kv.outcomes"                  # decode -> routers: how each KV handoff ended (breakers)
KV_ACK_ALL = "pd.kv.ack.*"
KV_RESEND_ALL = "pd.kv.resend.*"


def kv_ack(request_id: str) -> str:
    """decode -> prefill: the KV arrived and was verified (the prefill side may free it)."""
    return f"pd.kv.ack.{request_id}"


def kv_resend(request_id: str) -> str:
    """decode -> prefill: KVResend, blocks that failed their checksum."""
    return f"pd.kv.resend.{request_id}"


def kv_events(worker: str) -> str:
    """Prefix-cache blocks stored / evicted on one worker (feeds the router's prefix index)."""
    return f"pd.kv.events.{worker}"


CANCEL_ALL = "pd.cancel.*"


def cancel(request_id: str) -> str:
    return f"pd.cancel.{request_id}"
