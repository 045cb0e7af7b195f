"""The stack as compose and Kubernetes run it (StackConfig.issuer, `make run RUN_ARGS=--issuer`):
the servers know only the operator and the identity issuer; every service instance holds its
role's enrollment token alone, makes a key, and is let in as a NATS and Redis user named after
it. A request is served through a prefill worker's handoff with no operation refused; every
registry entry is a key's name; a pod holding a role's token (a compromised one) gets a new
name of its own and cannot read the admits of the decode worker it shares the token with, nor
write that worker's registry entry. On the fake model (tests/stack/conftest.py): what is tested is
who is let in, not the model's numbers."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats.errors
import pytest
import redis
from conftest import FAKE, MODEL, fake_env

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared import identity, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.identity import Enrollment
from pdserve.shared.state import State

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=256, issuer=True, model=FAKE, env=fake_env(),
                                        log_dir=tmp_path_factory.mktemp("issuer-logs"))).start()
    yield s
    s.stop()


def test_requests_are_served_with_every_instance_let_in_by_the_issuer(stack):
    prompt = "Explain in one sentence why the sky is blue. " * 12   # (long enough for the prefill worker)
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    ids = asyncio.run(State.connect(stack.redis_url).registry.workers())
    assert {w.role for w in ids} >= {"router", "prefill", "decode", "gateway"}
    for w in ids:   # (a gateway registers each start as <name>_<random>)
        name = w.worker_id.split("_")[0]
        assert name.startswith(f"{w.role}-") and len(name) == len(w.role) + 1 + identity.NAME_CHARS, w.worker_id
    assert stack.metric_total("gateway", "pd_requests_total") >= 1
    assert stack.refused() == []


def test_a_pod_with_a_role_s_token_is_a_new_instance_and_no_other(stack):
    token = stack.ids.enrollment("decode")["PD_ENROLL_TOKEN"]
    decode = next(w.worker_id for w in asyncio.run(State.connect(stack.redis_url).registry.workers("decode")))

    async def attack() -> tuple[str, str, str]:
        me = Enrollment("decode", token)
        bus = await Bus.connect(stack.nats_url_of(""), "intruder", me=me)
        await bus.nc.subscribe(subjects.decode_admit(decode))   # the real decode worker's admits
        await bus.nc.flush()
        await asyncio.sleep(0.3)
        read_admits = str(bus.nc.last_error)
        url = await bus.enroll_redis(me, stack.redis_url_of(""))
        try:
            redis.Redis.from_url(url).set(f"pd:{{registry}}:worker:{decode}", "{}")
            wrote = "wrote"
        except redis.exceptions.NoPermissionError as e:
            wrote = str(e)
        await bus.close()
        return me.name, read_admits, wrote

    name, read_admits, wrote = asyncio.run(attack())
    assert name != decode and name.startswith("decode-")
    assert "permissions violation" in read_admits.lower()
    assert "no permissions" in wrote.lower()
    with pytest.raises(nats.errors.Error):   # and with no token at all: not let in
        asyncio.run(nats.connect(stack.nats_url_of(""), allow_reconnect=False, connect_timeout=3))


def test_instances_are_let_in_again_after_nats_and_redis_restart(stack):
    """NATS restarted: every instance reconnects through the issuer (which reconnects as its own
    nkey user); Redis restarted empty: the issuer makes the users it made again."""
    stack.restart("nats")
    stack.restart("redis")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi. " * 40}], "max_tokens": 4,
            "temperature": 0}
    deadline, last = time.monotonic() + 90, None
    while time.monotonic() < deadline:
        try:
            last = httpx.post(stack.url + "/v1/chat/completions", timeout=30, json=body)
            if last.status_code == 200:
                break
        except httpx.HTTPError as e:
            last = e
        time.sleep(1)
    assert isinstance(last, httpx.Response) and last.status_code == 200, last
    assert stack.procs["issuer"].poll() is None
