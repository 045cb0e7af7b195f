"""API keys: checked at the gateway, stored hashed.

Configuration holds only `name:sha256hex` entries (`PD_API_KEYS`, comma-separated); the
keys themselves are shown once, when made:

    python -m pdserve.services.gateway.auth new alice     # prints the key and its config entry

A request presents its key as `Authorization: Bearer <key>` (what OpenAI clients send).
With no keys configured the API is open, and the gateway says so when it starts.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sys

from pdserve.services.gateway.errors import APIError

KEY_PREFIX = "pd-"


def hash_key(key: str) -> str:
    """Keys are 32 random bytes: a plain SHA-256 is enough (no password stretching needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_entries(spec: str) -> dict[str, str]:
    """`name:sha256hex,...` → {hash: name}; a malformed entry is a configuration error."""
    keys: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, _, digest = entry.rpartition(":")
        if not name or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise ValueError(f"PD_API_KEYS entry {entry[:12]!r}...: expected name:<64 hex digits of sha256(key)>")
        keys[digest.lower()] = name
    return keys


class KeyCheck:
    def __init__(self, spec: str):
        self.keys = parse_entries(spec)

    @property
    def open(self) -> bool:
        return not self.keys

    def identify(self, authorization: str | None) -> str | None:
        """The key's name; None when the API is open. Raises 401 for a missing or unknown key."""
        if self.open:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                           code="missing_api_key")
        digest = hash_key(key.strip())
        for known, name in self.keys.items():
            if hmac.compare_digest(known, digest):
                return name
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] != "new" or ":" in argv[1] or "," in argv[1]:
        sys.exit("usage: python -m pdserve.services.gateway.auth new NAME")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    print(f"key (shown once, give it to the client): {key}")
    print(f"config entry (add to PD_API_KEYS, comma-separated): {argv[1]}:{hash_key(key)}")


if __name__ == "__main__":
    main(sys.argv[1:])
