"""A request's id: the client's own `x-request-id` when it sends one, else a new one; and the
ids of its parts (a completions batch's prompts, each prompt's `n` choices), each a request of
its own through the system.

An id names NATS subjects, Redis keys, the timeline and the spans, so it is unique over the
day a request's record is kept (state.REQUEST_TTL_S): a client's id is claimed in Redis with
every id derived from it before it is used; one that a request already holds (in flight, or
finished within the day, or a part of another) is kept as a prefix, `<id>-r<8 hex>`, and the
response's `x-request-id` says which. New ids are 32 hex digits, unique without a claim."""

from __future__ import annotations

import re
import secrets
import uuid

from redis.exceptions import RedisError

from shared.state import REQUEST_TTL_S, Store, request_key

CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # (NATS subject tokens take no '.', '*', '>' or space)
CLIENT_ID_RULE = "1 to 64 characters from A-Z, a-z, 0-9, '_' and '-'"

# every key free, then each taken (one round trip, atomic)
_CLAIM = """
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then return 0 end
end
for _, key in ipairs(KEYS) do
  redis.call('HSET', key, 'claimed', ARGV[1])
  redis.call('EXPIRE', key, ARGV[2])
end
return 1
"""


def new() -> str:
    return uuid.uuid4().hex


def prompt_id(request_id: str, prompts: int, j: int) -> str:
    """Prompt j's request in a completions batch of `prompts` (one prompt: the request itself)."""
    return request_id if prompts == 1 else f"{request_id}-p{j}"


def choice_id(prompt: str, index: int) -> str:
    """Choice `index` of a prompt's request (choice 0 is that request)."""
    return prompt if index == 0 else f"{prompt}-{index}"


def parts(request_id: str, prompts: int, n: int) -> list[str]:
    """Every id a request of `prompts` prompts and `n` choices each goes by."""
    return [request_id] + [choice_id(prompt_id(request_id, prompts, j), i)
                           for j in range(prompts) for i in range(n) if (prompts, i) != (1, 0)]


async def settle(state: Store, wanted: str, prompts: int, n: int, owner: str) -> str:
    """The request's id: `wanted` (the client's) when it and its parts are free, else
    `wanted` with a suffix that is (Redis away: a suffix unclaimed, 32 random bits)."""
    for rid in (wanted, suffixed(wanted)):
        try:
            keys = [request_key(i) for i in parts(rid, prompts, n)]
            if await state.script(_CLAIM)(keys=keys, args=[owner, REQUEST_TTL_S]):
                return rid
        except RedisError:
            break
    return suffixed(wanted)


def suffixed(wanted: str) -> str:
    return f"{wanted}-r{secrets.token_hex(4)}"
