"""Who may do what on the bus: a NATS user per service role, each allowed to publish and
subscribe on exactly the subjects of its part of the request path (shared/subjects.py, one
source for both), rendered as nats-server's `authorization` block.

    role      publishes                                       subscribes
    gateway   route requests; replays; cancels                 its requests' tokens and events
    router    admits; events; cancels; the job stream's setup  route requests, requeues, KV outcomes
              prefix snapshots asked; its prefix-event consumer  (and the prefix events, on its inbox)
    prefill   tokens (a failed handoff); KV to decode workers  its cancels and KV acks; its job stream
              prefix events                                    prefix snapshot asks
    decode    tokens; prefill jobs; KV acks; requeues          admits, cancels, replays, KV notices
              prefix events                                    prefix snapshot asks

Every role may answer the requests it receives (`allow_responses`: the reply subject of one
received request, once) and reads the replies to its own requests, which come to inboxes
under its name (`_INBOX.<user>.`, nats-py's inbox prefix: shared/urls.py), not to another
role's. The operator's user (`pdserve`: `make run`'s tools, the tests) has every subject.
So prompts are read by the router (route requests), the decode pool (admits) and the prefill
pool (its job stream) only, outputs by the gateway only, and only decode workers (which hold
the KV blocks a job fills) queue jobs.

In Redis each role is an ACL user (its password the role's NATS password) with the keys of its
part (`REDIS_KEYS`, the prefixes shared/state/keys.py names) and every command but the dangerous
ones (FLUSHALL, CONFIG, KEYS, DEBUG, SHUTDOWN, ACL, REPLICAOF, MONITOR, ...); the operator is
Redis's default user. Redis 6.2's key patterns grant reading and writing together, so a role
that reads a key can write it: every role reads and writes the registry and the request state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from shared import subjects

ROLES = ("gateway", "router", "prefill", "decode")
OPERATOR = "pdserve"
ANY = "*"
_STREAM = subjects.PREFILL_STREAM


@dataclass(frozen=True)
class Grant:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def inbox(user: str) -> str:
    """The prefix of the inboxes `user`'s requests are answered on."""
    return f"_INBOX.{user}"


_STREAM_SETUP = tuple(f"$JS.API.STREAM.{verb}.{_STREAM}" for verb in ("INFO", "CREATE", "UPDATE"))
_CANCELS = (subjects.decode_cancel(ANY), subjects.prefill_cancel(ANY))
# PD_PREFIX_INDEX=events: workers publish their prefix events and answer snapshots; each router
# reads the events through an ordered consumer of its own (made, flow-controlled) and asks snapshots
_PREFIX = subjects.PREFIX_STREAM
_PREFIX_SETUP = tuple(f"$JS.API.STREAM.{verb}.{_PREFIX}" for verb in ("INFO", "CREATE", "UPDATE"))
_PREFIX_PUBLISHER = (subjects.prefix_events(ANY), *_PREFIX_SETUP)
_PREFIX_READER = (subjects.prefix_snapshot(ANY), *_PREFIX_SETUP, f"$JS.API.CONSUMER.CREATE.{_PREFIX}",
                  f"$JS.API.CONSUMER.CREATE.{_PREFIX}.>", f"$JS.API.CONSUMER.DELETE.{_PREFIX}.*",
                  f"$JS.FC.{_PREFIX}.>")

