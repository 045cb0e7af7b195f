"""Cores for `make bench-scale`: the router replicas under test on one half of the machine,
everything else (redis-server, nats-server, the simulated fleet, the driver and its span
receiver) on the other. In a deployment the router has its own cores and the workers are
other hosts; on one box the simulator of 256 workers would otherwise take its CPU from the
router, and the growth with W would be partly the simulator's."""

from __future__ import annotations

import os

UNDER_TEST = ("router",)                  # process names (a prefix) pinned to the first half
CORES = sorted(os.sched_getaffinity(0))   # as this process started (it pins itself too)


def split(cores: list[int]) -> tuple[set[int], set[int]] | None:
    """(under test, the rest): the first half of the cores and the others; None with one."""
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def under_test() -> set[int] | None:
    """The cores the router replicas are pinned to (None on one core: nothing pinned)."""
    halves = split(CORES)
    return halves[0] if halves else None


def pin(pids: dict[str, int]) -> dict[str, list[int]]:
    """Every thread of each process onto its half (threads started later inherit it); returns
    the cores by process name ({} on one core: nothing pinned)."""
    halves = split(CORES)
    if halves is None:
        return {}
    placed = {}
    for name, pid in pids.items():
        cpus = halves[0] if name.startswith(UNDER_TEST) else halves[1]
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), cpus)
        except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
            continue
        placed[name] = sorted(cpus)
    return placed
