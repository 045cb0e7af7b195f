"""A stack whose start fails part-way leaves no process behind: whatever it had started is
ended before the error reaches the caller (pdserve/local/stack.py, Stack.start)."""

from __future__ import annotations

import psutil
import pytest

from pdserve.local.stack import Stack, StackConfig


def alive_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}


@pytest.mark.parametrize(("model", "timeout_s", "error"), [
    ("smollm2", 1.0, TimeoutError),                         # not ready in time: every process was running
    ("/nonexistent/model.gguf", 120.0, RuntimeError),       # the workers exit: the rest was running
], ids=["ready-timeout", "workers-exit"])
def test_a_failed_start_ends_every_process_it_started(tmp_path, model, timeout_s, error):
    before = alive_children()
    stack = Stack(StackConfig.on_free_ports(model=model, kv_blocks=64, log_dir=tmp_path))
    with pytest.raises(error):
        stack.start(ready_timeout_s=timeout_s)
    assert len(stack.started) >= 6     # nats, redis, streams, router, decode, prefill, gateway
    assert [p.args for p in stack.started if p.poll() is None] == []
    assert alive_children() - before == set()


def test_a_failed_start_in_a_with_block_ends_them_too(tmp_path):
    before = alive_children()
    with pytest.raises(RuntimeError, match="exited during start"), \
            Stack(StackConfig.on_free_ports(model="/nonexistent/model.gguf", kv_blocks=64, log_dir=tmp_path)):
        raise AssertionError("unreachable: the start fails")
    assert alive_children() - before == set()
