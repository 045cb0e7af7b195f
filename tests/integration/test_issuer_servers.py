"""The identity issuer (pdserve/services/issuer) as compose and Kubernetes run it: nats-server with the
authorization block of deploy/nats/authorization.conf (its variables from the environment),
Valkey with only its operator, and the issuer as a process of its own. An instance enrolled with
its role's token gets a user named after its key holding its own grant, and a Redis user that
writes its own registry entry alone; a wrong token, a key it cannot sign with, a forged Redis
request, or a name taken from another instance are refused."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
import pytest
import redis

from pdserve.local.servers import binary, free_port, running, valkey_server, wait_for_port
from pdserve.services.issuer import keys
from pdserve.shared import grants, identity, natsjwt, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.identity import Enrollment
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.state import State

ENTRY = "pd:{registry}:worker:"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """(secrets, NATS URL, Redis URL): the servers and the issuer running."""
    d = tmp_path_factory.mktemp("issuer")
    secrets = keys.made()
    env = {**os.environ, **secrets}
    nats_port, redis_port = free_port(), free_port()
    (d / "authorization.conf").write_text(grants.nats_callout(*(
        "$" + v for v in ("PD_NATS_PDSERVE_PASSWORD", "PD_ISSUER_ACCOUNT", "PD_ISSUER_NKEY"))))
    (d / "nats.conf").write_text(f'listen: "127.0.0.1:{nats_port}"\ninclude ./authorization.conf\n')
    (d / "users.acl").write_text(f"user default on >{secrets['PD_REDIS_PASSWORD']} ~* &* +@all\n")
    nats_url, redis_url = f"nats://127.0.0.1:{nats_port}", f"redis://127.0.0.1:{redis_port}/0"
    operator_redis = f"redis://:{secrets['PD_REDIS_PASSWORD']}@127.0.0.1:{redis_port}/0"
    with contextlib.ExitStack() as procs:
        bus_server = procs.enter_context(running([binary("nats-server"), "-c", str(d / "nats.conf")], env=env,
                                           stderr=subprocess.DEVNULL))
        store = procs.enter_context(running([valkey_server(), "--port", str(redis_port), "--bind", "127.0.0.1",
                                             "--aclfile", str(d / "users.acl"), "--save", "", "--dir", str(d)],
                                            stdout=subprocess.DEVNULL))
        wait_for_port(nats_port, proc=bus_server)
        wait_for_port(redis_port, proc=store)
        procs.enter_context(running([sys.executable, "-m", "pdserve.services.issuer.main"], env={
            **env, "PD_NATS_URL": nats_url, "PD_REDIS_URL": operator_redis, "PD_ISSUER_KEEP_S": "0.2"}))
        asyncio.run(_until_enrolls(nats_url, secrets["PD_ENROLL_DECODE"]))
        yield secrets, nats_url, redis_url, operator_redis, d


async def _until_enrolls(url: str, token: str) -> None:
    for _ in range(100):
        try:
            bus = await Bus.connect(url, "probe", me=Enrollment("decode", token))
            await bus.close()
            return
        except Exception:  # noqa: BLE001 - the issuer not subscribed yet
            await asyncio.sleep(0.1)
    raise RuntimeError("the issuer never let an instance in")


async def _refused(url: str, **auth) -> str:
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)
    with pytest.raises(Exception):  # noqa: B017,PT011 - nats-py raises what the server said, or gives up
        await nats.connect(url, allow_reconnect=False, error_cb=on_error, connect_timeout=3, **auth)
    return " ".join(map(str, errors)).lower()


def test_an_instance_is_its_key_with_its_own_grant(deployment):
    secrets, url, _, _, _ = deployment

    async def run() -> None:
        me, other = (Enrollment("decode", secrets["PD_ENROLL_DECODE"]) for _ in range(2))
        bus, theirs = await Bus.connect(url, "a", me=me), await Bus.connect(url, "b", me=other)
        assert me.name.startswith("decode-") and me.name != other.name
        await bus.nc.subscribe(subjects.decode_admit(me.name))
        await bus.nc.flush()
        await asyncio.sleep(0.2)
        assert bus.nc.last_error is None
        # another decode worker's admits: refused to it
        await bus.nc.subscribe(subjects.decode_admit(other.name))
        await bus.nc.flush()
        await asyncio.sleep(0.3)
        assert "permissions violation" in str(bus.nc.last_error).lower()
        # its replies come to its own inbox only
        assert bus.nc._inbox_prefix.decode().startswith(grants.inbox(me.name))
        await bus.close()
        await theirs.close()
    asyncio.run(run())


def test_refused_without_the_token_or_the_key(deployment):
    secrets, url, _, _, _ = deployment
    key = natsjwt.new_key()

    async def run() -> None:
        # a token no role has
        assert "authorization" in await _refused(url, nkeys_seed_str=key.seed.decode(), token="guess")
        # a role's token without a key
        assert "authorization" in await _refused(url, token=secrets["PD_ENROLL_ROUTER"])
        # the operator's user and password are not a role's token
        assert "authorization" in await _refused(url, token=secrets["PD_NATS_PDSERVE_PASSWORD"])
    asyncio.run(run())


def test_an_instance_writes_only_its_own_registry_entry(deployment):
    secrets, url, redis_url, _, _ = deployment

    async def run() -> None:
        me, other = (Enrollment("prefill", secrets["PD_ENROLL_PREFILL"]) for _ in range(2))
        bus, theirs = await Bus.connect(url, "a", me=me), await Bus.connect(url, "b", me=other)
        state = State.connect(await bus.enroll_redis(me, redis_url))
        State.connect(await theirs.enroll_redis(other, redis_url))
        await state.registry.heartbeat(WorkerInfo(worker_id=me.name, role="prefill"), 10)
        assert me.name in {w.worker_id for w in await state.registry.workers()}
        r = redis.Redis.from_url(me.redis_url(redis_url))
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set(ENTRY + other.name, "{}")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.config_get("*")
        await state.close()
        await bus.close()
        await theirs.close()
    asyncio.run(run())


def test_a_forged_redis_request_is_refused(deployment):
    secrets, url, redis_url, _, _ = deployment

    async def run() -> None:
        me = Enrollment("decode", secrets["PD_ENROLL_DECODE"])
        bus = await Bus.connect(url, "a", me=me)
        victim = identity.name_of("decode", natsjwt.new_key().public_key.decode())
        forged = natsjwt.encode({"aud": identity.AUDIENCE, "sub": "redis", "exp": 2**31, "token": me.token,
                                 "password_sha256": identity.password_hash("mine"), "name": victim}, me.key)
        reply = await bus.nc.request(subjects.IDENTITY_REDIS, forged.encode(), timeout=5)
        assert reply.data == b"ok"  # a user is made: the request's own key's, never the name it claims
        r = redis.Redis.from_url(redis_url.replace("redis://", f"redis://{victim}:mine@"))
        with pytest.raises(redis.exceptions.AuthenticationError):
            r.ping()
        wrong_role = Enrollment("router", secrets["PD_ENROLL_DECODE"]).redis_request()
        # (signed by a key, with the decode token: a decode user, never a router)
        assert (await bus.nc.request(subjects.IDENTITY_REDIS, wrong_role, timeout=5)).data == b"ok"
        tampered = me.redis_request().decode()
        head, body, sig = tampered.split(".")
        claims = body[:-4] + ("AAAA" if body[-4:] != "AAAA" else "BBBB")
        bad = await bus.nc.request(subjects.IDENTITY_REDIS, f"{head}.{claims}.{sig}".encode(), timeout=5)
        assert bad.data.startswith(b"refused")
        await bus.close()
    asyncio.run(run())


def test_a_redis_restarted_empty_gets_the_users_back(deployment):
    secrets, url, redis_url, operator_redis, _ = deployment

    async def run() -> None:
        me = Enrollment("router", secrets["PD_ENROLL_ROUTER"])
        bus = await Bus.connect(url, "a", me=me)
        mine = redis.Redis.from_url(await bus.enroll_redis(me, redis_url))
        assert mine.ping()
        redis.Redis.from_url(operator_redis).execute_command("ACL", "DELUSER", me.name)
        for _ in range(50):
            await asyncio.sleep(0.1)
            try:
                if redis.Redis.from_url(me.redis_url(redis_url)).ping():
                    break
            except redis.exceptions.AuthenticationError:
                continue
        else:
            pytest.fail("the issuer did not make the lost user again")
        await bus.close()
    asyncio.run(run())


def test_the_keys_are_one_deployment_s_and_nats_server_reads_them_as_strings(tmp_path):
    """nats-server parses a `$VARIABLE`'s value as it would a literal: a password that began
    with a digit stopped it ("Expected digit in ISO8601 datetime", seen by make compose-check).
    20 sets of keys, each read at a start of nats-server through the deployed authorization block."""
    conf = tmp_path / "nats.conf"
    (tmp_path / "authorization.conf").write_text((Path(__file__).parents[2] / "deploy" / "nats" /
                                                 "authorization.conf").read_text())
    conf.write_text('jetstream { store_dir: "' + str(tmp_path) + '", key: $PD_JS_KEY }\n'
                    "include ./authorization.conf\n")

    def starts(secrets: dict[str, str]) -> str:
        port = free_port()
        proc = subprocess.Popen([binary("nats-server"), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port)],
                                env={**os.environ, **secrets}, stderr=subprocess.PIPE, text=True)
        try:
            wait_for_port(port, 10, proc)
            return ""
        except RuntimeError:
            return proc.communicate(timeout=5)[1][-300:]
        finally:
            proc.terminate()
            proc.wait()
    assert "could not be parsed" in starts({**keys.made(), "PD_NATS_PDSERVE_PASSWORD": "1234-kabc"})  # the old way
    for _ in range(20):
        assert starts(keys.made()) == ""
    made = keys.made()
    assert natsjwt.public(made["PD_ISSUER_ACCOUNT"])[0] != natsjwt.public(made["PD_ISSUER_NKEY"])[0]
    assert len({made[f"PD_ENROLL_{r.upper()}"] for r in grants.ROLES}) == len(grants.ROLES)
    assert made["PD_ISSUER_SEED"].startswith("SA")
