"""Placement policy: pure functions of plain numbers (no I/O), replaced wholesale by richer ones.

Today: least-loaded choice on both sides; prompts below a length threshold, or any prompt
when no prefill worker is up, are prefilled on the decode worker itself.
"""

from __future__ import annotations

from typing import Literal

from shared.messages import WorkerInfo

Mode = Literal["remote", "local"]


def prefill_mode(prompt_tokens: int, prefill_workers: int, local_below: int) -> tuple[Mode, str]:
    """Where the prompt is prefilled, and why."""
    if prefill_workers == 0:
        return "local", "no prefill worker available"
    if prompt_tokens < local_below:
        return "local", f"prompt of {prompt_tokens} tokens is below the local-prefill threshold {local_below}"
    return "remote", "prefill pool"


def decode_candidates(workers: list[WorkerInfo], blocks_needed: int) -> list[WorkerInfo]:
    """Decode workers that have room for the prompt, least loaded first."""
    fit = [w for w in workers if w.free_blocks >= blocks_needed]
    return sorted(fit, key=lambda w: (w.running + w.waiting, -w.free_blocks, w.worker_id))


def choose_prefill(workers: list[WorkerInfo], fingerprint: str) -> WorkerInfo | None:
    """The least busy prefill worker whose KV the decode worker can take (same fingerprint)."""
    same = [w for w in workers if w.fingerprint == fingerprint]
    return min(same, key=lambda w: (w.running + w.waiting, w.worker_id), default=None)
