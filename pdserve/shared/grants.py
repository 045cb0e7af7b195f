"""Who may do what on the bus: a NATS user per service instance (its worker, router or gateway
id), allowed to publish and subscribe on exactly the subjects of its part of the request path
(pdserve/shared/subjects.py, one source for both), rendered as nats-server's `authorization` block.

    role      publishes                                       subscribes
    gateway   route requests; replays; cancels                 its requests' tokens and events
    router    admits; events; the supervisor's cancels          route requests, requeues, KV outcomes
              prefix snapshots asked; its prefix-event consumer  (and the prefix events, on its inbox);
              dead letters (a job read by its sequence)          jobs' max-deliveries advisories
    prefill   tokens (its first token); KV to decode workers   its own cancels and KV acks; its own
              its own prefix events                              consumer of its own job subject
    decode    tokens; prefill jobs; KV acks; requeues          its own admits, cancels, replays, KV
              its own prefix events                              notices; its own snapshot asks

"Its own": an instance's grant names its id (`grant(role, me)`), so a decode worker reads the
admits of no other decode worker, and a prefill worker pulls only from its own durable consumer,
made with its own job subject as the filter (the consumer create subject pins it). Every user may
answer the requests it receives (`allow_responses`: the reply subject of one received request,
once) and reads the replies to its own requests, which come to inboxes under its name
(`_INBOX.<user>.`, nats-py's inbox prefix: pdserve/shared/urls.py), not to another's. The streams belong to
the operator (pdserve/shared/streams.py): services read their configuration and hold no right to create,
change, purge or delete one. The operator's user (`pdserve`: the streams' keeper, tools, tests)
has every subject. A deployment that gives one identity per role (`me` = ANY: compose and
Kubernetes, deploy/nats/authorization.conf) grants each role what any of its instances may do.
What a worker publishes on subjects it shares with its role (tokens, KV, acks) is accepted only
with its placement's MAC (pdserve/shared/macs.py).

In Redis (Valkey 9 locally; any Redis >= 7) each instance is an ACL user with the keys of its
role's part (`REDIS_KEYS`, the prefixes pdserve/shared/state/keys.py names) and every command but the
dangerous ones (FLUSHALL, CONFIG, KEYS, DEBUG, SHUTDOWN, ACL, REPLICAOF, MONITOR, ...); the
operator is Redis's default user. The registry's entries are read-only (`%R~`) but the
instance's own: no instance can write, renew or delete another's entry; so are the workers'
pass records (`pd:batch:{<id>}`, pdserve/shared/batches.py), which gateways and routers only read. The registry's index
(the set of ids, the change log) and the request state stay writable by every role that uses
them. A deployment with one identity per role (`instance` ANY) lets each role write any entry.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.shared import subjects

ROLES = ("gateway", "router", "prefill", "decode")
OPERATOR = "pdserve"
ANY = "*"
_STREAM = subjects.PREFILL_STREAM
_PREFIX = subjects.PREFIX_STREAM


@dataclass(frozen=True)
class Grant:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


@dataclass(frozen=True)
class User:
    """A NATS user: an instance's own identity (`instance` its id), or one for every instance of
    a role (`instance` ANY); `password` a literal, or a `$VARIABLE` nats-server reads from its
    environment (`password_variable`)."""

    name: str
    role: str
    password: str
    instance: str = ANY


def inbox(user: str) -> str:
    """The prefix of the inboxes `user`'s requests are answered on."""
    return f"_INBOX.{user}"


def _prefix_publisher(me: str) -> tuple[str, ...]:
    """PD_PREFIX_INDEX=events: a worker publishes its own prefix events and reads the stream's configuration."""
    return subjects.prefix_events(me), f"$JS.API.STREAM.INFO.{_PREFIX}"


# each router reads the prefix events through an ordered consumer of its own (made, flow-controlled)
_PREFIX_READER = (subjects.prefix_snapshot(ANY), f"$JS.API.STREAM.INFO.{_PREFIX}", f"$JS.API.CONSUMER.CREATE.{_PREFIX}",
                  f"$JS.API.CONSUMER.CREATE.{_PREFIX}.>", f"$JS.API.CONSUMER.DELETE.{_PREFIX}.*",
                  f"$JS.FC.{_PREFIX}.>")
