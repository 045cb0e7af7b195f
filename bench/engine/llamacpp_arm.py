"""llama.cpp (llama-cpp-python, built from PyPI by `make bench-engine`) on the same GGUF and
threads, as a side-by-side peer: prompt tokens/s of one prompt in one pass, and the time of one
decode step at batch 1 after a prompt. None where it is not installed."""

from __future__ import annotations

import time

import torch


class LlamaCpp:
    def __init__(self, path: str, threads: int, context: int = 4096, logits_all: bool = False):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         n_batch=2048, n_ubatch=2048, logits_all=logits_all, verbose=False)

    @classmethod
    def available(cls) -> bool:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            return False
        return True

    def prefill(self, tokens: list[int]) -> float:
        """Seconds to take one prompt in (its KV from an empty cache: `reset` drops the last's)."""
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(tokens)
        return time.perf_counter() - start

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Next-token logits (n, vocab) at every position of one pass (built with logits_all)."""
        self.llm.reset()
        self.llm.eval(tokens)
        return torch.from_numpy(self.llm.scores[:len(tokens)].copy())

    def decode(self, prompt: list[int], steps: int) -> float:
        """Seconds per decode step of one sequence after `prompt`."""
        self.prefill(prompt)
        start = time.perf_counter()
        for _ in range(steps):
            self.llm.eval(prompt[-1:])
        return (time.perf_counter() - start) / steps