GRANTS: dict[str, Grant] = {
    "gateway": Grant(
        publish=(subjects.ROUTE, subjects.decode_replay(ANY), *_CANCELS),
        subscribe=(subjects.tokens(ANY), subjects.stalled(ANY))),
    "router": Grant(
        publish=(subjects.decode_admit(ANY), subjects.stalled(ANY), *_CANCELS, *_STREAM_SETUP, *_PREFIX_READER),
        subscribe=(subjects.ROUTE, subjects.REQUEUE, subjects.KV_OUTCOMES)),
    "prefill": Grant(
        publish=(subjects.tokens(ANY), subjects.decode_cancel(ANY), subjects.decode_kv(ANY),
                 subjects.decode_kv_end(ANY), subjects.decode_replay(ANY), *_STREAM_SETUP,
                 # its consumer of the job stream: found by subject, made durable, pulled, acked
                 "$JS.API.STREAM.NAMES", f"$JS.API.CONSUMER.INFO.{_STREAM}.*", f"$JS.API.CONSUMER.CREATE.{_STREAM}.>",
                 f"$JS.API.CONSUMER.DURABLE.CREATE.{_STREAM}.*", f"$JS.API.CONSUMER.MSG.NEXT.{_STREAM}.*",
                 f"$JS.ACK.{_STREAM}.>", *_PREFIX_PUBLISHER),
        subscribe=(*subjects.prefill_control(ANY).values(), subjects.prefix_snapshot(ANY))),
    "decode": Grant(
        publish=(subjects.tokens(ANY), subjects.prefill_jobs(ANY), subjects.REQUEUE, subjects.KV_OUTCOMES,
                 subjects.prefill_kv_ack(ANY), subjects.prefill_kv_resend(ANY), subjects.prefill_kv_sync(ANY),
                 *_PREFIX_PUBLISHER),
        subscribe=(subjects.decode_admit(ANY), subjects.decode_cancel(ANY), subjects.decode_replay(ANY),
                   subjects.decode_kv(ANY), subjects.decode_kv_end(ANY), subjects.prefix_snapshot(ANY))),
}


# Redis keys by role (shared/state/keys.py, prefix_index.py, the gateway's limits)
_REGISTRY = ("pd:{registry}:*",)
_REQUESTS = ("pd:req:*", "pd:{flight}:*")
REDIS_KEYS: dict[str, tuple[str, ...]] = {
    "gateway": (*_REGISTRY, *_REQUESTS, "pd:route:*", "pd:rate:*", "pd:inflight:*"),
    "router": (*_REGISTRY, *_REQUESTS, "pd:route:*", "pd:session:*", "pd:prefix:*"),
    "prefill": (*_REGISTRY, *_REQUESTS, "pd:prefix:*"),
    "decode": (*_REGISTRY, *_REQUESTS, "pd:prefix:*"),
}
REDIS_COMMANDS = "+@all -@dangerous +cluster|slots"  # (a Redis Cluster's clients learn its slots with CLUSTER SLOTS)


def redis_users(passwords: Mapping[str, str]) -> str:
    """redis.conf's `user` lines: each role on, with its password, its keys and its commands."""
    return "".join(f"user {role} on >{passwords[role]} {' '.join('~' + k for k in REDIS_KEYS[role])} "
                   f"{REDIS_COMMANDS}\n" for role in ROLES)


def password_variable(user: str) -> str:
    """The environment variable a deployment's nats-server config reads `user`'s password from."""
    return f"$PD_NATS_{user.upper()}_PASSWORD"


def nats_authorization(passwords: Mapping[str, str]) -> str:
    """nats-server's `authorization` block: each role with its grant, and the operator, with
    the passwords given by user (a literal, or a `$VARIABLE` nats-server reads from its
    environment: `password_variable`)."""

    def secret(user: str) -> str:
        p = passwords[user]
        return p if p.startswith("$") else json.dumps(p)

    users = []
    for role in ROLES:
        g = GRANTS[role]
        users.append(
            f"    {{ user: {role}, password: {secret(role)}, permissions: {{\n"
            f"        publish: {{ allow: {json.dumps(list(g.publish))} }}\n"
            f"        subscribe: {{ allow: {json.dumps([*g.subscribe, inbox(role) + '.>'])} }}\n"
            f"        allow_responses: true }} }}")
    users.append(f"    {{ user: {OPERATOR}, password: {secret(OPERATOR)} }}")
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def main() -> None:
    """Print the authorization block with each password read from the server's environment
    (deploy/nats/authorization.conf: compose and the NATS Helm chart include it)."""
    print("# Generated by `python -m shared.grants` from shared/grants.py: NATS users per service role.\n"
          "# Each password comes from nats-server's environment (PD_NATS_<USER>_PASSWORD).")
    print(nats_authorization({user: password_variable(user) for user in (*ROLES, OPERATOR)}), end="")


if __name__ == "__main__":
    main()
