"""The registry as a placement needs it: per model, its prefill and decode workers and who
holds which prefix-index slot — made once per registry read, not once per placement (a
placement's own work then follows the prompt and the workers holding it, not the fleet)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared import prefix_index
from shared.messages import WorkerInfo


@dataclass(frozen=True)
class Pool:
    workers: list[WorkerInfo] = field(default_factory=list)
    prefills: list[WorkerInfo] = field(default_factory=list)
    decodes: list[WorkerInfo] = field(default_factory=list)
    slots: dict[int, WorkerInfo] = field(default_factory=dict)   # prefix-index slot -> its worker

    @property
    def block_size(self) -> int:
        return self.workers[0].block_size if self.workers else 16


EMPTY = Pool()


def pools(workers: list[WorkerInfo]) -> dict[str, Pool]:
    """The workers of each model served."""
    by_model: dict[str, list[WorkerInfo]] = {}
    for w in workers:
        by_model.setdefault(w.model, []).append(w)
    return {model: Pool(ws, [w for w in ws if w.role == "prefill"], [w for w in ws if w.role == "decode"],
                        prefix_index.by_slot(ws)) for model, ws in by_model.items()}
