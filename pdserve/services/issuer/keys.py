"""A deployment's identity secrets, made once (never per instance), as shell exports:

    eval "$(python -m pdserve.services.issuer.keys)"

PD_ISSUER_SEED (the issuer's account key: it signs the instances' users) and its two public keys
nats-server's configuration names (PD_ISSUER_ACCOUNT, the auth callout's issuer; PD_ISSUER_NKEY,
the issuer's own NATS user), one enrollment token per role (PD_ENROLL_<ROLE>: on the issuer, and
as PD_ENROLL_TOKEN on that role's instances), the operator's NATS password, Redis's default
user's password and JetStream's store key (deploy/compose/compose.yaml, deploy/k8s).
"""

from __future__ import annotations

import secrets

import nkeys

from pdserve.shared import grants, natsjwt
from pdserve.shared.identity import ISSUER_KEY


def _secret() -> str:
    """A password or token nats-server reads as a string: it parses a `$VARIABLE`'s value as it
    would a literal, and one that starts with a digit fails as a number."""
    return "pd" + secrets.token_hex(24)


def made() -> dict[str, str]:
    seed = natsjwt.new_key(nkeys.PREFIX_BYTE_ACCOUNT).seed.decode()
    values = {"PD_ISSUER_SEED": seed,
              "PD_ISSUER_ACCOUNT": nkeys.from_seed(seed.encode()).public_key.decode(),
              "PD_ISSUER_NKEY": natsjwt.derived_key(seed, ISSUER_KEY).public_key.decode()}
    values |= {f"PD_ENROLL_{role.upper()}": _secret() for role in grants.ROLES}
    return values | {"PD_NATS_PDSERVE_PASSWORD": _secret(), "PD_REDIS_PASSWORD": _secret(), "PD_JS_KEY": _secret()}


def main() -> None:
    for name, value in made().items():
        print(f"export {name}={value}")


if __name__ == "__main__":
    main()
