"""The step-time objective: a pass that computes prompt tokens beside running streams takes about
`target_s` (`PD_PASS_TARGET_MS`), its prompt tokens chosen from what this worker's passes have taken.

Every pass's time is observed: a decode-only pass's is a moving average, and a mixed or prefill
pass's time beyond it, per prompt token, another. A mixed pass then takes at most
(target - decode pass) / prompt token's time prompt tokens, and never fewer than `floor` (a
prompt moves on however slow the worker). A short prompt placed on a decode worker, or a long
one on a colocated worker, is so prefilled in chunks that keep its running streams' gaps near
the target, as llama-server's micro-batches do, the chunk following the worker's measured
speed instead of a fixed size; with no stream running, a prompt takes the whole budget.
Until both times are measured the pass is not bounded.
"""

from __future__ import annotations

WEIGHT = 0.2  # a pass's weight in the moving averages (about its last 5)


class PassTimes:
    """A worker's measured pass times, and the prompt tokens that fit its target beside running streams."""

    def __init__(self, target_s: float, floor: int):
        self.target_s, self.floor = target_s, floor
        self.decode_s: float | None = None  # a decode-only pass
        self.token_s: float | None = None   # a prompt token, beyond the decode pass it shares

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens == 0:
            if decode_rows:
                self.decode_s = _average(self.decode_s, seconds)
            return
        beside = 0.0 if not decode_rows else self.decode_s
        if beside is not None:
            self.token_s = _average(self.token_s, max(0.0, seconds - beside) / prompt_tokens)

    def prompt_budget(self, decode_rows: int) -> int | None:
        """Prompt tokens for a pass beside `decode_rows` running rows; None: no bound (nothing
        runs beside the prompt, or the times are not measured yet)."""
        if not decode_rows or self.decode_s is None or not self.token_s:
            return None
        return max(self.floor, int((self.target_s - self.decode_s) / self.token_s))


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)