_CANCELS = (subjects.decode_cancel(ANY), subjects.prefill_cancel(ANY))


def consumer_create(me: str) -> str:
    """The subject prefill worker `me` makes its durable consumer on: its name and its filter
    (its own job subject) are in the subject, and the server refuses a body that differs."""
    return f"$JS.API.CONSUMER.CREATE.{_STREAM}.{me}.{subjects.prefill_jobs(me)}"


def grant(role: str, me: str = ANY) -> Grant:
    """What instance `me` of `role` may do (ANY: whichever instance)."""
    if role == "gateway":
        return Grant(publish=(subjects.ROUTE, subjects.decode_replay(ANY), *_CANCELS),
                     subscribe=(subjects.tokens(ANY), subjects.stalled(ANY)))
    if role == "router":
        return Grant(publish=(subjects.decode_admit(ANY), subjects.stalled(ANY),
                              subjects.decode_supervisor_cancel(ANY), subjects.prefill_supervisor_cancel(ANY),
                              f"$JS.API.STREAM.INFO.{_STREAM}", *_PREFIX_READER,
                              f"$JS.API.STREAM.MSG.GET.{_STREAM}", subjects.PREFILL_DEAD),  # (the dead letters)
                     subscribe=(subjects.ROUTE, subjects.REQUEUE, subjects.KV_OUTCOMES, subjects.JOB_MAX_DELIVERIES))
    if role == "prefill":
        return Grant(publish=(subjects.tokens(ANY), subjects.decode_cancel(ANY), subjects.decode_kv(ANY),
                              subjects.decode_kv_end(ANY), subjects.decode_replay(ANY),
                              # its consumer of the job stream: found by subject, made, pulled, acked
                              "$JS.API.STREAM.NAMES", f"$JS.API.STREAM.INFO.{_STREAM}",
                              f"$JS.API.CONSUMER.INFO.{_STREAM}.{me}", consumer_create(me),
                              f"$JS.API.CONSUMER.DELETE.{_STREAM}.{me}",
                              f"$JS.API.CONSUMER.MSG.NEXT.{_STREAM}.{me}", f"$JS.ACK.{_STREAM}.{me}.>",
                              *_prefix_publisher(me)),
                     subscribe=(*subjects.prefill_control(me).values(), subjects.prefix_snapshot(me)))
    if role == "decode":
        return Grant(publish=(subjects.tokens(ANY), subjects.prefill_jobs(ANY), subjects.REQUEUE, subjects.KV_OUTCOMES,
                              subjects.prefill_kv_ack(ANY), subjects.prefill_kv_resend(ANY),
                              subjects.prefill_kv_sync(ANY), *_prefix_publisher(me)),
                     subscribe=(subjects.decode_admit(me), *subjects.decode_control(me).values(),
                                subjects.decode_replay(me), subjects.decode_kv(me), subjects.decode_kv_end(me),
                                subjects.prefix_snapshot(me)))
    raise ValueError(f"no such role: {role!r}")


# Redis keys by role (pdserve/shared/state/keys.py, prefix_index.py, the gateway's limits); the registry's
# entries apart (redis_keys): each instance writes its own
_ENTRIES = "pd:{registry}:worker:"
_BATCHES = "pd:batch:"
_REGISTRY = ("pd:{registry}:workers", "pd:{registry}:seq", "pd:{registry}:changes", "pd:{registry}:epoch")
_REQUESTS = ("pd:req:*", "pd:{flight}:*")
REDIS_KEYS: dict[str, tuple[str, ...]] = {
    "gateway": (*_REGISTRY, *_REQUESTS, "pd:route:*", "pd:rate:*", "pd:inflight:*"),
    "router": (*_REGISTRY, *_REQUESTS, "pd:route:*", "pd:session:*", "pd:prefix:*"),
    "prefill": (*_REGISTRY, *_REQUESTS, "pd:prefix:*"),
    "decode": (*_REGISTRY, *_REQUESTS, "pd:prefix:*"),
}
REDIS_COMMANDS = "+@all -@dangerous +cluster|slots"  # (a Redis Cluster's clients learn its slots with CLUSTER SLOTS)


