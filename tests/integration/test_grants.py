"""Each service instance's NATS user (pdserve/shared/grants.py) on a real nats-server: what the request
path needs works (a route request answered across roles, a prefill job queued by a decode worker
and pulled and acked by a prefill worker through its own consumer), and each named operation
outside an instance's grant — another instance's admits, jobs or acks, the streams' administration
— is refused by the server and delivers nothing. The stack tests run every service under its
grant (pdserve/local/stack.py fails a run in which NATS refused a service anything)."""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import replace

import nats
import pytest

from pdserve.local.servers import binary, free_port, running, wait_for_port
from pdserve.services.router.dead_letters import DeadLetters
from pdserve.services.router.prefix_follower import PrefixFollower
from pdserve.shared import grants, streams, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.lifecycle import Event
from pdserve.shared.messages import DeadJob, PrefillJob, RouteReply, RouteRequest, Sampling, Stalled, WorkerInfo
from pdserve.shared.prefix_events import PrefixEventPublisher
from pdserve.shared.urls import nats_inbox

INSTANCES = {"gateway": "gateway", "router": "router", "prefill-0": "prefill", "prefill-1": "prefill",
             "decode-0": "decode", "decode-1": "decode", grants.OPERATOR: grants.OPERATOR}
PASSWORDS = {user: f"pw-{user}" for user in INSTANCES}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("nats")
    conf = d / "nats.conf"
    conf.write_text(grants.nats_authorization(grants.User(u, role, PASSWORDS[u], instance=u)
                                              for u, role in INSTANCES.items()))
    port = free_port()
    with running([binary("nats-server"), "-c", str(conf), "-js", "-a", "127.0.0.1", "-p", str(port),
                  "-sd", str(d / "store")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        wait_for_port(port, proc=proc)
        asyncio.run(_streams(port))
        yield port


async def _streams(port: int) -> None:
    """The streams, made by the operator (pdserve/shared/streams.py)."""
    bus = await Bus.connect(url(port, grants.OPERATOR), "operator")
    await streams.ensure(bus.js)
    await bus.close()


def url(port: int, user: str, password: str | None = None) -> str:
    return f"nats://{user}:{password or PASSWORDS[user]}@127.0.0.1:{port}"


class Client:
    """A connection as `user` that keeps the server's refusals."""

    def __init__(self, port: int, user: str):
        self.url, self.refusals = url(port, user), []

    async def __aenter__(self) -> nats.NATS:
        async def on_error(e: Exception) -> None:
            self.refusals.append(str(e))

        self.nc = await nats.connect(self.url, error_cb=on_error, inbox_prefix=nats_inbox(self.url),
                                     allow_reconnect=False)
        return self.nc

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()


_JS = "$JS.API"
_STREAM = subjects.PREFILL_STREAM
DENIED_SUBSCRIPTIONS = [
    ("gateway", subjects.ROUTE),                          # read the prompts routed
    ("router", subjects.tokens("r1")),                    # read another service's outputs
    ("prefill-0", subjects.tokens("r1")),
    ("decode-0", subjects.tokens("r1")),
    ("decode-0", subjects.ROUTE),
    ("prefill-0", subjects.decode_admit("decode-0")),     # read the prompts admitted to a decode worker
    ("decode-0", subjects.decode_admit("decode-1")),      # ... to another decode worker
    ("decode-0", subjects.decode_admit("*")),             # ... to every decode worker
    ("decode-0", subjects.decode_kv("decode-1")),         # another decode worker's KV notices
    ("decode-0", subjects.decode_replay("decode-1")),     # answer for another decode worker
    ("prefill-0", subjects.prefill_kv_ack("prefill-1")),  # another prefill worker's acks
    ("prefill-0", subjects.prefill_cancel("prefill-1")),
    ("decode-0", grants.inbox("gateway") + ".>"),         # read the replies to another's requests
    ("decode-0", grants.inbox("decode-1") + ".>"),
    ("router", subjects.PREFILL_JOBS),                    # read the job stream's prompts
    ("decode-0", subjects.JOB_MAX_DELIVERIES),            # (the routers' alone)
]

DENIED_PUBLISHES = [
    ("gateway", subjects.tokens("r1")),                   # write into a user's stream
    ("router", subjects.tokens("r1")),
    ("gateway", subjects.decode_admit("decode-0")),       # hand a decode worker a prompt
    ("prefill-0", subjects.prefill_jobs("prefill-0")),    # queue a job (only decode workers do)
    ("gateway", subjects.prefill_jobs("prefill-0")),
    ("decode-0", subjects.ROUTE),
    ("decode-0", subjects.stalled("r1")),                 # end another request's stream
    ("decode-0", subjects.prefix_events("decode-1")),     # another worker's cache, as the routers see it
    ("gateway", subjects.decode_supervisor_cancel("decode-0")),   # a cancel without a MAC: the routers' alone
    ("prefill-0", subjects.decode_supervisor_cancel("decode-0")),
    ("decode-0", subjects.prefill_supervisor_cancel("prefill-0")),
    # the streams are the operator's: none may change, make, purge or delete one
    ("prefill-0", f"{_JS}.STREAM.UPDATE.{_STREAM}"),      # (a stream that stores every output)
    ("router", f"{_JS}.STREAM.UPDATE.{_STREAM}"),
    ("decode-0", f"{_JS}.STREAM.UPDATE.{_STREAM}"),
    ("router", f"{_JS}.STREAM.CREATE.{_STREAM}"),
    ("prefill-0", f"{_JS}.STREAM.PURGE.{_STREAM}"),
    ("router", f"{_JS}.STREAM.DELETE.{_STREAM}"),
    ("prefill-0", f"{_JS}.STREAM.UPDATE.{subjects.PREFIX_STREAM}"),
    # a prefill worker's consumer is its own, on its own subject
    ("prefill-0", f"{_JS}.CONSUMER.MSG.NEXT.{_STREAM}.prefill-1"),              # take another's jobs
    ("prefill-0", f"{_JS}.CONSUMER.CREATE.{_STREAM}.prefill-0.pd.prefill.jobs.>"),  # its own, over every job
    ("prefill-0", f"{_JS}.CONSUMER.CREATE.{_STREAM}.prefill-1.pd.prefill.jobs.prefill-1"),
    ("prefill-0", f"{_JS}.CONSUMER.DURABLE.CREATE.{_STREAM}.prefill-0"),      # (the filter in the body)
    ("prefill-0", f"{_JS}.CONSUMER.DELETE.{_STREAM}.prefill-1"),
    ("prefill-0", f"{_JS}.STREAM.MSG.GET.{_STREAM}"),                            # read any worker's jobs
    ("decode-0", subjects.PREFILL_DEAD),                                          # a forged dead letter
    ("prefill-0", f"$JS.ACK.{_STREAM}.prefill-1.x"),                           # ack another's job away
]


async def _refused(client: Client) -> list[str]:
    """The refusals `client` has had, once the server has answered what it sent."""
    await client.nc.flush()
    await asyncio.sleep(0.2)   # a refusal comes as an error after the flush's pong
    return [e.lower() for e in client.refusals]


def _try(server: int, role: str, subject: str, operation: str) -> tuple[list, list[str]]:
    """User `role` tries `operation` ("subscription" or "publish") on `subject` while the
    operator does the other side; returns what was delivered and the refusals `role` had."""
    async def scenario() -> tuple[list, list[str]]:
        got: list = []
        client, operator = Client(server, role), Client(server, grants.OPERATOR)
        async with client as nc, operator as op:
            async def keep(msg) -> None:
                got.append(msg)
            reader, writer = (nc, op) if operation == "subscription" else (op, nc)
            await reader.subscribe(subject, cb=keep)
            await reader.flush()
            await writer.publish(subject.replace(">", "x").replace("*", "x"), b"a prompt, or a forged chunk")
            refused = await _refused(client)
            await op.flush()
            await asyncio.sleep(0.2)
        return got, refused

    return asyncio.run(scenario())


@pytest.mark.parametrize(("role", "subject"), DENIED_SUBSCRIPTIONS, ids=[f"{r}:{s}" for r, s in DENIED_SUBSCRIPTIONS])
def test_an_instance_cannot_subscribe_outside_its_grant(server, role, subject):
    got, refused = _try(server, role, subject, "subscription")
    assert got == []
    assert any(f'permissions violation for subscription to "{subject.lower()}"' in e for e in refused), refused


@pytest.mark.parametrize(("role", "subject"), DENIED_PUBLISHES, ids=[f"{r}:{s}" for r, s in DENIED_PUBLISHES])
def test_an_instance_cannot_publish_outside_its_grant(server, role, subject):
    got, refused = _try(server, role, subject, "publish")
    sent = subject.replace(">", "x").replace("*", "x").lower()
    assert got == []
    assert any(f'permissions violation for publish to "{sent}"' in e for e in refused), refused


def test_a_wrong_password_is_refused(server):
    async def scenario() -> None:
        await nats.connect(url(server, "gateway", "guess"), allow_reconnect=False, max_reconnect_attempts=0)

    with pytest.raises(Exception, match="(?i)authorization"):
        asyncio.run(scenario())


def test_the_request_path_works_across_roles(server):
    """gateway -> router request/reply (the reply on the gateway's own inboxes, answered under
    the router's allow_responses), and the job stream: made by the operator, a job queued by a
    decode worker (acked by the stream), pulled and acked by a prefill worker through the
    consumer it makes of its own subject."""
    async def scenario() -> None:
        gateway = await Bus.connect(url(server, "gateway"), "gateway")
        router = await Bus.connect(url(server, "router"), "router")
        decode = await Bus.connect(url(server, "decode-0"), "decode")
        prefill = await Bus.connect(url(server, "prefill-0"), "prefill")
        try:
            async def answer(msg) -> None:
                ask = RouteRequest.decode(msg.data)
                await router.respond(msg, RouteReply(request_id=ask.request_id, ok=True, decode_worker="decode-0"))

            await router.subscribe(subjects.ROUTE, answer, queue=subjects.ROUTER_QUEUE)
            await router.nc.flush()
            ask = RouteRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=Sampling(), model="m")
            reply = await gateway.request(subjects.ROUTE, ask, RouteReply, timeout=5)
            assert reply.ok and reply.decode_worker == "decode-0"

            await router.wait_stream(subjects.PREFILL_STREAM)
            job = PrefillJob(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=Sampling(),
                             decode_worker="decode-0", decode_address="", decode_fingerprint="", first_block=0,
                             kv_tag=1)
            await decode.queue_prefill("prefill-0", job)
            pull = await prefill.js.pull_subscribe(subjects.prefill_jobs("prefill-0"), durable="prefill-0")
            [msg] = await pull.fetch(1, timeout=5)
            assert PrefillJob.decode(msg.data).request_id == "r1"
            await msg.ack_sync()
        finally:
            for bus in (gateway, router, decode, prefill):
                await bus.close()

    asyncio.run(scenario())


class _Waiting:
    """A state whose request `r2` waits on its job at prefill-1 (its events: routed there)."""

    class requests:  # noqa: N801 - (State.requests' shape)
        @staticmethod
        async def events(rid: str) -> list[Event]:
            return [Event(t=1.0, event="routed", by="router", prefill="prefill-1", decode="decode-0")]

        @staticmethod
        def note(*args, **kwargs) -> None:
            pass


def test_a_job_delivered_too_often_goes_to_the_dead_letters(server):
    """A prefill worker's consumer as it makes it (max_deliver; its ack_wait cut short here) and a
    job it takes JOB_MAX_DELIVERIES times, acking none: it is delivered no more, a router hears the
    server's advisory, reads the job by its sequence, puts it on pd.prefill.dead (the placement's
    secret left out) and moves its request, still waiting on it (a Stalled word); the worker then
    deletes its consumer, as on SIGTERM."""
    async def scenario() -> tuple[list[int], DeadJob, Stalled]:
        router = await Bus.connect(url(server, "router"), "router")
        decode = await Bus.connect(url(server, "decode-0"), "decode")
        prefill = await Bus.connect(url(server, "prefill-1"), "prefill")
        operator = await Bus.connect(url(server, grants.OPERATOR), "operator")
        heard: asyncio.Queue = asyncio.Queue()
        try:
            await operator.subscribe(subjects.PREFILL_DEAD, lambda m: heard.put(DeadJob.decode(m.data)))
            await operator.subscribe(subjects.stalled("*"), lambda m: heard.put(Stalled.decode(m.data)))
            await DeadLetters(router, _Waiting(), "router").start()  # (a State in the services)
            await operator.nc.flush()
            await router.nc.flush()
            await decode.queue_prefill("prefill-1", PrefillJob(
                request_id="r2", prompt_token_ids=[1, 2, 3], sampling=Sampling(), decode_worker="decode-0",
                decode_address="", decode_fingerprint="", first_block=0, kv_tag=1, secret="s3cret"))
            config = replace(streams.job_consumer("prefill-1"), ack_wait=0.3)
            await prefill.js.add_consumer(subjects.PREFILL_STREAM, config)
            pull = await prefill.js.pull_subscribe_bind("prefill-1", stream=subjects.PREFILL_STREAM)
            delivered = [(await pull.fetch(1, timeout=5))[0].metadata.num_delivered
                         for _ in range(streams.JOB_MAX_DELIVERIES)]
            with pytest.raises(nats.errors.TimeoutError):
                await pull.fetch(1, timeout=1)
            got = sorted([await asyncio.wait_for(heard.get(), 10) for _ in range(2)], key=lambda m: type(m).__name__)
            await pull.unsubscribe()
            assert await prefill.js.delete_consumer(subjects.PREFILL_STREAM, "prefill-1")
            return delivered, got[0], got[1]
        finally:
            for bus in (router, decode, prefill, operator):
                await bus.close()

    delivered, dead, stalled = asyncio.run(scenario())
    assert delivered == [1, 2, 3]
    assert (dead.request_id, dead.prefill_worker, dead.deliveries) == ("r2", "prefill-1", 3)
    assert PrefillJob.decode(dead.job.encode()).kv_tag == 1 and "s3cret" not in dead.job
    assert (stalled.request_id, stalled.attempt, stalled.phase) == ("r2", 0, "routed")


def test_prefix_events_work_across_roles(server):
    """PD_PREFIX_INDEX=events: a prefill and a decode worker publish their cache changes and
    answer snapshots; a router's follower (its ordered consumer, its snapshot asks) indexes both."""
    async def scenario() -> None:
        router = await Bus.connect(url(server, "router"), "router")
        workers = {role: await Bus.connect(url(server, f"{role}-0"), role) for role in ("prefill", "decode")}
        caches = {"prefill": [1, 2, 3], "decode": [1, 2]}

        def snapshot(role: str):
            async def taken() -> tuple[list[int], int]:
                return caches[role], 0
            return taken

        pubs = {role: PrefixEventPublisher(bus, f"{role}-0", snapshot(role)) for role, bus in workers.items()}
        entries = [WorkerInfo(worker_id=f"{role}-0", role=role, prefix_epoch=p.epoch) for role, p in pubs.items()]

        async def registered() -> list[WorkerInfo]:
            return entries

        follower = PrefixFollower(router, "router-0", registered, gone_s=30)
        try:
            for p in pubs.values():
                await p.start()
            await follower.start()
            await follower.tick()                                    # both asked for their snapshot
            pubs["prefill"].publish([CacheChange("stored", 4)])      # and an event on top
            for _ in range(100):
                if follower.lookup([1, 2, 3, 4]) == {"prefill-0": 4, "decode-0": 2}:
                    break
                await asyncio.sleep(0.05)
            assert follower.lookup([1, 2, 3, 4]) == {"prefill-0": 4, "decode-0": 2}
        finally:
            await follower.close()
            for p in pubs.values():
                await p.close()
            for bus in (router, *workers.values()):
                await bus.close()

    asyncio.run(scenario())
