"""The whole stack on one machine, no Docker: what `pdserve serve` runs (pdserve/local/serve.py,
`make run`; `python -m pdserve.local.stack` the same).

Starts nats-server (JetStream) and valkey-server (Redis's protocol) from the pip-installed
binaries (`--ha`: a 3-node NATS cluster and a Redis primary + replica under 3 Sentinels,
pdserve/local/ha.py; `--tls`: NATS on mutual TLS), each service instance a NATS and a Redis user
of its own (pdserve/local/identities.py), then the streams' keeper
(pdserve/shared/streams.py), the router, the decode and prefill workers and the gateway as separate
processes; waits until the gateway's /ready says the pools are up. Stopping it stops
everything: each service drains, and every child dies with the launcher even if it is killed
(PR_SET_PDEATHSIG). The tests start the same Stack on free ports.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import redis

from pdserve.local import ha, readiness, redis_cluster
from pdserve.local.certificates import Authority, nats_block, redis_conf, redis_query
from pdserve.local.config import StackConfig
from pdserve.local.identities import Identities, refused
from pdserve.local.servers import (
    STORE_ARGS,
    binary,
    die_with_parent,
    free_port,
    tls_redis_server,
    valkey_server,
    wait_for_port,
)
from pdserve.shared import grants


class Stack:
    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.data = Path(tempfile.mkdtemp(prefix="pdserve-"))
        self.log_dir = cfg.log_dir or self.data / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: list[subprocess.Popen] = []   # every process ever spawned (a restart replaces one in procs)
        self.metrics_ports: dict[str, int] = {}  # every service's: /metrics, /health, /ready
        self.argv: dict[str, tuple[list[str], dict[str, str] | None]] = {}
        # NATS and Redis take passwords made for this run (config files in the private data
        # directory, not on a command line), so nothing else on the host can join the bus; on
        # NATS each service instance is a user of its own, with its grant (pdserve/local/identities.py)
        self.secret = secrets.token_urlsafe(24)
        self.sentinel_secret = secrets.token_urlsafe(24)  # (HA: the services' key to the Sentinels)
        self.ids = Identities.made(self.instances(), issuer=cfg.issuer)
        self.authority = Authority(self.data / "tls") if cfg.tls else None
        if self.authority:
            server = self.authority.issue("nats", ("127.0.0.1", "localhost", self.ip("nats")))
            self.ids.tls = nats_block(server, self.authority.ca)
        # (Redis on TLS too, one server: the HA set and the Redis Cluster keep plain Redis)
        self.redis_tls = bool(self.authority) and not cfg.ha and not cfg.redis_cluster
        if cfg.ha and cfg.hosts:
            raise ValueError("the HA servers run on this machine's loopback: not with hosts")
        self.ha_ports = ha.Ports.from_first(cfg.nats_port, cfg.redis_port) if cfg.ha else None
        if cfg.redis_cluster and (cfg.ha or cfg.hosts):
            raise ValueError("the Redis Cluster runs on this machine's loopback, without HA")
        if cfg.issuer and (cfg.ha or cfg.redis_cluster):
            raise ValueError("the identity issuer runs here with one NATS server and one Redis")
        # Redis's: one server, or the cluster's primaries
        self.redis_conf = ""   # (more redis.conf lines: start_redis's)
        self.redis_ports = [cfg.redis_port, *(redis_cluster.free_node_port() for _ in range(cfg.redis_cluster - 1))]

    @property
    def url(self) -> str:
        return f"http://{self.ip('gateway')}:{self.cfg.gateway_port}"

    @property
    def nats_url(self) -> str:
        """The operator's: every subject (tools, tests)."""
        return self.nats_url_of(grants.OPERATOR)

    def instances(self) -> dict[str, str]:
        """The service instances this stack starts: id -> role."""
        c = self.cfg
        return {**{("router" if i == 0 else f"router-{i}"): "router" for i in range(c.routers)},
                **{f"decode-{i}": "decode" for i in range(c.decode)},
                **{f"prefill-{i}": "prefill" for i in range(0 if c.colocated else c.prefill)}, "gateway": "gateway"}

    def nats_url_of(self, user: str) -> str:
        """The URL with `user`'s credentials: a service instance's, or the operator's ("": none)."""
        scheme = "tls" if self.authority else "nats"
        if not user:
            return f"{scheme}://{self.ip('nats')}:{self.cfg.nats_port}"
        if self.ha_ports:
            return ha.nats_url(self.ha_ports, user, self.ids.password(user), scheme)
        return f"{scheme}://{user}:{self.ids.password(user)}@{self.ip('nats')}:{self.cfg.nats_port}"

    def tls_env(self, name: str) -> dict[str, str]:
        """With TLS on, where process `name` finds its certificate, key and the CA (pdserve/shared/tls.py)."""
        return self.authority.issue(name).env(self.authority.ca) if self.authority else {}

    @property
    def redis_url(self) -> str:
        """The operator's: Redis's default user (tools, tests)."""
        return self.redis_url_of(grants.OPERATOR)

    def redis_url_of(self, user: str, cert: str = "") -> str:
        """The URL with `user`'s credentials: a service instance's ACL user, the operator's
        (Redis's default user), or none (""); on TLS with the certificate of `cert` (default: the user's)."""
        name, password = ("", self.secret) if user == grants.OPERATOR else (user, self.ids.redis[user].password) \
            if user else ("", "")
        if self.ha_ports:
            return ha.redis_url(self.ha_ports, name, password, self.sentinel_secret)
        if self.cfg.redis_cluster:
            return redis_cluster.url(self.redis_ports, name, password)
        where = f"{f'{name}:{password}@' if user else ''}{self.ip('redis')}:{self.cfg.redis_port}/0"
        if self.authority and self.redis_tls:
            files = self.authority.issue(cert or user or grants.OPERATOR)
            return f"rediss://{where}{redis_query(files, self.authority.ca)}"
        return f"redis://{where}"

    def ip(self, name: str) -> str:
        """The address of the host process `name` runs on."""
        host = self.cfg.hosts.get(name)
        return host.ip if host else "127.0.0.1"

    def service_env(self) -> dict[str, str]:
        c = self.cfg
        workers = (0 if c.colocated else c.prefill) + c.decode
        threads = c.threads or max(1, (os.cpu_count() or 1) // max(1, workers))
        return {**os.environ, "PD_NATS_URL": self.nats_url, "PD_REDIS_URL": self.redis_url, "PD_MODEL": c.model,
                "PD_GATEWAY_HOST": self.ip("gateway"), "PD_GATEWAY_PORT": str(c.gateway_port),
                "PD_ALLOW_OPEN": str("gateway" in c.hosts).lower(),  # (its host's address is not loopback)
                "PD_KV_BLOCKS": str(c.kv_blocks),
                "PD_THREADS": str(threads), "PD_REQUIRE_PREFILL": str(not c.colocated).lower(),
                "PD_STREAM_REPLICAS": str(ha.NODES if c.ha else 1),
                "PD_KV_SEGMENT_SCOPE": self.data.name,   # (this stack's: others may run beside it)
                "PD_CORE_BOARD": str(self.data / "cores") if c.lend_cores and not c.colocated and not c.hosts else "",
                "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONUNBUFFERED": "1", **self.tls_env(grants.OPERATOR), **c.env}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        self.argv[name] = (argv, env)
        if name in self.cfg.hosts:  # on its host: in its network namespace (ip netns exec execs the command)
            argv = ["ip", "netns", "exec", self.cfg.hosts[name].netns, *argv]
        log = open(self.log_dir / f"{name}.log", "ab")
        cpus = self.cfg.cpus.get(name)

        def setup() -> None:
            die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)

        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env or self.service_env(),
                                preexec_fn=setup)
        self.procs[name] = proc
        self.started.append(proc)
        return proc

    def service(self, name: str, module: str, **env: str) -> subprocess.Popen:
        """Process `name` running `module` (services.<role>.main), on NATS and Redis as its own
        user (made now if it is new: the servers are given it)."""
        self.metrics_ports[name] = free_port()
        env = {**env, "PD_METRICS_PORT": str(self.metrics_ports[name]), "PD_METRICS_HOST": self.ip(name)}
        role = module.split(".")[-2]   # pdserve.services.<role>.main
        if self.ids.add(name, role):
            self.reload_users()
        # (its registry id is its name, its Redis user writes that entry alone; with the issuer: its key's)
        id_variable = {"router": "PD_ROUTER_ID", "gateway": "PD_GATEWAY_ID"}.get(role, "PD_WORKER_ID")
        own = {**self.ids.enrollment(role), "PD_NATS_URL": self.nats_url_of(""),
               "PD_REDIS_URL": self.redis_url_of("", name)} if self.cfg.issuer else {
            "PD_NATS_URL": self.nats_url_of(name), "PD_REDIS_URL": self.redis_url_of(name), id_variable: name}
        env = {**own, **self.tls_env(name), **env}
        return self.spawn(name, [sys.executable, "-m", module],
                          {**self.service_env(), **env, **self.cfg.worker_env.get(name, {})})

    def metrics_url(self, name: str, path: str = "/metrics") -> str:
        """`path` on process `name`'s metrics port: its /metrics, /health or /ready (never on the gateway's API)."""
        return f"http://{self.ip(name)}:{self.metrics_ports[name]}{path}"

    def metric_total(self, name: str, metric: str) -> float:
        """The sum of every sample of `metric` (all its labels) on process `name`'s /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.metrics_url(name), timeout=10) as r:
            text = r.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == metric)

    def start(self, ready_timeout_s: float = 240) -> Stack:
        """Every process started, returning once the stack is ready; a start that fails part-way
        (a server or a service that exits, a wait that times out, an interrupt) stops what it
        started before it raises."""
        try:
            return self.start_all(ready_timeout_s)
        except BaseException:
            self.stop(timeout_s=10)
            raise

    def start_all(self, ready_timeout_s: float) -> Stack:
        c = self.cfg
        self.start_servers()
        # the operator's keeper (pdserve/shared/streams.py)
        self.spawn("streams", [sys.executable, "-m", "pdserve.shared.streams"],
                   {**self.service_env(), "PD_NATS_URL": self.nats_url})
        if c.issuer:  # (its NATS user is the nkey its seed makes; Redis's default user, to make the instances')
            self.spawn("issuer", [sys.executable, "-m", "pdserve.services.issuer.main"], {
                **self.service_env(), **self.ids.issuer_env(), "PD_NATS_URL": self.nats_url_of(""),
                **self.tls_env("issuer"), "PD_METRICS_PORT": "0"})
        for i in range(c.routers):
            name = "router" if i == 0 else f"router-{i}"
            self.service(name, "pdserve.services.router.main")
        for i in range(c.decode):
            self.service(f"decode-{i}", "pdserve.services.decode.main")
        for i in range(0 if c.colocated else c.prefill):
            self.service(f"prefill-{i}", "pdserve.services.prefill.main",
                         PD_KV_BLOCKS=str(c.prefill_kv_blocks or c.kv_blocks))
        self.service("gateway", "pdserve.services.gateway.main")
        self.wait_ready(ready_timeout_s)
        return self

    def start_servers(self) -> None:
        """NATS and Redis: one of each, or the HA set (pdserve/local/ha.py)."""
        c = self.cfg
        if self.ha_ports:
            ha.start(self.data, self.ha_ports, self.secret, self.ids, self.spawn, self.sentinel_secret)
            return
        nats_conf = self.data / "nats.conf"
        nats_conf.write_text(self.ids.nats_config(self.data / "nats"))
        self.spawn("nats", [binary("nats-server"), "-c", str(nats_conf), "-a", self.ip("nats"),
                            "-p", str(c.nats_port)])
        self.start_redis()
        wait_for_port(c.nats_port, 20, self.procs["nats"], self.ip("nats"), self.log_dir)

    def start_redis(self, conf: str = "") -> None:
        """Redis with this run's passwords (and `conf`, more redis.conf lines): one server, or a
        Redis Cluster of cfg.redis_cluster primaries (pdserve/local/redis_cluster.py); returns once
        it answers."""
        self.redis_conf = conf
        redis_conf = self.write_redis_conf()
        if self.cfg.redis_cluster:
            servers = [self.spawn(f"redis-{i}", redis_cluster.node(self.data / "redis", port, redis_conf))
                       for i, port in enumerate(self.redis_ports)]
        else:
            listen = [] if self.redis_tls else ["--port", str(self.cfg.redis_port)]   # (on TLS: its conf's tls-port)
            server = tls_redis_server() if self.redis_tls else valkey_server()
            servers = [self.spawn("redis", [server, str(redis_conf), *listen, "--bind", self.ip("redis"),
                                            *STORE_ARGS, "--dir", str(self.data)])]
        for port, proc in zip(self.redis_ports, servers):
            wait_for_port(port, 20, proc, self.ip("redis"), self.log_dir)
        if self.cfg.redis_cluster:
            redis_cluster.form(self.redis_ports, self.secret)

    def write_redis_conf(self) -> Path:
        path = self.data / "redis.conf"
        tls = redis_conf(self.authority.issue("redis", ("127.0.0.1", "localhost", self.ip("redis"))), self.authority.ca,
                         self.cfg.redis_port) if self.authority and self.redis_tls else ""
        path.write_text(f"requirepass {self.secret}\n{tls}{self.ids.redis_users()}{self.redis_conf}")
        return path

    def reload_users(self) -> None:
        """The servers' users written again (one more instance): the NATS servers reload theirs
        (SIGHUP); each Redis server is given the new ACL users (ACL SETUSER: its config file only
        counts at its next start)."""
        nodes = [n for n in self.procs if n == "nats" or n.startswith("nats-")]
        if not nodes:
            return  # (not started yet: written as they start)
        if self.ha_ports:
            ha.write_users(self.data, self.ha_ports, self.secret, self.ids)
        else:
            (self.data / "nats.conf").write_text(self.ids.nats_config(self.data / "nats"))
            self.write_redis_conf()
        for n in nodes:
            self.procs[n].send_signal(signal.SIGHUP)
        for port in self.ha_ports.redis if self.ha_ports else self.redis_ports:
            try:
                with redis.Redis.from_url(self.redis_url, socket_timeout=5) if self.redis_tls else \
                        redis.Redis(host=self.ip("redis"), port=port, password=self.secret, socket_timeout=5) as r:
                    for user in self.ids.redis.values():
                        r.execute_command("ACL", "SETUSER", *grants.redis_user(user).split())
            except redis.RedisError:
                pass  # (a server down now reads its config file when it starts again)
        time.sleep(0.5)  # (a reload takes milliseconds; a client of the new user that came first would be refused)

    def restart(self, name: str, kill: bool = True) -> subprocess.Popen:
        """Stop a process (SIGKILL, or SIGTERM and wait) and start it again as it was started."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        proc.wait(60)
        argv, env = self.argv[name]
        return self.spawn(name, argv, env)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the gateway is ready with every worker started here (pdserve/local/readiness.py)."""
        c = self.cfg
        want = {"router": c.routers, "decode": c.decode, "prefill": 0 if c.colocated else c.prefill}
        readiness.wait_ready(self.metrics_url("gateway", "/ready"), want, self.procs, timeout_s, self.log_dir)

    def stop(self, timeout_s: float = 30) -> None:
        """Services first (they drain), then the bus and the store; one still running after
        `timeout_s` is killed."""
        servers = [n for n in self.procs if ha.is_server(n)]
        for group in ([n for n in self.procs if n not in servers], servers):
            for name in group:
                if name in self.procs and self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for name in group:
                proc = self.procs.get(name)
                if proc is None:
                    continue
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for proc in self.started:   # (one replaced under its name and still running)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for store in self.data.glob("nats*"):
            if store.is_dir():
                shutil.rmtree(store, ignore_errors=True)

    def refused(self) -> list[str]:
        """The operations NATS or Redis refused a service (outside its grant: pdserve/shared/grants.py)."""
        return refused(self.log_dir)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Stops the stack; a run in which NATS or Redis refused one of the services an operation
        (a grant that misses a subject or a key the services use) fails here."""
        self.stop()
        refused = self.refused()
        if exc_type is None and refused:
            raise RuntimeError(f"NATS or Redis refused the services {len(refused)} operation(s), e.g. {refused[0]!r}; "
                               "pdserve/shared/grants.py must grant what the services do")


if __name__ == "__main__":  # the same as `pdserve serve`, its flags and PD_*
    from pdserve.services.cli import main as pdserve

    sys.exit(pdserve(["serve", *sys.argv[1:]]))
