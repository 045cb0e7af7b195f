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

# a request's record taken when there is none (one key: the ids' records hash to several slots of a
# Redis Cluster, shared/state/keys.py)
_TAKE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'claimed', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
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
            if await claim(state, [request_key(i) for i in parts(rid, prompts, n)], owner):
                return rid
        except RedisError:
            break
    return suffixed(wanted)


async def claim(state: Store, keys: list[str], owner: str) -> bool:
    """All of `keys` taken, or none: each taken where free, on one round trip; when one was not,
    those this call took are let go on a second (two requests after overlapping ids may then both
    go without: each takes a suffixed id)."""
    sha = state.script(_TAKE).sha
    took = await state.pipelined(lambda p: [p.evalsha(sha, 1, key, owner, REQUEST_TTL_S) for key in keys])
    if all(took):
        return True
    mine = [key for key, t in zip(keys, took) if t]
    if mine:
        await state.pipelined(lambda p: [p.delete(key) for key in mine])
    return False


def suffixed(wanted: str) -> str:
    return f"{wanted}-r{secrets.token_hex(4)}"
