"""Benchmark processes that never outlive their benchmark, and report their failures.

A child runs `call(fn, args, result_q)`: `fn`'s result, or its failure as a string, goes on
the queue (`outcome` raises the latter in the parent), and what the child starts (a
nats-server, processes of its own) shares its process group. `children(...)` starts
processes and, whatever happens, kills what is still alive when its block ends — the group
where the child made one.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal


def call(fn, args, result_q) -> None:
    os.setpgrp()  # what it starts goes with it if it is killed
    try:
        result_q.put(fn(*args))
    except BaseException as e:  # noqa: BLE001 - reported by the caller
        result_q.put(f"{type(e).__name__}: {e}")


def in_process(fn, *args, timeout_s: float):
    """`fn(*args)` in a fresh process (UCX is bound to the first event loop of a process)."""
    ctx = mp.get_context("spawn")
    result_q = ctx.Queue()
    with children(ctx.Process(target=call, args=(fn, args, result_q))):
        return outcome(result_q.get(timeout=timeout_s))


@contextlib.contextmanager
def children(*procs):
    """Start `procs`; whatever happens, none outlives the block."""
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # its group, where it made one (`call`)
                except (ProcessLookupError, PermissionError):
                    p.kill()
                p.join(10)


def outcome(result):
    """A child's result, or its failure (a string) raised here."""
    if isinstance(result, str):
        raise RuntimeError(result)
    return result
