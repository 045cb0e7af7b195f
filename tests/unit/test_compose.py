"""The compose stack names real modules and real settings, lets each instance in through the
identity issuer as a NATS and Redis user of its own (its role's token, no user in its URLs:
pdserve/shared/identity.py), runs it as the image's non-root user, with no secret on a command line
(and `docker compose config` passes where the compose plugin exists)."""

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from pdserve.services.issuer import keys
from pdserve.shared import grants
from pdserve.shared.config import DecodeSettings, GatewaySettings, IssuerSettings, PrefillSettings, RouterSettings

COMPOSE = Path(__file__).parents[2] / "deploy" / "compose" / "compose.yaml"
DOCKERFILE = (COMPOSE.parent / "Dockerfile").read_text()
SECRETS = list(keys.made())   # what `make compose-up` writes into deploy/compose/secrets.env
INTERPOLATED_SECRET = re.compile(r"(?<!\$)\$\{?PD_\w*(PASSWORD|SEED|ENROLL|KEY)")   # `$$` is a literal `$`
SETTINGS = {"router": RouterSettings, "gateway": GatewaySettings, "prefill": PrefillSettings,
            "decode": DecodeSettings, "issuer": IssuerSettings}


def test_compose_services_and_settings_exist():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"nats", "redis", "jaeger", "prometheus", "grafana", *SETTINGS} <= set(services)
    for name in ("prometheus", "grafana"):   # their mounted configuration is in the repository
        for volume in services[name]["volumes"]:
            assert (COMPOSE.parent / volume.split(":")[0]).exists(), volume
    for name, settings in SETTINGS.items():
        module = services[name]["command"][-1]
        assert importlib.util.find_spec(module) is not None, module
        fields = {f"PD_{f}".upper() for f in settings.model_fields}
        env = services[name]["environment"]
        unknown = [k for k in env if k.startswith("PD_") and k not in fields]
        assert not unknown, (name, unknown)
    assert "replicas" in services["prefill"]["deploy"] and "replicas" in services["decode"]["deploy"]


def interpolated(text: str) -> str:
    """`text` as compose sets it, each ${VAR...} the sample value `<VAR>`."""
    return re.sub(r"\$\{(\w+)(:[-?][^}]*)?\}", lambda m: f"<{m.group(1)}>", text)


def test_compose_lets_each_instance_in_through_the_issuer_and_no_secret_on_a_command_line():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    uid, gid = re.search(r"^USER (\d+):(\d+)$", DOCKERFILE, re.M).groups()
    for role in grants.ROLES:
        env = services[role]["environment"]
        assert interpolated(env["PD_ENROLL_TOKEN"]) == f"<PD_ENROLL_{role.upper()}>"
        assert urlsplit(env["PD_NATS_URL"]).username is None and urlsplit(env["PD_REDIS_URL"]).username is None
        assert interpolated(services["issuer"]["environment"][f"PD_ENROLL_{role.upper()}"]) == \
            f"<PD_ENROLL_{role.upper()}>"
        assert services[role]["user"] == f"{uid}:{gid}" and int(uid) != 0 and services[role]["cap_drop"] == ["ALL"]
    assert services["issuer"]["deploy"]["replicas"] >= 2   # none running: nobody connects
    # NATS: the rendered authorization block, what it reads from the server's environment
    nats = services["nats"]
    authorization = (COMPOSE.parents[1] / "nats" / "authorization.conf").read_text()
    assert set(re.findall(r"\$(PD_\w+)", authorization)) <= set(nats["environment"])
    assert "../nats/authorization.conf:/etc/nats/authorization.conf:ro" in nats["volumes"]
    assert f"./nats.conf:{nats['command'][-1]}:ro" in nats["volumes"]
    conf = (COMPOSE.parent / "nats.conf").read_text()
    assert "include ./authorization.conf" in conf and "jetstream" in conf and "$PD_JS_KEY" in conf
    # Redis: the operator is the default user; the instances' users are the issuer's, kept in its aclfile
    script = services["redis"]["command"][0].replace("$$", "$")
    assert 'user default on >$PD_REDIS_PASSWORD' in script and "--aclfile /data/users.acl" in script
    assert urlsplit(interpolated(services["issuer"]["environment"]["PD_REDIS_URL"])).password == "<PD_REDIS_PASSWORD>"
    assert set(SECRETS) >= {v for s in services.values() for v in re.findall(r"\$\{(PD_\w+):\?",
                                                                            yaml.safe_dump(s.get("environment", {})))}
    for name, service in services.items():
        argv = [*service.get("entrypoint", []), *(service.get("command") or [])]
        assert not any(INTERPOLATED_SECRET.search(a) for a in argv), name


