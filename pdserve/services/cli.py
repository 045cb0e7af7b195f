"""`pdserve`: the local stack, each service, and the operator tools, as one command.

    pdserve serve --model DIR          the whole stack on this machine (`make run`)
    pdserve gateway --gateway-port 80  one service (router, prefill, decode alike)
    pdserve plan --workers 8           how many prefill and decode workers (`make plan`)
    pdserve timeline <x-request-id>    one request's events
    pdserve streams                    the operator's keeper of the JetStream streams
    pdserve version

Each setting of pdserve/shared/config.py (and of the stack: pdserve/local/serve.ServeSettings) is a flag
(`--kv-blocks`) as well as a PD_* variable (PD_KV_BLOCKS); a flag wins. pydantic-settings
builds the flags and their help from the fields' descriptions. `plan` and `timeline` keep their
own parsers (their modules' `main(argv)`): the command hands them the rest of the line.
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

from pydantic import BaseModel, Field, ValidationError
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    CliSubCommand,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from pdserve.local.serve import ServeSettings
from pdserve.shared.config import DecodeSettings, GatewaySettings, PrefillSettings, RouterSettings, StreamsSettings

# the subcommand that runs each settings' `main(settings)`
RUNS = {"serve": "pdserve.local.serve", "gateway": "pdserve.services.gateway.main",
        "router": "pdserve.services.router.main", "prefill": "pdserve.services.prefill.main",
        "decode": "pdserve.services.decode.main", "streams": "pdserve.shared.streams"}
# the subcommands whose modules parse their own arguments: `main(argv, prog)`
FORWARDED = {"plan": "pdserve.planner.plan", "timeline": "pdserve.shared.tools.timeline"}


class Forwarded(BaseModel):
    """Arguments parsed by the tool's own module (see its --help)."""


class Version(BaseModel):
    """pdserve's version, and torch's and transformers'."""


class Pdserve(BaseSettings):
    """LLM serving with prefill/decode disaggregation; each setting is a flag and a PD_* variable (a flag wins)."""

    model_config = SettingsConfigDict(cli_prog_name="pdserve", cli_kebab_case=True, cli_implicit_flags=True)

    serve: CliSubCommand[ServeSettings] = Field(description="the whole stack on this machine: NATS, Redis, router, "
                                                "workers, gateway (make run)")
    gateway: CliSubCommand[GatewaySettings] = Field(description="the OpenAI-compatible HTTP gateway")
    router: CliSubCommand[RouterSettings] = Field(description="the router: admission and placement")
    prefill: CliSubCommand[PrefillSettings] = Field(description="a prefill worker")
    decode: CliSubCommand[DecodeSettings] = Field(description="a decode worker")
    streams: CliSubCommand[StreamsSettings] = Field(description="the operator's keeper of the JetStream streams: "
                                                    "makes them, and makes a lost one again")
    plan: CliSubCommand[Forwarded] = Field(description="how many prefill and decode workers for a trace and its "
                                           "SLOs, simulated from the profile (make plan)")
    timeline: CliSubCommand[Forwarded] = Field(description="one request's events from the state store")
    version: CliSubCommand[Version] = Field(description="the versions of pdserve, torch and transformers")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The flags only: a variable named like a command (VERSION, DECODE…) is not one (each command's
        own settings still read PD_*)."""
        return (init_settings,)


def parse(argv: list[str]) -> tuple[str, BaseModel]:
    """The command named in `argv` and its settings: its flags over PD_* over the defaults (--help, or an
    unknown flag: argparse's message and exit)."""
    root = Pdserve(_cli_parse_args=argv)
    return next((name, sub) for name in Pdserve.model_fields if (sub := getattr(root, name)) is not None)


def problem(err: ErrorDetails) -> str:
    """A setting's error as its command and flag would name it: `gateway --gateway-port: Input should be…`."""
    command, *field = [str(part) for part in err["loc"]]
    return " ".join([command, *(f"--{f.replace('_', '-')}" for f in field[:1])]) + f": {err['msg']}"


def versions() -> str:
    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"
    return f"pdserve {of('pdserve')} (torch {of('torch')}, transformers {of('transformers')})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in FORWARDED:
        code = importlib.import_module(FORWARDED[argv[0]]).main(argv[1:], prog=f"pdserve {argv[0]}")
        return code or 0
    try:
        name, settings = parse(argv or ["--help"])
    except ValidationError as e:
        print("\n".join(f"pdserve: error: {problem(err)}" for err in e.errors()), file=sys.stderr)
        return 2
    except SettingsError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    if name == "version":
        print(versions())
    else:
        importlib.import_module(RUNS[name]).main(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
