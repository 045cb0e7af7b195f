"""deploy/nats/authorization.conf is what pdserve/shared/grants.py renders (`python -m pdserve.shared.grants`):
a deployment's NATS users and grants never drift from the services' subjects."""

import contextlib
import io
from pathlib import Path

from pdserve.shared import grants

FILE = Path(__file__).parents[2] / "deploy" / "nats" / "authorization.conf"


def test_the_deployed_authorization_is_the_rendered_one():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        grants.main()
    assert FILE.read_text() == out.getvalue(), "run: python -m pdserve.shared.grants > deploy/nats/authorization.conf"
    text = out.getvalue()
    assert "auth_callout { issuer: $PD_ISSUER_ACCOUNT" in text and "$PD_ISSUER_NKEY" in text
    assert not any(f'user: "{role}"' in text for role in grants.ROLES)   # every instance is the issuer's to let in


def test_an_instances_grant_names_its_own_subjects_and_a_roles_any_instances():
    """decode-0 reads its own admits, KV and cancels; prefill-0 makes and pulls its own consumer;
    no grant makes, changes, purges or deletes a stream (pdserve/shared/streams.py is the operator's)."""
    from pdserve.shared import subjects

    decode, prefill = grants.grant("decode", "decode-0"), grants.grant("prefill", "prefill-0")
    assert subjects.decode_admit("decode-0") in decode.subscribe and "pd.decode.*.admit" not in decode.subscribe
    assert all("decode-0" in s for s in decode.subscribe)
    assert grants.consumer_create("prefill-0") in prefill.publish
    assert all("*" not in s and ">" not in s for s in prefill.publish if "CONSUMER" in s)
    for role in grants.ROLES:
        for g in (grants.grant(role), grants.grant(role, f"{role}-0")):
            assert not [s for s in g.publish if ".STREAM." in s and not s.split(".STREAM.")[1].startswith(
                ("INFO.", "NAMES", "MSG.GET."))], role   # (a router reads a dead job by its sequence)
    assert "pd.decode.*.admit" in grants.grant("decode").subscribe   # one identity per role: any instance's
