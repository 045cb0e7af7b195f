"""The stack with NATS on mutual TLS (StackConfig.tls, `make run RUN_ARGS=--tls`): a request
is served through a prefill worker's handoff, every service connected with its own certificate;
a client with the operator's password but no certificate, a certificate another CA signed, or
no TLS at all is refused by the server before it can say who it is; Redis the same. On the fake
model (tests/stack/conftest.py): what is tested is who is let in, not the model's numbers."""

from __future__ import annotations

import asyncio
import ssl

import httpx
import nats
import pytest
import redis
from conftest import FAKE, MODEL, fake_env

from pdserve.local.certificates import Authority
from pdserve.local.stack import Stack, StackConfig
from pdserve.shared import grants, subjects
from pdserve.shared.tls import TLSSettings, client_context

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=256, tls=True, model=FAKE, env=fake_env(),
                                        log_dir=tmp_path_factory.mktemp("tls-logs"))).start()
    yield s
    s.stop()


async def connects(url: str, tls: ssl.SSLContext | None) -> bool:
    try:
        nc = await nats.connect(url, tls=tls, allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0)
    except Exception:  # noqa: BLE001 - refused (a handshake failure, or the server closing on us)
        return False
    try:
        await nc.jetstream().stream_info(subjects.PREFILL_STREAM)   # (the operator's: it answers only a client let in)
        return True
    except Exception:  # noqa: BLE001
        return False
    finally:
        await nc.close()


def test_requests_are_served_with_every_service_on_its_own_certificate(stack):
    prompt = "Explain in one sentence why the sky is blue. " * 12   # (long enough for the prefill worker)
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    assert stack.nats_url.startswith("tls://")
    assert stack.refused() == []


def test_only_a_client_with_a_certificate_of_the_stacks_ca_is_let_in(stack, tmp_path):
    own = TLSSettings(**{k.removeprefix("PD_TLS_").lower(): v for k, v in stack.tls_env(grants.OPERATOR).items()})
    stranger = Authority(tmp_path / "other").issue("pdserve")
    no_cert = TLSSettings(ca=own.ca)
    foreign = TLSSettings(ca=own.ca, cert=str(stranger.cert), key=str(stranger.key))
    url = stack.nats_url

    async def scenario() -> dict[str, bool]:
        return {"own certificate": await connects(url, client_context(own)),
                "no certificate": await connects(url, client_context(no_cert)),
                "another CA's certificate": await connects(url, client_context(foreign)),
                "no TLS": await connects(url.replace("tls://", "nats://"), None)}

    assert asyncio.run(scenario()) == {"own certificate": True, "no certificate": False,
                                       "another CA's certificate": False, "no TLS": False}


def test_redis_takes_only_a_client_with_a_certificate_of_the_stacks_ca(stack, tmp_path):
    """Redis on TLS too (tls-port alone, tls-auth-clients): every service's URL is rediss:// with
    its own certificate; the operator's password without a certificate, or with another CA's, or
    over plain TCP, gets nothing."""
    own = stack.redis_url
    assert own.startswith("rediss://") and stack.redis_url_of("decode-0").startswith("rediss://")
    assert redis.Redis.from_url(own).ping()
    stranger = Authority(tmp_path / "other").issue("pdserve")
    base, _, query = own.partition("?")
    no_cert = f"{base}?ssl_ca_certs={dict(p.split('=') for p in query.split('&'))['ssl_ca_certs']}"
    foreign = f"{no_cert}&ssl_certfile={stranger.cert}&ssl_keyfile={stranger.key}"
    for url in (no_cert, foreign, base.replace("rediss://", "redis://")):
        with pytest.raises(redis.exceptions.ConnectionError):
            redis.Redis.from_url(url, socket_timeout=3).ping()
