"""The identity issuer: each instance of a deployment gets its own NATS user and Redis ACL user
from it (pdserve/shared/identity.py says how an instance asks; ARCHITECTURE, "Security: identities").

nats-server hands it every connection but the operator's and its own (auth callout,
deploy/nats/authorization.conf). A connection is let in when it carries one role's enrollment
token and the server's nonce signed by the user nkey it presents; its user is named after that
key (`<role>-<key>`), holds that instance's grant (pdserve/shared/grants.py) and is signed by the issuer's
account key. The instance then asks for its Redis ACL user in a request signed by the same key:
the issuer sets it (ACL SETUSER with the password's hash; ACL SAVE where Redis keeps an aclfile)
and sets it again whenever Redis has lost it (a Redis restarted empty; a replica promoted, since
Redis replicates no ACL change).

With no issuer running no instance can connect or reconnect (those connected stay connected):
run two, which share the requests (a queue group).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping
from typing import Any

import nats
import nkeys
import redis.asyncio as aioredis
from nats.aio.msg import Msg
from redis.exceptions import RedisError

from pdserve.shared import grants, identity, metrics, natsjwt, subjects
from pdserve.shared.config import IssuerSettings
from pdserve.shared.service import run, serving, setup_logging, stop_event
from pdserve.shared.tasks import every
from pdserve.shared.tls import client_context
from pdserve.shared.urls import async_redis, nats_servers

log = logging.getLogger("issuer")
REQUEST_AUDIENCE = "nats-authorization-request"  # nats-server's requests are addressed to this


class Refused(Exception):
    """Why a connection or a request is turned away (what the log and nats-server are told)."""


def role_of(tokens: Mapping[str, str], token: str) -> str:
    """The role whose enrollment token `token` is (compared in constant time)."""
    found = [role for role, t in tokens.items() if hmac.compare_digest(t.encode(), token.encode())]
    if not token or not found:
        raise Refused("no role has this enrollment token")
    return found[0]


def user_key(public_key: Any) -> str:
    """`public_key` when it is a user's nkey."""
    try:
        kind = natsjwt.public(str(public_key))[0]
    except ValueError:
        kind = -1
    if kind != nkeys.PREFIX_BYTE_USER:
        raise Refused("no user nkey")
    return str(public_key)


def admitted(request: dict[str, Any], tokens: Mapping[str, str]) -> tuple[str, str]:
    """The role and name of the connection nats-server asks about: its token's role, and the
    key it proved to hold (its signature of the server's nonce)."""
    opts, client = request.get("connect_opts", {}), request.get("client_info", {})
    role, key = role_of(tokens, opts.get("auth_token", "")), user_key(opts.get("nkey"))
    if not natsjwt.verify_nonce(key, client.get("nonce", ""), opts.get("sig", "")):
        raise Refused("the nonce is not signed by the key presented")
    return role, identity.name_of(role, key)


