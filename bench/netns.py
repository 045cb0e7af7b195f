"""Two hosts on one machine for the transfer bench: network namespaces joined by a veth pair
(as tests/stack/test_netns.py does), so TCP crosses a network device with its MTU instead of
loopback. Needs root and `ip netns`; `veth_pair()` raises NoNetns with the reason otherwise.

A process enters a namespace with `enter(name)`: setns(2), then, as `ip netns exec` does, a
mount namespace of its own with /sys mounted afresh, where UCX looks for network devices (a
child, before it opens any socket or UCX context). `inside(name)` enters for a block of the
calling thread and comes back (a socket keeps the namespace it was made in).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import uuid

A_IP, B_IP = "10.231.78.1", "10.231.78.2"
CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2


class NoNetns(RuntimeError):
    pass


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NoNetns(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextlib.contextmanager
def veth_pair(mtu: int = 1500):
    """Namespaces (a, b) joined by a veth pair with addresses A_IP and B_IP, removed after; each
    end of the pair is named as its namespace."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        raise NoNetns("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    a, b = va, vb = f"pdbA{tag}", f"pdbB{tag}"
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, A_IP), (b, vb, B_IP)):
            _ip("addr", "add", f"{addr}/24", "dev", dev, ns=ns)
            _ip("link", "set", dev, "mtu", str(mtu), "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        yield a, b
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what} failed")


def _setns(fd: int) -> None:
    _check(libc.setns(fd, CLONE_NEWNET), "setns")


def enter(name: str) -> None:
    with open(f"/var/run/netns/{name}") as f:
        _setns(f.fileno())
    _check(libc.unshare(CLONE_NEWNS), "unshare")
    _check(libc.mount(b"", b"/", None, MS_SLAVE | MS_REC, None), "mount --make-rslave /")
    _check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    _check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


@contextlib.contextmanager
def inside(name: str):
    with open("/proc/thread-self/ns/net") as home, open(f"/var/run/netns/{name}") as there:
        _setns(there.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())
