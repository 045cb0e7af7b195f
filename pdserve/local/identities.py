"""A local stack's credentials, made for each run: per service instance a NATS user and a Redis
ACL user, both named by its id and holding that instance's grant (pdserve/shared/grants.py), and the
operator's NATS user. Passwords are random per run and reach a process only in its own
environment (its URLs); the servers read them from config files in the stack's private data
directory.

An instance started after the servers (a router replica a benchmark adds) gets its identity
then: the config files are written again, the NATS servers reload theirs and each Redis server
is given the user (pdserve/local/stack.py).

With `--issuer` the stack runs as compose and Kubernetes do: the servers know only the operator
and the identity issuer (pdserve/services/issuer), which lets each instance in as a user named after the
key it makes (pdserve/shared/identity.py); an instance gets its role's enrollment token alone.

JetStream's store is encrypted (ChaCha20-Poly1305) with a key made for the run, so the prompts
in the job stream are not on disk in clear, and held to MAX_FILE_STORE.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.local import ha
from pdserve.services.issuer import keys
from pdserve.shared import grants
from pdserve.shared.grants import User

MAX_FILE_STORE = "4G"


def _password() -> str:
    return secrets.token_urlsafe(24)


@dataclass
class Identities:
    nats: dict[str, User] = field(default_factory=dict)           # by user name
    redis: dict[str, User] = field(default_factory=dict)          # ACL users, by instance
    store_key: str = field(default_factory=_password)              # JetStream's encryption key
    tls: str = ""                                                  # the NATS servers' tls block (--tls)
    issuer: dict[str, str] = field(default_factory=dict)           # its keys and the roles' tokens (--issuer)

    @classmethod
    def made(cls, instances: Mapping[str, str], issuer: bool = False) -> Identities:
        """For `instances` (id -> role), with the operator; `issuer`: the issuer's keys instead."""
        ids = cls(issuer=keys.made() if issuer else {})
        ids.nats[grants.OPERATOR] = User(grants.OPERATOR, grants.OPERATOR, _password())
        for name, role in instances.items():
            ids.add(name, role)
        return ids

    def add(self, name: str, role: str) -> bool:
        """Instance `name` of `role` has an identity (made now: True; with the issuer, never: it
        gives the instance its own)."""
        if self.issuer:
            return False
        if name in self.nats:
            if self.nats[name].role != role:
                raise ValueError(f"{name} is a {self.nats[name].role}, not a {role}")
            return False
        self.nats[name] = User(name, role, _password(), instance=name)
        self.redis[name] = User(name, role, _password(), instance=name)
        return True

    def users(self) -> list[User]:
        return list(self.nats.values())

    def password(self, user: str) -> str:
        return self.nats[user].password

    def passwords(self) -> list[str]:
        """Every secret here (what no log may carry)."""
        return [u.password for u in (*self.nats.values(), *self.redis.values())] + [self.store_key] + [
            *self.issuer_env().values()]

    def enrollment(self, role: str) -> dict[str, str]:
        """An instance's environment with the issuer: its role's token."""
        return {"PD_ENROLL_TOKEN": self.issuer[f"PD_ENROLL_{role.upper()}"]}

    def issuer_env(self) -> dict[str, str]:
        """The issuer's: its key and every role's token."""
        return {k: v for k, v in self.issuer.items() if k.startswith(("PD_ISSUER_SEED", "PD_ENROLL_"))}

    def redis_users(self) -> str:
        """redis.conf's `user` lines (with the issuer, none: it makes the instances')."""
        return grants.redis_users(self.redis.values())

    def nats_config(self, store: Path) -> str:
        """nats-server's users, its TLS (when on) and its JetStream store (at `store`, encrypted)."""
        users = grants.nats_callout(self.password(grants.OPERATOR), self.issuer["PD_ISSUER_ACCOUNT"],
                                    self.issuer["PD_ISSUER_NKEY"]) if self.issuer else grants.nats_authorization(
            self.users())
        return users + self.tls + (
            f'jetstream {{ store_dir: "{store}", max_file_store: {MAX_FILE_STORE}, cipher: chachapoly, '
            f'key: "{self.store_key}" }}\n')


def refused(log_dir: Path) -> list[str]:
    """The operations NATS or Redis refused the services (outside their grants: pdserve/shared/grants.py),
    from NATS's logs (a violation) and the services' (Redis's NOPERM, as they report it)."""
    def lines(log: Path) -> list[str]:
        return log.read_text(errors="replace").splitlines()
    logs = sorted(log_dir.glob("*.log"))
    return [line for log in logs if log.name.startswith("nats") for line in lines(log) if "Violation" in line] + \
        [line for log in logs if not ha.is_server(log.stem) for line in lines(log)
         if "NOPERM" in line or "no permissions to" in line or "can't access at least one of the keys" in line]