def user_claims(role: str, name: str, user_nkey: str) -> dict[str, Any]:
    """The user nats-server gives the connection (its `user_nkey`): instance `name` of `role`."""
    g = grants.grant(role, name)
    return {"sub": user_nkey, "aud": "$G", "name": name, "nats": {
        "pub": {"allow": [*g.publish, subjects.IDENTITY_REDIS]},
        "sub": {"allow": [*g.subscribe, grants.inbox(name) + ".>"]},
        "resp": {"max": 1, "ttl": 0},  # (nats-server's allow_responses)
        "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}}


def answer(token: str, tokens: Mapping[str, str], issuer: nkeys.KeyPair) -> tuple[str, bool, str]:
    """nats-server's authorization request `token` answered (signed by `issuer`), whether it lets
    the connection in, and what to log."""
    claims = natsjwt.decode(token)
    if claims.get("aud") != REQUEST_AUDIENCE or natsjwt.public(claims["iss"])[0] != nkeys.PREFIX_BYTE_SERVER:
        raise natsjwt.Invalid("not an authorization request from a server")
    request = claims["nats"]
    reply: dict[str, Any] = {"type": "authorization_response", "version": 2}
    try:
        role, name = admitted(request, tokens)
        reply["jwt"] = natsjwt.encode(user_claims(role, name, request["user_nkey"]), issuer)
        said = f"{name} in"
    except Refused as e:
        reply["error"] = str(e)
        said = f"refused {request.get('client_info', {}).get('host', '?')}: {e}"
    signed = natsjwt.encode({"sub": request["user_nkey"], "aud": request["server_id"]["id"], "nats": reply}, issuer)
    return signed, "jwt" in reply, said


def redis_rule(token: str, tokens: Mapping[str, str]) -> tuple[str, list[str]]:
    """The ACL user an instance's signed request asks for: its name and ACL SETUSER's rules."""
    claims = natsjwt.decode(token)
    if claims.get("aud") != identity.AUDIENCE or claims.get("sub") != "redis" or "exp" not in claims:
        raise Refused("not a request for a Redis user")
    role, key = role_of(tokens, str(claims.get("token", ""))), user_key(claims["iss"])
    digest = str(claims.get("password_sha256", ""))
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise Refused("no password hash")
    name = identity.name_of(role, key)
    return name, ["reset", "on", f"#{digest}", *grants.redis_keys(role, name).split(), *grants.REDIS_COMMANDS.split()]


class Issuer:
    def __init__(self, settings: IssuerSettings, r: aioredis.Redis):
        self.key = nkeys.from_seed(settings.issuer_seed.encode())
        self.tokens = settings.tokens
        self.redis = r
        self.users: dict[str, list[str]] = {}  # made by this issuer, kept in Redis

    async def on_auth(self, msg: Msg) -> None:
        try:
            reply, let_in, said = answer(msg.data.decode(), self.tokens, self.key)
        except (natsjwt.Invalid, KeyError, TypeError, ValueError) as e:
            log.warning("an authorization request that is not one: %s", e)
            return
        log.info("%s", said)
        metrics.ISSUED.labels("nats", "issued" if let_in else "refused").inc()
        await msg.respond(reply.encode())

    async def on_redis(self, msg: Msg) -> None:
        try:
            name, rule = redis_rule(msg.data.decode(), self.tokens)
            await self.set_user(name, rule)
        except (Refused, natsjwt.Invalid, KeyError, RedisError) as e:
            log.warning("no Redis user: %s", e)
            metrics.ISSUED.labels("redis", "refused").inc()
            await msg.respond(f"refused: {e}".encode())
            return
        metrics.ISSUED.labels("redis", "issued").inc()
        await msg.respond(b"ok")

    async def set_user(self, name: str, rule: list[str]) -> None:
        await self.redis.execute_command("ACL", "SETUSER", name, *rule)
        self.users[name] = rule
        try:
            await self.redis.execute_command("ACL", "SAVE")
        except aioredis.ResponseError:  # no aclfile: the users live as long as this Redis, then are set again
            pass
        log.info("Redis user %s", name)

    async def keep(self) -> None:
        """Set again the users Redis has lost."""
        present = {u.decode() if isinstance(u, bytes) else u for u in await self.redis.execute_command("ACL", "USERS")}
        for name in self.users.keys() - present:
            await self.set_user(name, self.users[name])


async def main() -> None:
    settings = IssuerSettings()
    setup_logging(settings, "issuer")
    metrics.serve(settings.metrics_port, settings.metrics_host)
    stop = stop_event()
    issuer = Issuer(settings, async_redis(settings.redis_url, 4))
    me = natsjwt.derived_key(settings.issuer_seed, identity.ISSUER_KEY)
    nc = await nats.connect(nats_servers(settings.nats_url), name="issuer", nkeys_seed_str=me.seed.decode(),
                            max_reconnect_attempts=-1, reconnect_time_wait=0.5, tls=client_context())
    await nc.subscribe(subjects.AUTH_CALLOUT, queue=subjects.ISSUER_QUEUE, cb=issuer.on_auth)
    await nc.subscribe(subjects.IDENTITY_REDIS, queue=subjects.ISSUER_QUEUE, cb=issuer.on_redis)
    log.info("issuing identities (issuer %s)", issuer.key.public_key.decode())
    serving()
    await every(settings.issuer_keep_s, issuer.keep, stop, log, "keeping the Redis users")
    await nc.close()
    await issuer.redis.aclose()


if __name__ == "__main__":
    run(main())
