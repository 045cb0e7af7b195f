"""The compose stack names real modules and real settings (and `docker compose config` passes
where the compose plugin exists)."""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shared.config import DecodeSettings, GatewaySettings, PrefillSettings, RouterSettings

COMPOSE = Path(__file__).parents[2] / "deploy" / "compose" / "compose.yaml"
SETTINGS = {"router": RouterSettings, "gateway": GatewaySettings, "prefill": PrefillSettings,
            "decode": DecodeSettings}


def test_compose_services_and_settings_exist():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"nats", "redis", "jaeger", "prometheus", "grafana", *SETTINGS} <= set(services)
    for name in ("prometheus", "grafana"):   # their mounted configuration is in the repository
        for volume in services[name]["volumes"]:
            assert (COMPOSE.parent / volume.split(":")[0]).exists(), volume
    assert "-js" in services["nats"]["command"]
    for name, settings in SETTINGS.items():
        module = services[name]["command"][-1]
        assert importlib.util.find_spec(module) is not None, module
        fields = {f"PD_{f}".upper() for f in settings.model_fields}
        env = services[name].get("environment") or spec["x-service"]["environment"]
        unknown = [k for k in env if k.startswith("PD_") and k not in fields]
        assert not unknown, (name, unknown)
    assert "replicas" in services["prefill"]["deploy"] and "replicas" in services["decode"]["deploy"]
    # NATS and Redis require the passwords every service's URL carries
    env = spec["x-service"]["environment"]
    assert "${PD_NATS_PASSWORD" in env["PD_NATS_URL"] and "--pass" in services["nats"]["command"]
    assert "${PD_REDIS_PASSWORD" in env["PD_REDIS_URL"] and "--requirepass" in services["redis"]["command"]


def test_docker_compose_config_validates():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no docker compose plugin on this machine")
    result = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                            text=True, env={**os.environ, "PD_NATS_PASSWORD": "x", "PD_REDIS_PASSWORD": "y"})
    assert result.returncode == 0, result.stderr
