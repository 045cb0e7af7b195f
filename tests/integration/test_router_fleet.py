"""A router in front of a fleet of 256 workers (stand-ins that register, index their prefix
caches and answer admits) against real Redis and NATS: a placement's cost must not grow with
the fleet. It makes no keyspace scan and at most 3 Redis round trips, finds the worker that
caches the prompt, and sends as many NATS messages as with 4 workers."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import tempfile
import urllib.request

import pytest
from opentelemetry import trace
from redis.asyncio.connection import Connection

from pdserve.local.servers import binary, free_port, running, wait_for_port
from pdserve.services.router.main import Router
from pdserve.shared import streams, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.config import RouterSettings
from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.hashing import block_hashes
from pdserve.shared.messages import AdmitReply, AdmitRequest, RouteRequest, Sampling, WorkerInfo
from pdserve.shared.prefix_index import PrefixPublisher
from pdserve.shared.state import State

PROMPT = list(range(1000, 1000 + 64 * 16))  # 64 blocks of 16 tokens
COMMAND = re.compile(rb"\*\d+\r\n\$\d+\r\n([A-Za-z]+)\r\n")


class Recording(Connection):
    """A connection that notes the commands of every round trip it makes."""
    trips: list[list[str]] = []

    async def send_packed_command(self, command, check_health=True):
        data = command if isinstance(command, (bytes, str)) else b"".join(
            c if isinstance(c, bytes) else bytes(c) for c in command)
        data = data.encode() if isinstance(data, str) else data
        Recording.trips.append([n.decode().upper() for n in COMMAND.findall(data)])
        return await super().send_packed_command(command, check_health)


@pytest.fixture(scope="module")
def nats_monitored():
    port, monitor = free_port(), free_port()
    with tempfile.TemporaryDirectory() as d, running([binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port),
                                                      "-m", str(monitor), "-sd", d], stdout=subprocess.DEVNULL,
                                                     stderr=subprocess.DEVNULL) as proc:
        wait_for_port(port, proc=proc)
        wait_for_port(monitor, proc=proc)
        yield f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{monitor}/varz"


def _out_msgs(varz: str) -> int:
    with urllib.request.urlopen(varz, timeout=5) as r:
        return json.load(r)["out_msgs"]


async def _settled_out_msgs(varz: str) -> int:
    """Messages delivered once the background dispatches have landed (the count stops moving)."""
    last = _out_msgs(varz)
    for _ in range(30):
        await asyncio.sleep(0.2)
        now = _out_msgs(varz)
        if now == last:
            return now
        last = now
    return last


async def _fleet(state: State, bus: Bus, size: int, cached_on: str) -> list[PrefixPublisher]:
    """`size` workers, half prefill and half decode, each caching a prefix of its own plus
    (`cached_on`) 40 blocks of PROMPT; the decode stand-ins admit everything."""
    hashes = block_hashes(PROMPT, 16)
    publishers = []
    for i in range(size):
        role = "prefill" if i % 2 == 0 else "decode"
        wid = f"{role}-{i // 2}"
        pub = PrefixPublisher(state, wid, lease_s=60)
        await pub.start()
        own = block_hashes([i] * 16 * 20, 16)
        pub.publish([CacheChange("stored", h) for h in own + (hashes[:40] if wid == cached_on else [])])
        publishers.append(pub)
        if role == "decode":
            async def on_admit(msg):
                req = AdmitRequest.decode(msg.data)
                await bus.respond(msg, AdmitReply(request_id=req.request_id, ok=True, num_blocks=66, kv_tag=1))
            await bus.subscribe(subjects.decode_admit(wid), on_admit)
    for _ in range(500):  # the publishers have written their caches (polled: a slow machine)
        if all(p.size >= 20 + 40 * (p.worker_id == cached_on) for p in publishers):
            break
        await asyncio.sleep(0.02)
    for pub in publishers:
        wid = pub.worker_id
        await state.registry.heartbeat(WorkerInfo(
            worker_id=wid, role="prefill" if wid.startswith("prefill") else "decode", model="m", fingerprint="fp",
            block_size=16, total_blocks=4096, free_blocks=4000, ucx_address="00", prefill_tokens_per_s=4000.0,
            prefix_slot=pub.slot, cached_blocks=pub.size), 60)
    return publishers


def _placement(nats_url: str, redis_url: str, size: int, varz: str, rounds: int = 5):
    async def run():
        setup = State.connect(redis_url)
        await setup.r.flushdb()
        bus = await Bus.connect(nats_url, "test")
        await streams.ensure(bus.js)
        publishers = await _fleet(setup, bus, size, cached_on="prefill-9")
        state = State.connect(redis_url)
        state.r.connection_pool.connection_class = Recording
        # (remote placement: with cheapest, prompts behind the warm-up's booked tokens would go local)
        router = Router(RouterSettings(nats_url=nats_url, redis_url=redis_url, router_id="router-a",
                                       placement="remote", prefix_index="redis"), bus, state, trace.get_tracer("test"))
        sampling = Sampling(max_tokens=8)
        await router.route(RouteRequest(request_id="warm", prompt_token_ids=PROMPT, sampling=sampling, model="m"))
        await asyncio.sleep(0.2)  # background writes of the warm-up done
        await router.pools.read()
        router.pools.refreshing = True  # as while serving: Pools.keep re-reads the registry off the placement path
        trips, replies = [], []
        before = await _settled_out_msgs(varz)
        for n in range(rounds):
            await router.pools.read()  # as the background re-read does: never on the placement path
            Recording.trips = []
            replies.append(await router.route(RouteRequest(request_id=f"r{n}", prompt_token_ids=PROMPT,
                                                           sampling=sampling, model="m")))
            await asyncio.sleep(0.1)  # its background writes (lifecycle events) land
            trips.append(list(Recording.trips))
        messages = (await _settled_out_msgs(varz) - before) / rounds
        for pub in publishers:
            await pub.close()
        await bus.close()
        await setup.close()
        await state.close()
        return trips, replies, messages

    return asyncio.run(run())


def test_a_placement_in_a_fleet_of_256_makes_no_scan_and_two_round_trips(nats_monitored, redis_url):
    nats_url, varz = nats_monitored
    trips, replies, messages_256 = _placement(nats_url, redis_url, 256, varz)
    for placement in trips:
        commands = [c for trip in placement for c in trip]
        assert not {"SCAN", "KEYS"} & set(commands), commands
        # the lifecycle event is written in the background (the placement does not wait for it), on
        # the round trip that keeps the reply (its HSET and PEXPIRE); on the path: the Redis index's
        # lookup, then the claim with the decode worker noted
        on_path = [trip for trip in placement if "PEXPIRE" not in trip]
        assert len(on_path) <= 2, on_path
    assert all(r.ok and r.mode == "remote" and r.prefill_worker == "prefill-9" for r in replies), replies
    assert "640 of 1024 tokens cached" in replies[0].reason
    _, _, messages_4 = _placement(nats_url, redis_url, 4, varz)
    # route request + reply, admit request + reply, the prefill job and its acknowledgement
    assert messages_256 == messages_4, (messages_4, messages_256)
