"""An instance's own identity, given by the deployment's identity issuer (pdserve/services/issuer): how
instances get one in compose and Kubernetes, where they come and go without a person naming each.

An instance makes a key pair when it starts and is named after it, `<role>-<16 characters of its
public key>` (`name_of`): no other instance can take its name without its private key. It
connects to NATS with the key (signing the server's nonce) and its role's enrollment token
(PD_ENROLL_TOKEN: one per role per deployment, never per instance); nats-server asks the issuer
(auth callout), which checks both and answers with a user of that name holding that instance's
grant (pdserve/shared/grants.py). Then the instance asks the issuer, over NATS and signed with the same
key, for its Redis ACL user, sending only the hash of a password it made; the issuer makes the
user (the instance's own registry entry writable, the others read-only) and the instance connects
to Redis as it. The key and the password live in the process's memory alone: a restarted instance
is a new one, with a new name.

The local stack (pdserve/local) writes each instance's users into the servers' configuration
instead, and names them itself; an instance there has no enrollment token.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

import nkeys

from pdserve.shared import natsjwt

AUDIENCE = "pdserve-issuer"     # what an instance's requests to the issuer are addressed to
NAME_CHARS = 16                 # of the public key in an instance's name (80 bits)
REQUEST_TTL_S = 60
ISSUER_KEY = "pdserve-issuer"   # what the issuer's own NATS key is made from its seed for (natsjwt.derived_key)


def name_of(role: str, public_key: str) -> str:
    """The name of the instance of `role` holding `public_key` (its id in the registry, its NATS
    and Redis user)."""
    return f"{role}-{public_key[1:1 + NAME_CHARS].lower()}"


def password_hash(password: str) -> str:
    """How Redis keeps a password (ACL SETUSER's `#<sha256>`): what the issuer is sent."""
    return hashlib.sha256(password.encode()).hexdigest()


@dataclass
class Enrollment:
    """This process's identity as instance of `role`, enrolled with `token`."""

    role: str
    token: str
    key: nkeys.KeyPair = field(default_factory=natsjwt.new_key, repr=False)
    redis_password: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)

    @property
    def public_key(self) -> str:
        return self.key.public_key.decode()

    @property
    def name(self) -> str:
        return name_of(self.role, self.public_key)

    def redis_request(self) -> bytes:
        """The request for this instance's Redis user: signed by its key, for the issuer only."""
        claims = {"aud": AUDIENCE, "sub": "redis", "exp": int(time.time()) + REQUEST_TTL_S,
                  "token": self.token, "password_sha256": password_hash(self.redis_password)}
        return natsjwt.encode(claims, self.key).encode()

    def redis_url(self, url: str) -> str:
        """PD_REDIS_URL with this instance's user in place of any there."""
        parts = urlsplit(url)
        hosts = parts.netloc.rpartition("@")[2]
        rest = parts.path + (f"?{parts.query}" if parts.query else "")
        return f"{parts.scheme}://{quote(self.name, safe='')}:{quote(self.redis_password, safe='')}@{hosts}{rest}"


_MINE: dict[tuple[str, str], Enrollment] = {}


def mine(role: str, token: str) -> Enrollment | None:
    """This process's enrollment as `role` with `token` (made once; None without a token: no issuer)."""
    if not token:
        return None
    if (role, token) not in _MINE:
        _MINE[role, token] = Enrollment(role, token)
    return _MINE[role, token]


def instance_id(role: str, token: str, chosen: str, default: str) -> str:
    """An instance's id: its enrollment's name when it has a token (an id chosen besides is an
    error: the issuer grants only the key's name), else `chosen`, else `default`."""
    me = mine(role, token)
    if me is None:
        return chosen or default
    if chosen:
        raise ValueError(f"an instance enrolled with the identity issuer (PD_ENROLL_TOKEN) is named by its key "
                         f"({me.name}): unset its id ({chosen!r})")
    return me.name
