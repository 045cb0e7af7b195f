"""`pdserve` (pdserve/services/cli.py): its help, each setting a flag over its PD_* variable, its errors."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from pydantic import ValidationError

from pdserve.services import cli
from pdserve.shared import service
from pdserve.shared.config import RouterSettings

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["serve", "gateway", "router", "prefill", "decode", "plan", "timeline", "version"]


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.services.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.upper().startswith("PD_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_help_lists_every_command():
    r = pdserve("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: pdserve")
    for command in COMMANDS:
        assert f"    {command} " in r.stdout, command


def test_a_commands_help_shows_each_setting_as_a_flag_with_its_description_and_starts_nothing():
    r = pdserve("gateway", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: pdserve gateway" in r.stdout
    assert "--gateway-port int" in r.stdout and "port the HTTP API listens on (default: 8000)" in r.stdout
    assert "--allow-open, --no-allow-open" in r.stdout  # booleans: a flag and its negation
    r = pdserve("timeline", "--help")  # its own parser, under the command's name
    assert r.returncode == 0 and r.stdout.startswith("usage: pdserve timeline"), r.stderr


def test_a_flag_overrides_its_pd_variable(clean_env):
    clean_env.setenv("PD_GATEWAY_PORT", "1234")
    clean_env.setenv("PD_MODEL", "org/some-model")
    name, settings = cli.parse(["gateway", "--gateway-port", "9"])
    assert name == "gateway"
    assert settings.gateway_port == 9                                     # the flag
    assert settings.model == settings.model_name == "org/some-model"      # the variable, where no flag
    assert cli.parse(["gateway"])[1].gateway_port == 1234


def test_a_variable_named_like_a_command_is_not_one(clean_env):
    clean_env.setenv("VERSION", "3")
    clean_env.setenv("DECODE", "1")
    assert cli.parse(["version"])[0] == "version"


def test_serve_is_the_stack_make_run_starts(clean_env):
    clean_env.setenv("PD_KV_BLOCKS", "512")
    name, settings = cli.parse(["serve", "--model", "models/mine", "--prefill", "2", "--colocated"])
    cfg = settings.config()
    assert name == "serve"
    assert (cfg.model, cfg.prefill, cfg.decode, cfg.colocated, cfg.gateway_port, cfg.kv_blocks) == \
        ("models/mine", 2, 1, True, 8000, 512)
    assert cli.parse(["serve", "--model-name", "mine"])[1].config().env == {"PD_MODEL_NAME": "mine"}


def test_the_stack_module_takes_the_same_flags():
    r = subprocess.run([sys.executable, "-m", "pdserve.local.stack", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "usage: pdserve serve" in r.stdout and "--nats-port int" in r.stdout, r.stderr


def test_version_prints_pdserves_and_its_engines():
    r = pdserve("version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"pdserve {version('pdserve')} (torch {version('torch')}, transformers ")


def test_the_console_script_is_this_command():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["pdserve"] == "pdserve.services.cli:main"


def test_a_bad_flag_exits_non_zero_naming_it():
    r = pdserve("gateway", "--no-such-setting", "1")
    assert r.returncode == 2 and "unrecognized arguments: --no-such-setting" in r.stderr
    r = pdserve("gateway", "--gateway-port", "abc")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "pdserve: error: gateway --gateway-port: Input should be a valid integer" in r.stderr
    r = pdserve("launch")
    assert r.returncode == 2 and "invalid choice: 'launch'" in r.stderr


def test_a_renamed_setting_is_read_by_its_old_name_and_value_and_warned_of_at_start(clean_env, caplog):
    clean_env.setenv("PD_PREFILL_MODE", "cost")
    clean_env.setenv("PD_PREFILL_POLICY", "cost")
    settings = RouterSettings()
    assert (settings.placement, settings.prefill_choice) == ("cheapest", "soonest")
    clean_env.setattr(service.logs, "setup", lambda *args: None)  # (caplog's handler stays on the root logger)
    with caplog.at_level(logging.WARNING, logger=service.__name__):
        service.setup_logging(settings, "router")
    assert caplog.messages == [
        "PD_PREFILL_MODE is PD_PLACEMENT now: PD_PREFILL_MODE=cost reads as PD_PLACEMENT=cheapest",
        "PD_PREFILL_POLICY is PD_PREFILL_CHOICE now: PD_PREFILL_POLICY=cost reads as PD_PREFILL_CHOICE=soonest"]
    clean_env.setenv("PD_PREFILL_MODE", "remote")
    settings = cli.parse(["router", "--prefill-policy", "round_robin"])[1]  # an old flag too (not in --help)
    assert (settings.placement, settings.prefill_choice) == ("remote", "round_robin")
    assert "--prefill-mode" not in pdserve("router", "--help").stdout


def test_a_renamed_settings_new_name_wins_over_its_old_one(clean_env):
    assert RouterSettings().renamed == []
    clean_env.setenv("PD_PREFILL_MODE", "cost")
    clean_env.setenv("PD_PLACEMENT", "remote")
    settings = RouterSettings()
    assert settings.placement == "remote"
    assert settings.renamed == ["PD_PREFILL_MODE is PD_PLACEMENT now: PD_PREFILL_MODE=cost is ignored "
                                "(PD_PLACEMENT=remote is set)"]
    clean_env.setenv("PD_PREFILL_MODE", "remote")
    assert cli.parse(["router", "--placement", "cheapest"])[1].placement == "cheapest"
    with pytest.raises(ValidationError):
        RouterSettings(placement="cost")  # an old value only under its old name
