"""Each service instance's Redis ACL user (pdserve/shared/grants.py) on a real server (Valkey 9): its
role's part of the store works through the code that uses it (the registry, request state,
the gateway's limits), and each named operation outside its grant is refused (NOPERM): admin
commands, keys of another part, a key touched from inside a script, and another instance's
registry entry (written, renewed, deleted, or heartbeated through the registry's own script).
The stack tests run every service as its own Redis user (pdserve/local/stack.py)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
import redis

from pdserve.local.servers import free_port, running, valkey_server, wait_for_port
from pdserve.services.gateway.concurrency import Concurrency
from pdserve.shared import grants
from pdserve.shared.messages import WorkerBatch, WorkerInfo
from pdserve.shared.state import State
from pdserve.shared.state.keys import batch_key

USERS = {role: grants.User(f"{role}-0", role, f"pw-{role}", instance=f"{role}-0") for role in grants.ROLES}
OPERATOR = "operator-pw"
ENTRY = "pd:{registry}:worker:"
# (role, what, a command as redis-py sends it): each must be refused
DENIED = [(role, what, command) for role in grants.ROLES for what, command in [
    ("flush the store", ("FLUSHALL",)), ("read the config", ("CONFIG", "GET", "*")), ("list keys", ("KEYS", "*")),
    ("stop the server", ("SHUTDOWN", "NOSAVE")), ("change users", ("ACL", "SETUSER", "x", "on")),
    ("a key outside pd:", ("SET", "other", "1")),
    ("a key from a script", ("EVAL", "return redis.call('GET', 'other')", "0"))]] + [
    ("gateway", "the prefix index", ("SET", "pd:prefix:live:1", "1")),
    ("prefill", "a rate bucket", ("HSET", "pd:rate:alice", "tokens", "999")),
    ("decode", "a route record", ("HSET", "pd:route:r1", "decode", "decode-evil")),
    ("router", "the in-flight count", ("ZREM", "pd:inflight:alice", "r1:0")),
    ("prefill", "a session", ("SET", "pd:session:s1", "decode-evil")),
    ("decode", "another's registry entry", ("SET", ENTRY + "decode-1", "{}")),
    ("prefill", "delete another's entry", ("DEL", ENTRY + "decode-0")),
    ("router", "renew another's lease", ("PEXPIRE", ENTRY + "decode-0", "99999")),
    ("gateway", "another's entry from a script", ("EVAL", "return redis.call('SET', KEYS[1], 'x')", "1",
                                                    ENTRY + "router-0")),
    ("decode", "another's pass record", ("SET", batch_key("decode-1"), "{}")),
    ("gateway", "a worker's pass record", ("SET", batch_key("decode-0"), "{}")),
    ("router", "a worker's pass record gone", ("DEL", batch_key("prefill-0"))),
]


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    d = tmp_path_factory.mktemp("redis")
    conf = d / "redis.conf"
    conf.write_text(f"requirepass {OPERATOR}\n{grants.redis_users(USERS.values())}")
    p = free_port()
    with running([valkey_server(), str(conf), "--port", str(p), "--bind", "127.0.0.1",
                  "--save", "", "--appendonly", "no", "--dir", str(d)], stdout=subprocess.DEVNULL) as proc:
        wait_for_port(p, proc=proc)
        yield p


def url(port: int, role: str) -> str:
    """Instance `<role>-0`'s."""
    return f"redis://{USERS[role].name}:{USERS[role].password}@127.0.0.1:{port}/0"


def registered(role: str) -> str:
    """The registry id of instance `<role>-0` (a gateway's has its start's suffix)."""
    return f"{role}-0_1a2b" if role == "gateway" else f"{role}-0"


@pytest.mark.parametrize("role, what, command", DENIED, ids=[f"{r}: {w}" for r, w, _ in DENIED])
def test_a_role_is_refused_what_is_outside_its_grant(port, role, what, command):
    r = redis.Redis.from_url(url(port, role))
    with pytest.raises(redis.exceptions.ResponseError, match="permission|can't access"):  # (NOPERM; in a script)
        r.execute_command(*command)
    assert redis.Redis(port=port, password=OPERATOR).ping()  # (still up: SHUTDOWN was refused)


def test_each_roles_part_of_the_store_works_as_that_role(port):
    async def scenario():
        stores = {role: State.connect(url(port, role)) for role in grants.ROLES}
        for role, store in stores.items():  # every role registers and records request events
            await store.registry.heartbeat(WorkerInfo(worker_id=registered(role), role=role), lease_s=5)
            await store.requests.record(f"r-{role}", "received" if role == "gateway" else "decoding", by=f"{role}-0",
                               owner="gw-0" if role == "gateway" else "", deadline_s=30)
        workers = await stores["router"].registry.workers()
        limit = Concurrency(stores["gateway"], 2, 5.0, fail_open=False)
        await limit.join("alice", "r1", 2)
        await stores["router"].sessions.set_worker("s1", "decode-0", 10)
        for role in ("prefill", "decode"):  # each worker records its passes; gateways and routers charge crashes
            await stores[role].crashes.record_batch(WorkerBatch(worker=f"{role}-0", incarnation="1", requests=["q"]))
        await stores["gateway"].crashes.charge("q", "decode-0")
        charged = await stores["router"].crashes.charge("q", "prefill-0")
        phases = {role: (await stores["router"].requests.summary(f"r-{role}"))["phase"] for role in grants.ROLES}
        for store in stores.values():
            await store.close()
        return [w.worker_id for w in workers], phases, charged

    workers, phases, charged = asyncio.run(scenario())
    assert charged == ["decode-0@1", "prefill-0@1"]
    assert workers == sorted(registered(role) for role in grants.ROLES)
    assert phases == {"gateway": "received", "router": "decoding", "prefill": "decoding", "decode": "decoding"}


def test_no_instance_can_heartbeat_or_deregister_another_through_the_registry(port):
    """The registry's own calls, made for another instance's id: refused, and its entry stays."""
    async def scenario() -> list[str]:
        decode, prefill = State.connect(url(port, "decode")), State.connect(url(port, "prefill"))
        await decode.registry.heartbeat(WorkerInfo(worker_id="decode-0", role="decode"), lease_s=30)
        refused = []
        for attempt in (prefill.registry.heartbeat(WorkerInfo(worker_id="decode-0", role="prefill"), lease_s=30),
                        prefill.registry.deregister("decode-0")):
            try:
                await attempt
            except redis.exceptions.ResponseError as e:
                refused.append(str(e))
        entry = (await prefill.registry.entries(["decode-0"]))["decode-0"]
        for store in (decode, prefill):
            await store.close()
        assert entry is not None and entry.role == "decode"
        return refused

    refused = asyncio.run(scenario())
    assert len(refused) == 2 and all("permission" in r.lower() for r in refused), refused
