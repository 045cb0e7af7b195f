"""A request's token chunks are authenticated: each placement of a request has a secret (the
gateway makes a fresh one per placement, `RouteRequest.secret`) that only the workers it is
placed on are told (in the admit, and the prefill job the decode worker queues). A chunk
travels with a keyed BLAKE2b MAC of its exact bytes in the `Pd-Mac` header; the gateway takes
a chunk only when one of its request's placements' secrets verifies it and the chunk names
that placement's attempt. So a worker can write only into the streams of the requests it was
placed for, and a chunk another process made up, or one of a placement the request has left,
is dropped (and counted: `pd_forged_chunks`, `pd_stale_chunks`). A replayed chunk of the
current placement verifies but is a duplicate `seq`: the gateway's ordering drops it.

The KV handoff's messages between the placement's two workers (KVLayer and KVEnd one way,
KVAck, KVResend and KVSync the other) carry a MAC with the same secret: a message of a
handoff that the secret does not verify is dropped and counted (`pd_forged_messages`), so
no other process can fail, end or steer a handoff. So do cancels: the gateway signs its cancels
with the secrets of the placements each worker holds, a prefill worker the cancel of a request
that finished in prefill; the supervisor's cancels go on subjects only routers may publish to
(pdserve/shared/holders.py). (The decode side answers a notice for a
request it holds no receiver of, and so no secret, unsigned: the sender drops that answer
and its lease ends the handoff.)
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from nats.aio.msg import Msg

from pdserve.shared import metrics
from pdserve.shared.messages import TokenChunk

HEADER = "Pd-Mac"


def new_secret() -> str:
    """A placement's secret: 128 random bits, hex."""
    return secrets.token_hex(16)


def mac(secret: str, data: bytes) -> str:
    """BLAKE2b keyed with `secret` over `data` (a MAC by construction: no HMAC wrapper needed)."""
    return hashlib.blake2b(data, key=bytes.fromhex(secret), digest_size=16).hexdigest()


def valid(secret: str, data: bytes, given: str) -> bool:
    return bool(secret) and bool(given) and hmac.compare_digest(mac(secret, data), given)


def signed_with(secret: str, msg: Msg) -> bool:
    """Whether a message received carries the MAC `secret` gives its bytes (a KV handoff's
    messages and a placement's cancels are signed with its secret); one that does not is counted."""
    if valid(secret, msg.data, (msg.headers or {}).get(HEADER, "")):
        return True
    metrics.FORGED_MESSAGES.inc()   # (counted, not logged: a flood of them would flood the log)
    return False


@dataclass(frozen=True)
class Signed:
    """A chunk as it goes on the bus: its bytes and their MAC."""

    data: bytes
    mac: str


def sign(chunk: TokenChunk, secret: str) -> Signed:
    data = chunk.encode()
    return Signed(data, mac(secret, data))


def opened(rid: str, secrets_by_attempt: Mapping[int, str], data: bytes, given: str) -> TokenChunk | None:
    """The chunk, when the secret of one of request `rid`'s placements verifies it and it names
    that placement's attempt and that request; None: forged (made without the secret, or moved
    from another request or placement)."""
    for attempt, secret in secrets_by_attempt.items():
        if valid(secret, data, given):
            chunk = TokenChunk.decode(data)
            return chunk if chunk.attempt == attempt and chunk.request_id == rid else None
    return None
