"""The bus and the store of a fleet (pdserve/local/ha.py) under the loss of a node, through the
services' own clients (pdserve/shared/bus.py, pdserve/shared/state/, pdserve/shared/urls.py): a prefill job queued
on the 3-replica stream outlives the NATS node it was sent to, the client carries on on
another node, and the store follows Sentinel's promotion of the replica with what was
written before it."""

from __future__ import annotations

import asyncio
import time

from pdserve.local import ha
from pdserve.shared import grants, streams, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.state import State


def node_of(bus: Bus, ports: ha.Ports) -> int:
    """Which node of the cluster `bus` is connected to."""
    return ports.nats.index(bus.nc.connected_url.port)


async def retried(call, deadline: float):
    """`call()` until it succeeds (JetStream answers nothing while it elects a leader)."""
    while True:
        try:
            return await call()
        except Exception:  # noqa: BLE001 - no leader yet
            assert time.monotonic() < deadline, "JetStream did not recover from the loss of a node"
            await asyncio.sleep(0.2)


def test_a_queued_job_outlives_the_node_it_was_sent_to(ha_servers):
    ports, secret, procs = ha_servers

    async def scenario():
        bus = await Bus.connect(ha.nats_url(ports, grants.OPERATOR, secret), "test")
        await streams.ensure(bus.js, replicas=ha.NODES)
        info = await bus.js.stream_info(subjects.PREFILL_STREAM)
        await bus.js.publish(subjects.prefill_jobs("prefill-0"), b"job-1")
        first = node_of(bus, ports)
        procs[f"nats-{first}"].kill()
        deadline = time.monotonic() + 30
        while not bus.nc.is_connected or bus.nc.connected_url.port == ports.nats[first]:
            assert time.monotonic() < deadline, "the client did not move to another node"
            await asyncio.sleep(0.1)
        then = node_of(bus, ports)
        # the cluster and the stream elect new leaders if theirs were on the lost node
        await retried(lambda: bus.js.publish(subjects.prefill_jobs("prefill-0"), b"job-2", timeout=2), deadline)
        pull = await retried(lambda: bus.js.pull_subscribe(subjects.prefill_jobs("prefill-0"), durable="prefill-0"),
                             deadline)
        got = [m.data for m in await pull.fetch(2, timeout=10)]
        await bus.close()
        return info.config.num_replicas, len(info.cluster.replicas) + 1, first, then, got

    replicas, copies, first, then, got = asyncio.run(scenario())
    assert replicas == copies == ha.NODES
    assert then != first
    assert got == [b"job-1", b"job-2"]


def test_the_store_follows_the_promotion_with_what_was_written_before(ha_servers):
    ports, secret, procs = ha_servers

    async def scenario():
        state = State.connect(ha.redis_url(ports, "", secret, secret))
        await state.registry.heartbeat(WorkerInfo(worker_id="decode-0", role="decode"), lease_s=60)
        replicated = await state.r.execute_command("WAIT", 1, 5000)  # on the replica before the fault
        procs["redis"].kill()
        start, deadline = time.monotonic(), time.monotonic() + 30
        while True:
            try:
                await state.registry.heartbeat(WorkerInfo(worker_id="decode-1", role="decode"), lease_s=60)
                break
            except Exception:  # noqa: BLE001 - the primary is gone and not replaced yet
                assert time.monotonic() < deadline, "no new primary"
                await asyncio.sleep(0.2)
        took = time.monotonic() - start
        workers = sorted(w.worker_id for w in await state.registry.workers())
        primary = await state.r.connection_pool.get_master_address()
        await state.close()
        return replicated, took, workers, primary

    replicated, took, workers, primary = asyncio.run(scenario())
    assert replicated == 1
    assert workers == ["decode-0", "decode-1"]
    assert primary == ("127.0.0.1", ports.redis[1])
    assert took < 20
