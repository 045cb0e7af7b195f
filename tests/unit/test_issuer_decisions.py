"""The identity issuer's decisions (pdserve/services/issuer/main.py), without servers: a connection is let
in only with a role's token and its key's signature of the server's nonce, as the user named
after that key with that instance's grant; a request not signed by a server, a Redis request
expired or tampered with, are turned away. tests/integration/test_issuer_servers.py runs them for real."""

from __future__ import annotations

import base64
import time

import nkeys
import pytest

from pdserve.services.issuer.main import REQUEST_AUDIENCE, Refused, answer, redis_rule
from pdserve.shared import grants, identity, natsjwt, subjects
from pdserve.shared.identity import Enrollment

TOKENS = {role: f"token-{role}" for role in grants.ROLES}
ISSUER = natsjwt.new_key(nkeys.PREFIX_BYTE_ACCOUNT)
SERVER = natsjwt.new_key(nkeys.PREFIX_BYTE_SERVER)


def request(token: str, key: nkeys.KeyPair | None, nonce: str = "n0nce", signed_by: nkeys.KeyPair = SERVER,
            signature_of: str | None = None) -> str:
    """nats-server's authorization request for a client presenting `token` and `key`."""
    opts = {"auth_token": token}
    if key is not None:
        opts |= {"nkey": key.public_key.decode(),
                 "sig": base64.b64encode(key.sign((signature_of or nonce).encode())).decode()}
    return natsjwt.encode({"aud": REQUEST_AUDIENCE, "sub": "x", "nats": {
        "user_nkey": "UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4",
        "server_id": {"id": signed_by.public_key.decode()}, "client_info": {"nonce": nonce, "host": "10.0.0.7"},
        "connect_opts": opts}}, signed_by)


def reply(token: str) -> dict:
    signed, _, _ = answer(token, TOKENS, ISSUER)
    claims = natsjwt.decode(signed)
    assert claims["iss"] == ISSUER.public_key.decode() and claims["aud"] == SERVER.public_key.decode()
    return claims["nats"]


def test_an_instance_is_let_in_as_its_key_with_its_own_grant():
    key = natsjwt.new_key()
    user = natsjwt.decode(reply(request("token-decode", key))["jwt"])
    name = identity.name_of("decode", key.public_key.decode())
    assert user["name"] == name and user["iss"] == ISSUER.public_key.decode() and user["aud"] == "$G"
    assert subjects.decode_admit(name) in user["nats"]["sub"]["allow"]
    assert subjects.decode_admit(grants.ANY) not in user["nats"]["sub"]["allow"]
    assert grants.inbox(name) + ".>" in user["nats"]["sub"]["allow"]
    assert subjects.IDENTITY_REDIS in user["nats"]["pub"]["allow"]


@pytest.mark.parametrize("case", ["no token", "another token", "no key", "signed another nonce", "an account key"])
def test_refused_without_a_token_and_the_key_s_signature(case):
    key = natsjwt.new_key(nkeys.PREFIX_BYTE_ACCOUNT if case == "an account key" else nkeys.PREFIX_BYTE_USER)
    token = {"no token": "", "another token": "token-guess"}.get(case, "token-router")
    got = reply(request(token, None if case == "no key" else key,
                        signature_of="other" if case == "signed another nonce" else None))
    assert "jwt" not in got and got["error"]


def test_a_request_not_from_a_server_is_not_answered():
    with pytest.raises(natsjwt.Invalid):
        answer(request("token-router", natsjwt.new_key(), signed_by=natsjwt.new_key()), TOKENS, ISSUER)
    forged = request("token-router", natsjwt.new_key())
    head, body, _ = forged.split(".")
    with pytest.raises(natsjwt.Invalid):
        answer(f"{head}.{body}.{base64.urlsafe_b64encode(bytes(64)).decode().rstrip('=')}", TOKENS, ISSUER)


def test_a_redis_user_is_the_signing_key_s_with_its_role_s_keys():
    me = Enrollment("gateway", "token-gateway")
    name, rule = redis_rule(me.redis_request().decode(), TOKENS)
    assert name == me.name
    assert f"#{identity.password_hash(me.redis_password)}" in rule and rule[:2] == ["reset", "on"]
    assert f"~pd:{{registry}}:worker:{me.name}_*" in rule and "%R~pd:{registry}:worker:*" in rule
    with pytest.raises(Refused):
        redis_rule(Enrollment("gateway", "token-guess").redis_request().decode(), TOKENS)
    old = natsjwt.encode({"aud": identity.AUDIENCE, "sub": "redis", "exp": int(time.time()) - 1,
                          "token": "token-gateway", "password_sha256": "0" * 64}, me.key)
    with pytest.raises(natsjwt.Invalid):
        redis_rule(old, TOKENS)
    unhashed = natsjwt.encode({"aud": identity.AUDIENCE, "sub": "redis", "exp": int(time.time()) + 9,
                               "token": "token-gateway", "password_sha256": "secret"}, me.key)
    with pytest.raises(Refused):
        redis_rule(unhashed, TOKENS)


def test_an_enrolled_instance_is_named_by_its_key_alone():
    me = identity.mine("prefill", "t")
    assert identity.instance_id("prefill", "t", "", "x") == me.name == identity.mine("prefill", "t").name
    with pytest.raises(ValueError, match="named by its key"):
        identity.instance_id("prefill", "t", "prefill-0", "x")
    assert identity.instance_id("prefill", "", "prefill-0", "x") == "prefill-0"
    url = me.redis_url("redis+sentinel://:old@redis:26379/mymaster/0?sentinel_password=s")
    assert url.startswith(f"redis+sentinel://{me.name}:")
    assert url.endswith("@redis:26379/mymaster/0?sentinel_password=s")