def test_docker_compose_config_validates():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no docker compose plugin on this machine")
    result = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                            text=True, env={**os.environ, **dict.fromkeys(SECRETS, "x")})
    assert result.returncode == 0, result.stderr


def test_the_check_overrides_the_same_stack_and_says_what_stands_in():
    """make compose-check (bench/compose_check.py) runs compose.yaml with check.yaml over it:
    the override names only services the stack has, builds the pdserve image from the same
    Dockerfile on the local base, and replaces what comes from Docker Hub."""
    spec = yaml.safe_load(COMPOSE.read_text())["services"]
    check = yaml.safe_load((COMPOSE.parent / "check.yaml").read_text())["services"]
    assert set(check) <= set(spec)
    for name, service in check.items():
        if spec[name].get("build"):
            assert service["build"]["dockerfile"] == spec[name]["build"]["dockerfile"]
            assert service["build"]["args"]["BASE_IMAGE"] == "pdserve-base:bookworm"
        elif "build" in service:
            assert (COMPOSE.parent / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name
    for name in (n for n, s in spec.items() if "build" not in s):   # Docker Hub's: built, stood in, or left out
        assert check[name].get("build") or check[name].get("profiles") or name == "jaeger", name
    assert check["jaeger"]["command"][-1] == "pdserve.shared.tools.otlp_sink"   # the stand-in, read by the check
    ignored = [line for line in (COMPOSE.parents[2] / ".dockerignore").read_text().splitlines()
               if line and not line.startswith("#")]
    assert ignored[0] == "*"   # the build context holds what the Dockerfile copies, never a venv


def test_the_gpu_profile_puts_each_worker_on_an_nvidia_gpu_with_a_cuda_torch():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for role in ("prefill", "decode"):
        gpu = services[f"{role}-gpu"]
        assert gpu["profiles"] == ["gpu"] and gpu["command"] == services[role]["command"]
        assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert gpu["build"]["args"]["TORCH_SPEC"] == "torch" and gpu["image"] != services[role]["image"]
        assert gpu["environment"]["PD_DEVICE"] == "cuda"
        assert interpolated(gpu["environment"]["PD_ENROLL_TOKEN"]) == f"<PD_ENROLL_{role.upper()}>"
    for name, service in services.items():   # every pdserve service waits for what it needs, probed while it runs
        if service.get("image", "").startswith("pdserve") and name not in ("streams", "issuer"):
            assert service["depends_on"]["issuer"] == {"condition": "service_healthy"}, name
            assert "/ready" in " ".join(service["healthcheck"]["test"]), name


def test_the_store_keeps_its_control_state_and_a_bounded_memory_as_the_local_stacks_does():
    """Redis runs with the append-only file (leases, deadlines and filings outlive a restart) and a memory
    cap that evicts only keys that expire, least recently used first (pdserve/local/servers.py STORE_ARGS)."""
    from pdserve.local.servers import STORE_ARGS

    command = " ".join(yaml.safe_load(COMPOSE.read_text())["services"]["redis"]["command"])
    local = dict(zip(STORE_ARGS[::2], STORE_ARGS[1::2]))
    assert local["--appendonly"] == "yes" and local["--maxmemory-policy"] == "volatile-lru"
    for option in ("--appendonly", "--appendfsync", "--maxmemory-policy"):
        assert f"{option} {local[option]}" in command, option
    assert re.search(r"--maxmemory \d+[mg]b", command)
