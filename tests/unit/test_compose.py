"""The compose stack names real modules and real settings, runs each service as its role's NATS
and Redis user (shared/grants.py) as the image's non-root user, with no password on a command
line (and `docker compose config` passes where the compose plugin exists)."""

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from shared import grants
from shared.config import DecodeSettings, GatewaySettings, PrefillSettings, RouterSettings
from shared.urls import nats_inbox

COMPOSE = Path(__file__).parents[2] / "deploy" / "compose" / "compose.yaml"
DOCKERFILE = (COMPOSE.parent / "Dockerfile").read_text()
PASSWORDS = [grants.password_variable(u)[1:] for u in (*grants.ROLES, grants.OPERATOR)] + ["PD_REDIS_PASSWORD"]
INTERPOLATED_PASSWORD = re.compile(r"(?<!\$)\$\{?PD_\w*PASSWORD")   # `$$` is a literal `$`
SETTINGS = {"router": RouterSettings, "gateway": GatewaySettings, "prefill": PrefillSettings,
            "decode": DecodeSettings}


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


def test_compose_gives_each_service_its_role_and_no_password_on_a_command_line():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    uid, gid = re.search(r"^USER (\d+):(\d+)$", DOCKERFILE, re.M).groups()
    for role in grants.ROLES:
        env, var = services[role]["environment"], grants.password_variable(role)[1:]
        for key, scheme in (("PD_NATS_URL", "nats"), ("PD_REDIS_URL", "redis")):
            url = urlsplit(interpolated(env[key]))
            assert (url.scheme, url.username, url.password) == (scheme, role, f"<{var}>"), env[key]
        assert nats_inbox(interpolated(env["PD_NATS_URL"])) == grants.inbox(role)   # the inboxes its grant reads
        assert services[role]["user"] == f"{uid}:{gid}" and int(uid) != 0 and services[role]["cap_drop"] == ["ALL"]
    # NATS: the rendered authorization block, each password from the server's environment
    nats = services["nats"]
    assert set(PASSWORDS) - {"PD_REDIS_PASSWORD"} <= set(nats["environment"])
    assert "../nats/authorization.conf:/etc/nats/authorization.conf:ro" in nats["volumes"]
    (config,) = nats["configs"]
    assert config["target"] == nats["command"][-1] == "/etc/nats/nats.conf"
    conf = spec["configs"][config["source"]]["content"]
    assert "include ./authorization.conf" in conf and "jetstream" in conf
    # Redis: redis.conf written at start, each role's ACL user as shared/grants.py has it
    script = services["redis"]["command"][0].replace("$$", "$")
    users = [line for line in script.splitlines() if line.startswith("user ")]
    roles = (grants.User(r, r, grants.password_variable(r)) for r in grants.ROLES)
    assert users == grants.redis_users(roles).splitlines()
    assert "requirepass $PD_REDIS_PASSWORD" in script and "PD_REDIS_PASSWORD" in services["redis"]["environment"]
    assert set(PASSWORDS) - {grants.password_variable(grants.OPERATOR)[1:]} <= set(services["redis"]["environment"])
    for name, service in services.items():
        argv = [*service.get("entrypoint", []), *(service.get("command") or [])]
        assert not any(INTERPOLATED_PASSWORD.search(a) for a in argv), name


def test_docker_compose_config_validates():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no docker compose plugin on this machine")
    result = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                            text=True, env={**os.environ, **dict.fromkeys(PASSWORDS, "x")})
    assert result.returncode == 0, result.stderr
