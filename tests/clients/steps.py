"""A driver's step (tests/clients/drivers/<client>_steps.py) run with the client's interpreter."""

from __future__ import annotations

import json

import pytest
import venvs

MODEL = "SmolLM2-135M-Instruct"  # the stack's (pdserve.local.stack serves SmolLM2 under this id)
DRIVERS = venvs.ROOT / "tests" / "clients" / "drivers"


def run_step(client: str, driver: str, base_url: str, model: str, step: str, timeout: float = 300) -> dict:
    """The step's numbers (with the client's version), or an assertion carrying its traceback."""
    done = venvs.run(client, [str(DRIVERS / driver), base_url, model, step], timeout)
    assert done.returncode == 0, f"{client} {step} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def case(client: str, step: str, ran: str):
    """A parametrized case that is one row of the table: `step` of the client's driver, described by `ran`."""
    return pytest.param(step, marks=pytest.mark.works_with(client, ran), id=step)