def redis_keys(role: str, me: str = ANY) -> str:
    """The key patterns of instance `me` of `role`: its role's, and the registry's entries, read
    only but its own (a gateway's: `me_<start>`, each start registered apart) (`me` ANY: every
    instance of the role, so every entry); the workers' pass records (keys.batch_key) read by
    the gateway and the routers, written by each worker, its own only."""
    own = f"{_ENTRIES}{me}_*" if role == "gateway" else f"{_ENTRIES}{me}"
    entries = f"~{_ENTRIES}*" if me == ANY else f"%R~{_ENTRIES}* ~{own}"
    batches = f"~{_BATCHES}*" if role in ("prefill", "decode") and me == ANY else \
        f"~{_BATCHES}{{{me}}}" if role in ("prefill", "decode") else f"%R~{_BATCHES}*"
    return " ".join((entries, batches, *("~" + k for k in REDIS_KEYS[role])))


def redis_user(u: User) -> str:
    """The ACL rule of `u` (an instance's user, or a role's): on, its password, keys and commands."""
    return f"{u.name} on >{u.password} {redis_keys(u.role, u.instance)} {REDIS_COMMANDS}"


def redis_users(users: Iterable[User]) -> str:
    """redis.conf's `user` lines (the operator is Redis's default user: none of its own)."""
    return "".join(f"user {redis_user(u)}\n" for u in users if u.role != OPERATOR)


def _literal(value: str) -> str:
    """A value in nats-server's configuration: a `$VARIABLE` as it is, anything else quoted."""
    return value if value.startswith("$") else json.dumps(value)


def nats_authorization(users: Iterable[User]) -> str:
    """nats-server's `authorization` block: each user with its instance's grant, the operator
    with every subject."""

    lines = []
    for u in users:
        if u.role == OPERATOR:
            lines.append(f"    {{ user: {json.dumps(u.name)}, password: {_literal(u.password)} }}")
            continue
        g = grant(u.role, u.instance)
        lines.append(
            f"    {{ user: {json.dumps(u.name)}, password: {_literal(u.password)}, permissions: {{\n"
            f"        publish: {{ allow: {json.dumps(list(g.publish))} }}\n"
            f"        subscribe: {{ allow: {json.dumps([*g.subscribe, inbox(u.name) + '.>'])} }}\n"
            f"        allow_responses: true }} }}")
    return "authorization {\n  users: [\n" + "\n".join(lines) + "\n  ]\n}\n"


def nats_callout(operator_password: str, issuer_account: str, issuer_nkey: str) -> str:
    """nats-server's `authorization` block where instances get their identities from the issuer
    (pdserve/services/issuer): the operator and the issuer (its NATS key `issuer_nkey`, which may only
    read the issuer's requests and answer them) are its configured users; every other connection
    is the issuer's to let in with a user signed by `issuer_account` (auth callout). A user with
    an nkey makes the server send every client a nonce, which an instance signs to prove its key.
    Each value is a literal or a `$VARIABLE` from nats-server's environment."""
    reads = json.dumps([subjects.AUTH_CALLOUT, subjects.IDENTITY_REDIS])
    grant_text = f'{{ publish: {{ deny: [">"] }}, subscribe: {{ allow: {reads} }}, allow_responses: true }}'
    return ("authorization {\n  users: [\n"
            f"    {{ user: {json.dumps(OPERATOR)}, password: {_literal(operator_password)} }}\n"
            f"    {{ nkey: {_literal(issuer_nkey)}, permissions: {grant_text} }}\n  ]\n"
            f"  auth_callout {{ issuer: {_literal(issuer_account)}, "
            f"auth_users: [{json.dumps(OPERATOR)}, {_literal(issuer_nkey)}] }}\n}}\n")


def main() -> None:
    """Print the authorization block of a deployment with the identity issuer, every secret read
    from the server's environment (deploy/nats/authorization.conf: compose and Kubernetes include it)."""
    print("# Generated by `python -m pdserve.shared.grants` from pdserve/shared/grants.py: the operator and the\n"
          "# identity issuer are nats-server's users; every other connection is the issuer's to let in (auth callout).")
    print(nats_callout("$PD_NATS_PDSERVE_PASSWORD", "$PD_ISSUER_ACCOUNT", "$PD_ISSUER_NKEY"), end="")


if __name__ == "__main__":
    main()
