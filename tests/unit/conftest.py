"""Real servers for the unit tests that talk to them: redis-server and nats-server (JetStream),
from the pip-installed binaries, on free ports, one per test module."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time

import pytest

from deploy.local.stack import _binary, free_port


def _wait_for_port(port: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


@pytest.fixture(scope="module")
def redis_url():
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL)
        _wait_for_port(port)
        yield f"redis://127.0.0.1:{port}/0"
        proc.terminate()
        proc.wait()


@pytest.fixture(scope="module")
def nats_url():
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", d],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_port(port)
        yield f"nats://127.0.0.1:{port}"
        proc.terminate()
        proc.wait()
