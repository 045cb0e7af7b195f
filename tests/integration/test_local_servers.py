"""Starting local servers survives a port another process takes in between: the Redis Cluster's
start draws new ports when a node exits before it listens (pdserve/local/redis_cluster.py)."""

from __future__ import annotations

import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from pdserve.local import redis_cluster
from pdserve.local.servers import valkey_server, wait_for_port


def test_a_node_whose_port_is_taken_costs_a_try_not_the_cluster(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))   # (bound, not listening: the node's bind fails, and nothing answers there)
    drawn = iter([taken.getsockname()[1]])
    real = redis_cluster.free_node_port
    monkeypatch.setattr(redis_cluster, "free_node_port", lambda: next(drawn, None) or real())
    procs: list[subprocess.Popen] = []

    def spawn(argv: list[str]) -> subprocess.Popen:
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
        return procs[-1]

    try:
        with tempfile.TemporaryDirectory() as d:
            url = redis_cluster.start(Path(d), 3, spawn)
        assert str(taken.getsockname()[1]) not in url
        assert len(procs) == 6 and sum(p.poll() is None for p in procs) == 3
    finally:
        taken.close()
        for p in procs:
            p.terminate()
            p.wait()


def test_waiting_for_a_server_that_exited_fails_at_once_with_its_exit_code():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    proc = subprocess.Popen([valkey_server(), "--port", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL)
    try:
        with pytest.raises(RuntimeError, match="exited with 1"):
            wait_for_port(port, timeout_s=20, proc=proc)
    finally:
        taken.close()
        proc.kill()
        proc.wait()
