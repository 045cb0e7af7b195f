"""deploy/nats/authorization.conf is what shared/grants.py renders (`python -m shared.grants`):
a deployment's NATS users and grants never drift from the services' subjects."""

import contextlib
import io
from pathlib import Path

from shared import grants

FILE = Path(__file__).parents[2] / "deploy" / "nats" / "authorization.conf"


def test_the_deployed_authorization_is_the_rendered_one():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        grants.main()
    assert FILE.read_text() == out.getvalue(), "run: python -m shared.grants > deploy/nats/authorization.conf"
    for role in grants.ROLES:
        assert grants.password_variable(role) in out.getvalue()
