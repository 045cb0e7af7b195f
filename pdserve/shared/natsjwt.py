"""NATS's JWTs (ed25519 over nkeys, nats-server's `ed25519-nkey` algorithm): encoded and signed
with a key pair, decoded with the signature checked against the issuer the token names. The
identity issuer (pdserve/services/issuer) reads nats-server's authorization requests and answers with a
signed user; an instance signs its requests to the issuer with its own key (pdserve/shared/identity.py).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_URLSAFE = str.maketrans("+/", "-_")   # standard base64's alphabet as the URL-safe one


class Invalid(ValueError):
    """A token that is malformed, badly signed or expired."""


def new_key(prefix: int = nkeys.PREFIX_BYTE_USER) -> nkeys.KeyPair:
    """A fresh key pair (a user's by default; nkeys.PREFIX_BYTE_ACCOUNT for an issuer)."""
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def derived_key(seed: str, purpose: str, prefix: int = nkeys.PREFIX_BYTE_USER) -> nkeys.KeyPair:
    """A key pair of its own for `purpose`, made from `seed` (one secret, two keys never used alike)."""
    raw = hashlib.blake2b(seed.encode(), digest_size=32, person=purpose.encode()[:16]).digest()
    return nkeys.from_seed(nkeys.encode_seed(raw, prefix))


def public(public_key: str) -> tuple[int, nacl.signing.VerifyKey]:
    """The kind (nkeys.PREFIX_BYTE_*) and verifying key of an encoded public key (`U...`, `A...`,
    `N...`), its checksum checked: a ValueError when it is not one."""
    raw = base64.b32decode(public_key + "=" * (-len(public_key) % 8))
    if len(raw) != 35 or nkeys.crc16_checksum(raw[:33]) != raw[33:] or not nkeys.valid_public_prefix_byte(raw[0]):
        raise ValueError("not an nkey public key")
    return raw[0], nacl.signing.VerifyKey(raw[1:33])


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _compact(claims: dict[str, Any]) -> bytes:
    return json.dumps(claims, separators=(",", ":")).encode()


def encode(claims: dict[str, Any], key: nkeys.KeyPair) -> str:
    """`claims` issued (`iss`) and signed by `key`, stamped (`iat`) and identified (`jti`)."""
    claims = {**claims, "iat": int(time.time()), "iss": key.public_key.decode(), "jti": ""}
    claims["jti"] = base64.b32encode(hashlib.sha256(_compact(claims)).digest()).decode().rstrip("=")
    signed = f"{_b64(_compact(_HEADER))}.{_b64(_compact(claims))}"
    return f"{signed}.{_b64(key.sign(signed.encode()))}"


def decode(token: str, now: float | None = None) -> dict[str, Any]:
    """The claims of `token`, its signature checked against the key it names as issuer and its
    expiry (`exp`, when it has one) against `now`."""
    try:
        head, body, sig = token.split(".")
        claims = json.loads(_unb64(body))
        public(claims["iss"])[1].verify(f"{head}.{body}".encode(), _unb64(sig))
    except (ValueError, KeyError, TypeError, nacl.exceptions.CryptoError) as e:
        raise Invalid(f"not a valid token: {type(e).__name__}") from None
    if "exp" in claims and claims["exp"] < (time.time() if now is None else now):
        raise Invalid("expired")
    return claims


def verify_nonce(public_key: str, nonce: str, signature: str) -> bool:
    """Whether `signature` (base64, either alphabet) is `public_key`'s over `nonce`: a client's
    proof that it holds the key it connects with."""
    try:
        public(public_key)[1].verify(nonce.encode(), _unb64(signature.translate(_URLSAFE)))
    except (ValueError, TypeError, nacl.exceptions.CryptoError):
        return False
    return True
