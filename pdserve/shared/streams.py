"""The JetStream streams belong to the operator: made and kept by the operator's identity
(`pdserve streams`: the local stack runs it beside the services, compose as a service of its
own, Kubernetes as a Job), never by a service. A service's grant reads a stream's
configuration and nothing more (pdserve/shared/grants.py), so no compromised instance can widen a
stream's subjects (say, to store every output), purge it or delete it.

    PD_PREFILL  the prefill jobs: a work queue, each job kept until acked or PREFILL_MAX_AGE_S;
                at most PREFILL_MAX_MSGS jobs and PREFILL_MAX_BYTES, new ones refused past that
                (the decode worker then prefills the request itself)
    PD_PREFIX   the workers' prefix-cache changes (pdserve/shared/prefix_events.py): each worker's last
                PREFIX_HISTORY messages, at most PREFIX_MAX_BYTES

Each prefill worker makes its own durable pull consumer of PD_PREFILL (`job_consumer`): a job
delivered JOB_MAX_DELIVERIES times without an ack is not delivered again (the server's
max-deliveries advisory names it: pdserve/services/router/dead_letters.py), and a consumer nobody
pulls from for PREFILL_MAX_AGE_S (its worker gone for good) is removed by the server.

Both are file streams with `num_replicas` copies on a NATS cluster. The keeper checks them every
`keep_s` and makes again a stream it finds missing (a server's store lost), or sets again a
configuration that drifted from this one (a new release's limits, a stream made with fewer
copies); a stream made with more copies keeps them.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from pdserve.shared import logs, subjects
from pdserve.shared.config import StreamsSettings
from pdserve.shared.tls import client_context
from pdserve.shared.urls import nats_inbox, nats_servers

log = logging.getLogger("streams")
PREFILL_MAX_AGE_S = 600.0     # a job nobody acked this long (its worker died for good) was prefilled elsewhere long ago
PREFILL_MAX_MSGS = 100_000    # jobs queued at once, over every prefill worker
PREFILL_MAX_BYTES = 1 << 30   # and their bytes (a job carries its prompt's token ids)
PREFIX_HISTORY = 1024         # prefix events kept per worker: a router away for fewer catches up from the stream
PREFIX_MAX_AGE_S = 600.0
PREFIX_MAX_BYTES = 1 << 28
JOB_ACK_WAIT_S = 30.0       # a job taken and not acked (nor kept in progress) this long is delivered again
JOB_MAX_DELIVERIES = 3      # then no more: a job that took its worker down this often is a poison
_KEPT = ("subjects", "retention", "max_age", "max_msgs", "max_bytes", "max_msgs_per_subject", "discard", "storage")


def prefill_config(replicas: int = 1) -> StreamConfig:
    return StreamConfig(name=subjects.PREFILL_STREAM, subjects=[subjects.PREFILL_JOBS],
                        retention=RetentionPolicy.WORK_QUEUE, max_age=PREFILL_MAX_AGE_S, max_msgs=PREFILL_MAX_MSGS,
                        max_bytes=PREFILL_MAX_BYTES, discard=DiscardPolicy.NEW, storage=StorageType.FILE,
                        num_replicas=replicas)


def job_consumer(worker: str) -> ConsumerConfig:
    """Prefill worker `worker`'s durable consumer of its own jobs (pdserve/shared/grants.py pins the name
    and the filter)."""
    return ConsumerConfig(durable_name=worker, name=worker, filter_subject=subjects.prefill_jobs(worker),
                          ack_policy=AckPolicy.EXPLICIT, ack_wait=JOB_ACK_WAIT_S, max_deliver=JOB_MAX_DELIVERIES,
                          inactive_threshold=PREFILL_MAX_AGE_S)


def prefix_config(replicas: int = 1) -> StreamConfig:
    """The workers' prefix-cache changes (pdserve/shared/prefix_events.py): each worker's last messages."""
    return StreamConfig(name=subjects.PREFIX_STREAM, subjects=[subjects.PREFIX_EVENTS],
                        retention=RetentionPolicy.LIMITS, max_msgs_per_subject=PREFIX_HISTORY,
                        max_age=PREFIX_MAX_AGE_S, max_bytes=PREFIX_MAX_BYTES, discard=DiscardPolicy.OLD,
                        storage=StorageType.FILE, num_replicas=replicas)


def configs(replicas: int = 1) -> list[StreamConfig]:
    return [prefill_config(replicas), prefix_config(replicas)]


def drift(made: StreamConfig, wanted: StreamConfig) -> StreamConfig | None:
    """The configuration to set on a stream made as `made` (None: nothing to change)."""
    changes = {k: getattr(wanted, k) for k in _KEPT   # (a field left unset here is the server's: -1, unlimited)
               if getattr(wanted, k) is not None and getattr(made, k) != getattr(wanted, k)}
    if (made.num_replicas or 1) < (wanted.num_replicas or 1):
        changes["num_replicas"] = wanted.num_replicas
    return made.evolve(**changes) if changes else None


async def ensure(js: JetStreamContext, replicas: int = 1, timeout_s: float = 60.0) -> list[str]:
    """Each stream made, or set as `configs` says; returns what was done. A cluster still
    electing its JetStream leader, or not yet with enough servers for the copies, is asked
    again until `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    done = []
    for config in configs(replicas):
        name = config.name or ""
        while True:
            try:
                try:
                    made = (await js.stream_info(name)).config
                except nats.js.errors.NotFoundError:
                    await js.add_stream(config)
                    done.append(f"made {name}")
                    break
                if (update := drift(made, config)) is not None:
                    await js.update_stream(update)
                    done.append(f"set {name}")
                break
            except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.BadRequestError) as e:  # (400 here: "no suitable peers" while the cluster forms)
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.info("JetStream not ready yet (%s): asking again", e)
                await asyncio.sleep(0.5)
    return done


async def keep(settings: StreamsSettings) -> None:
    """Ensure the streams, then (keep_s > 0) again every keep_s until SIGTERM / SIGINT. A
    process of its own, light: nats-py and the settings, no engine."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    url = settings.nats_url
    nc = await nats.connect(nats_servers(url), name="streams", max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                            inbox_prefix=nats_inbox(url), tls=client_context())
    try:
        while True:
            try:
                for what in await ensure(nc.jetstream(), settings.stream_replicas):
                    log.info("stream %s", what)
            except Exception as e:  # noqa: BLE001 - NATS away: the next round tries again
                if not settings.keep_s:
                    raise
                log.warning("streams not checked: %s", e)
            if not settings.keep_s:
                return
            try:
                await asyncio.wait_for(stop.wait(), settings.keep_s)
                return
            except TimeoutError:
                pass
    finally:
        await nc.close()


def main(settings: StreamsSettings | None = None) -> None:
    """`pdserve streams`: the operator's keeper of the streams (its NATS user must be the operator's)."""
    settings = settings or StreamsSettings()
    logs.setup(settings.log_level, "streams", settings.log_format)
    asyncio.run(keep(settings))


if __name__ == "__main__":
    main()
