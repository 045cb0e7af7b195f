"""The core of the state (pdserve/shared/state/): one Redis connection that every subject shares, its
Lua scripts registered once per source, and commands sent a round trip at a time.

The subjects (registry, requests, routes, sessions) and the modules that own keys of their own
(the prefix index, the gateway's id claims and limits) reach Redis through `script`,
`pipelined` and `call`; `r`, the client itself, is for pdserve/shared/state/ and the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError


class Store:
    def __init__(self, r: aioredis.Redis | RedisCluster):
        self.r = r
        self._scripts: dict[str, AsyncScript] = {}

    def script(self, source: str) -> AsyncScript:
        """A Lua script of this store (one object per source: its sha is computed once)."""
        if source not in self._scripts:
            self._scripts[source] = self.r.register_script(source)
        return self._scripts[source]

    async def pipelined(self, build: Callable[[Pipeline], object], transaction: bool = False) -> list:
        """One round trip: `build(pipeline)` queues commands (scripts by `evalsha` of
        `script(...).sha`); a Redis that lost the scripts (restarted) gets them again, once."""
        for again in (False, True):
            async with self.r.pipeline(transaction=transaction) as p:
                build(p)
                try:
                    return await p.execute()
                except NoScriptError:
                    if again:
                        raise
            for script in list(self._scripts.values()):  # others may register scripts meanwhile
                await self.r.script_load(script.script)
        raise AssertionError("unreachable")

    async def call(self, build: Callable[[Pipeline], object]) -> Any:
        """The answer to the one command `build(pipeline)` queues."""
        return (await self.pipelined(build))[0]

    async def close(self) -> None:
        await self.r.aclose()
        sentinels = getattr(getattr(self.r, "connection_pool", None), "sentinel_manager", None)  # (redis+sentinel://)
        if sentinels is not None:
            await sentinels.aclose()
