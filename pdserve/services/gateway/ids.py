"""A request's id, and the ids of its parts (a completions batch's prompts, each prompt's `n`
choices), each a request of its own through the system.

An id names NATS subjects, Redis keys, the timeline and the spans, so it is the server's: 32 hex
digits from a uuid4, unique without a claim and guessed by no one. A client's own id
(`x-client-request-id`, or `x-request-id` as proxies send it) names nothing inside: it is the
request span's `client_request_id` attribute and comes back in the response's
`x-client-request-id` header, so no client can take another's subjects, or learn whether an id
is in use."""

from __future__ import annotations

import re
import uuid
from typing import NamedTuple

CLIENT_ID = re.compile(r"[!-~]{1,128}")  # (it goes back in a header: no space, no control character)
CLIENT_ID_RULE = "1 to 128 visible ASCII characters (no spaces)"
CLIENT_HEADERS = ("x-client-request-id", "x-request-id")  # (the first one sent is the client's)


def new() -> str:
    return uuid.uuid4().hex


class ClientId(NamedTuple):
    value: str
    header: str  # (the one that carried it)

    @property
    def valid(self) -> bool:
        return CLIENT_ID.fullmatch(self.value) is not None


def client_id(headers: dict[str, str]) -> ClientId | None:
    """The client's own id (None: it sent none, or an empty one)."""
    return next((ClientId(headers[h], h) for h in CLIENT_HEADERS if headers.get(h)), None)


def attributes(client: ClientId | None) -> dict[str, str]:
    """The request span's: the client's id when it sent a valid one."""
    return {"client_request_id": client.value} if client and client.valid else {}


def echoed(client: ClientId | None) -> list[tuple[bytes, bytes]]:
    """The response's headers that give the client its id back."""
    return [(b"x-client-request-id", client.value.encode())] if client and client.valid else []


def prompt_id(request_id: str, prompts: int, j: int) -> str:
    """Prompt j's request in a completions batch of `prompts` (one prompt: the request itself)."""
    return request_id if prompts == 1 else f"{request_id}-p{j}"


def choice_id(prompt: str, index: int) -> str:
    """Choice `index` of a prompt's request (choice 0 is that request)."""
    return prompt if index == 0 else f"{prompt}-{index}"
