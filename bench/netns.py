"""Hosts on one machine: network namespaces joined by a veth pair for the transfer bench
(as tests/stack/test_netns.py does), so TCP crosses a network device with its MTU instead of
loopback, or several linked to one bridge, a switch (`bridged()`, the multi-host stack test).
Needs root and `ip netns`; both raise NoNetns with the reason otherwise.

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
from dataclasses import dataclass

from pdserve.local.config import Host

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


SUBNETS = [f"10.231.{n}" for n in range(80, 120)]  # bridged(): the first one free; the switch .1, the hosts .10 on
DEVICE = "eth0"        # bridged(): each host's end of its link, as named inside its namespace


@dataclass(frozen=True)
class Link:
    """A host of bridged(): its network namespace, its address, and its link's end on the
    switch (set it down to cut the host off, as a pulled cable or a failed switch port)."""
    netns: str
    ip: str
    port: str


@contextlib.contextmanager
def bridged(names: list[str]):
    """One network namespace per name, each linked to a bridge in this namespace (the switch,
    address <subnet>.1, the first of SUBNETS no interface here is on: another run's bridge, or
    one left by a run killed before its cleanup, keeps its own) by a veth pair; yields a Link
    per name, all removed after."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        raise NoNetns("network namespaces need root and iproute2")
    tag, subnet = uuid.uuid4().hex[:5], free_subnet()
    bridge, made, links = f"pdbr{tag}", [], {}
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made.append(("link", bridge))
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, name in enumerate(names):
            ns, port, end = f"pdh{tag}{i}", f"pds{tag}{i}", f"pdt{tag}{i}"
            _ip("netns", "add", ns)
            made.append(("netns", ns))
            _ip("link", "add", port, "type", "veth", "peer", "name", end)
            _ip("link", "set", end, "netns", ns)
            _ip("link", "set", port, "master", bridge, "up")
            _ip("link", "set", end, "name", DEVICE, ns=ns)
            _ip("addr", "add", f"{subnet}.{10 + i}/24", "dev", DEVICE, ns=ns)
            _ip("link", "set", DEVICE, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            links[name] = Link(ns, f"{subnet}.{10 + i}", port)
        yield links
    finally:
        for kind, what in reversed(made):  # a namespace's removal takes its link's ends with it
            subprocess.run(["ip", "netns", "del", what] if kind == "netns" else ["ip", "link", "del", what],
                           capture_output=True)


def free_subnet() -> str:
    """The first of SUBNETS that no interface of this namespace is on."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    taken = {f.split("/")[0].rsplit(".", 1)[0] for line in out.splitlines() for f in line.split() if f.count(".") == 3}
    free = [s for s in SUBNETS if s not in taken]
    if not free:
        raise NoNetns(f"every subnet of {SUBNETS[0]}.0-{SUBNETS[-1]}.0 is on an interface here")
    return free[0]


# a worker on another host shares no memory with its peers: UCX over TCP on its host's link only
APART = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": DEVICE}
HUB = ("nats", "redis", "router", "gateway")   # the processes of the stack's first host


def placement(links: dict[str, Link], workers: dict[str, str], hub: str = "hub"
              ) -> tuple[dict[str, Host], dict[str, dict[str, str]]]:
    """StackConfig.hosts and .worker_env for bridged() hosts: NATS, Redis, the router and the
    gateway on `hub`, each worker on its host (`workers`: worker name -> host name), APART."""
    on = {name: Host(links[host].netns, links[host].ip) for name, host in
          {**dict.fromkeys(HUB, hub), **workers}.items()}
    return on, {w: dict(APART) for w in workers}


def set_link(link: Link, up: bool) -> None:
    """Cut a host off the switch, or join it again."""
    _ip("link", "set", link.port, "up" if up else "down")


def rx_bytes(link: Link) -> int:
    """Bytes the host has received over its link."""
    out = subprocess.run(["ip", "netns", "exec", link.netns, "cat", f"/sys/class/net/{DEVICE}/statistics/rx_bytes"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


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
