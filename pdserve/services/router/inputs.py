"""What a placement reads, gathered in one place: the model's pool as the router last read the
registry (pools.py), the workers holding the prompt's leading blocks (indexes.py) and the
conversation's worker (Redis), in one round trip at most (none: the prefix index in memory and
no conversation). The engine always computes the last prompt token: only the blocks before it
can hit (a failover's prompt is the prompt and the tokens streamed before it)."""

from __future__ import annotations

from pdserve.services.router.indexes import PrefixIndex
from pdserve.services.router.placement import Ask, Fleet
from pdserve.services.router.pools import Pools
from pdserve.shared.hashing import block_hashes
from pdserve.shared.messages import Requeue, RouteRequest, WorkerInfo
from pdserve.shared.state import session_key


def leading_hashes(prompt: list[int], generated: list[int], block_size: int, salt: str) -> list[int]:
    """The hashes of the blocks a prefix cache can hit: all but the last token's (it is always computed)."""
    return block_hashes([*prompt, *generated][:-1], block_size, salt)


class Inputs:
    def __init__(self, pools: Pools, index: PrefixIndex):
        self.pools, self.index = pools, index

    async def of_route(self, req: RouteRequest) -> tuple[Ask, Fleet[WorkerInfo]]:
        """A new request (or a failover): the pool's live workers, the prefix held, the conversation's worker."""
        pool = await self.pools.pool(req.model)
        hashes = leading_hashes(req.prompt_token_ids, req.generated_token_ids, pool.block_size, req.sampling.cache_salt)
        session = session_key(req.session_id) if req.session_id else None
        held, answers = await self.index.holding(pool, hashes, (lambda p: p.get(session)) if session else None)
        worker = answers[0].decode() if session and answers[0] else None
        return Ask.of(req, worker), Fleet(pool.decodes, pool.prefills, pool.block_size, held)

    async def of_requeue(self, req: Requeue) -> tuple[Ask, Fleet[WorkerInfo]] | None:
        """A prompt to prefill again for the decode worker that admitted it (registered, draining
        or not), among the prefill workers it did not come from (None: that worker is gone)."""
        pool = await self.pools.pool(req.model)
        decode = self.pools.entry(req.decode_worker)
        if decode is None:
            return None
        hashes = leading_hashes(req.prompt_token_ids, req.generated_token_ids, pool.block_size, req.cache_salt)
        held, _ = await self.index.holding(pool, hashes)
        others = [p for p in pool.prefills if p.worker_id not in req.avoid_workers]
        ask = Ask(len(req.prompt_token_ids), 0, len(req.generated_token_ids), req.attempt, bound_to=decode.worker_id)
        return ask, Fleet([decode], others, pool.block_size, held)
