"""Log probabilities of tokens, from the model's own distribution.

They are read from the raw logits of the pass that chose the token (before penalties,
biases, temperature or truncation: vLLM's default `raw_logprobs`), so they say how likely the
model found each token, whatever the sampling settings; the same position gives the same
figure on a prefill worker or a decode worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # (imported where used: the messages, and so the router, take Logprob without torch)
    import torch

MAX_TOP = 20  # alternatives per token at most (OpenAI's top_logprobs limit)


class Logprob(NamedTuple):
    """One token's log probability and the `top` most likely tokens at its position (id,
    log probability), most likely first. A NamedTuple: it crosses the bus as a short list."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def logprobs_of(logits: torch.Tensor, tokens: list[int], top: int) -> list[Logprob]:
    """logits (n, vocab), one row scoring each of `tokens`; `top` alternatives each."""
    import torch
    with torch.inference_mode():
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
        if top > 0:
            values, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
            alts = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            alts = [[] for _ in tokens]
    return [Logprob(t, c, a) for t, c, a in zip(tokens, chosen, alts)]
