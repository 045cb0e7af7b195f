"""Next-token choice for a batch: penalties and biases, then greedy or temperature, min-p,
top-k, top-p, with per-request seeds; each chosen token's log probabilities when asked.

A seeded request draws token n from a generator seeded with H(seed, n), and every logit
change reads only the sequence's own tokens (prompt and output so far), so the same seed
gives the same tokens whether the first token was sampled on a prefill engine and the rest
on a decode engine, all in one place, or after a failover resumed the request elsewhere.

Order, as vLLM's: logit_bias and the min_tokens ban, then the penalties (repetition over
prompt and output, frequency and presence over the output), then the grammar's mask
(structured output: tokens that would leave it are never chosen), then greedy or
temperature, min-p, top-k, top-p and the draw. On CUDA the draw is seeded_draw.py's (keyed noise, no
generator); device_sampler.py chooses a plain batch's tokens there without leaving the device.
"""

from __future__ import annotations

import logging

import torch
import xxhash

from pdserve.shared.engine.grammar import mask_rows
from pdserve.shared.engine.logprobs import Logprob, logprobs_of
from pdserve.shared.engine.seeded_draw import Rows
from pdserve.shared.engine.seeded_draw import sample as draw
from pdserve.shared.engine.sequence import Sequence

log = logging.getLogger(__name__)


def step_seed(seed: int, index: int) -> int:
    return xxhash.xxh64_intdigest(f"{seed}:{index}".encode()) & 0x7FFF_FFFF_FFFF_FFFF


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...],
           ahead: list[int] | None = None) -> tuple[list[int], list[Logprob | None]]:
    """logits (B, vocab) fp32, one row per sequence in `seqs` order (changed in place); `ahead`: per row,
    how many tokens past its sequence's next one it chooses (a draft's rows, speculative.py: its seed index).
    Returns B token ids, and each one's Logprob where its sequence asks for them."""
    if all(plain_greedy(seq) for seq in seqs):  # one argmax, one copy to the host
        return logits.argmax(dim=-1).tolist(), [None] * len(seqs)
    raw = {row: logits[row].clone() for row, seq in enumerate(seqs) if seq.params.logprobs is not None}
    for row, seq in enumerate(seqs):
        adjust(logits[row], seq, eos_ids)
    matchers = {row: seq.matcher for row, seq in enumerate(seqs) if seq.matcher is not None}
    if matchers:
        mask_rows(logits, matchers)
    out = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        if not seq.params.greedy:
            try:
                out[row] = _sample_row(logits[row], seq, ahead[row] if ahead else 0)
            except RuntimeError as e:  # numerically degenerate parameters: this row, not the batch
                log.warning("%s: sampling failed (%s); took the most likely token", seq.request_id, e)
    lps: list[Logprob | None] = [None] * len(seqs)
    for row, logit in raw.items():
        lps[row] = logprobs_of(logit[None], [out[row]], seqs[row].params.logprobs or 0)[0]
    return out, lps


def plain(seq: Sequence) -> bool:
    """Whether the sequence's token is chosen from its row's logits as the model gave them, with nothing but
    temperature, min-p, top-k and top-p between (no logit change, no grammar, no log probabilities, no
    min_tokens ban)."""
    p = seq.params
    return not p.penalized and seq.matcher is None and p.logprobs is None and seq.num_generated >= p.min_tokens


def plain_greedy(seq: Sequence) -> bool:
    """Whether the sequence's token is its row's argmax as the model gave it."""
    return seq.params.greedy and plain(seq)


def adjust(logits: torch.Tensor, seq: Sequence, eos_ids: tuple[int, ...]) -> None:
    """The logit changes a sequence's settings ask for, in place on its row (vocab,). Every
    tensor made here is made on the row's device, in its dtype (a CPU tensor added to CUDA
    logits raises)."""
    p, dev = seq.params, logits.device
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        logits[torch.tensor(ids, dtype=torch.long, device=dev)] += torch.tensor(bias, dtype=logits.dtype, device=dev)
    if seq.num_generated < p.min_tokens:  # not allowed to stop yet
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
        if banned:
            logits[torch.tensor(banned, dtype=torch.long, device=dev)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(seq.token_ids, dtype=torch.long, device=dev)  # (repeats rewrite the same value)
        scores = logits[seen]
        logits[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_generated:
        out = torch.tensor(seq.token_ids[seq.num_prompt:], dtype=torch.long, device=dev)
        counts = torch.zeros(logits.numel(), dtype=torch.long, device=dev).index_add_(0, out, torch.ones_like(out))
        logits -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty * (counts > 0).to(logits.dtype)


def _sample_row(logits: torch.Tensor, seq: Sequence, ahead: int = 0) -> int:
    p = seq.params
    if logits.is_cuda:  # the batched path's filters and keyed draw (device_sampler.py): a seed's tokens on CUDA
        rows = Rows.of([p.temperature], [p.top_k], [p.top_p], [p.min_p],  # whichever path a step takes
                       [step_seed(seq.seed, seq.num_generated + ahead)], logits.device)
        return int(draw(logits[None], rows)[0])
    logits = logits / p.temperature
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    gen = torch.Generator(device=logits.device)
    gen.manual_seed(step_seed(seq.seed, seq.num_generated + ahead))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=gen).item())
