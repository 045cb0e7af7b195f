"""What a local stack is made of (pdserve/local/stack.py starts it): its pools, its servers' shape
and ports, the model, and where each process runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.local.servers import free_port


@dataclass(frozen=True)
class Host:
    """A host of the stack other than this machine's loopback: a network namespace (made by
    the caller, e.g. tests/stack/test_hosts.py) and its address."""
    netns: str
    ip: str


@dataclass
class StackConfig:
    prefill: int = 1
    decode: int = 1
    routers: int = 1                   # replicas sharing the route requests (a NATS queue group)
    colocated: bool = False            # no prefill pool: decode workers prefill locally
    ha: bool = False                   # NATS cluster of 3, Redis primary + replica + 3 Sentinels (pdserve/local/ha.py)
    redis_cluster: int = 0             # Redis as a Redis Cluster of this many primaries (redis_cluster.py here)
    gateway_port: int = 8000
    nats_port: int = 4222
    redis_port: int = 6379
    model: str = "smollm2"
    kv_blocks: int = 2048
    prefill_kv_blocks: int = 0         # KV pool of prefill workers (0: kv_blocks)
    threads: int = 0                   # torch threads per worker (0: cores / workers)
    log_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    worker_env: dict[str, dict[str, str]] = field(default_factory=dict)  # by process name, on top of env
    cpus: dict[str, set[int]] = field(default_factory=dict)  # by process name: CPU affinity (benchmark arms)
    hosts: dict[str, Host] = field(default_factory=dict)     # by process name: where it runs (else 127.0.0.1)
    tls: bool = False                  # NATS on mutual TLS, certificates made at start (pdserve/local/certificates.py)
    issuer: bool = False               # instances let in by the identity issuer, as compose and Kubernetes run them
    lend_cores: bool = True            # prefill workers' threads lent to a decode worker between passes (cores.py)

    @classmethod
    def on_free_ports(cls, **kw: Any) -> StackConfig:
        return cls(gateway_port=free_port(), nats_port=free_port(), redis_port=free_port(), **kw)
