"""Redis keys (prefix `pd:`): the names every subject of the state (pdserve/shared/state/) and its
readers use. A name's `{...}` is its hash tag: on a Redis Cluster the keys one script touches
share a tag, so they share a slot (and a node).

    pd:{registry}:worker:<id>  WorkerInfo JSON, expires with the heartbeat lease (a dead worker vanishes)
    pd:{registry}:workers      set: the ids registered (read with their entries in one call; never a
                               keyspace scan)
    pd:{registry}:seq|changes|epoch  the registry's change log (pdserve/shared/state/registry.py)
    pd:req:{<id>}              hash: the latest event recorded (`phase`), the fields (mode, reason,
                               workers) and a timestamp per phase (expires PD_HISTORY_S after the request
                               ends; while in flight, a day after its latest event)
    pd:req:{<id>}:log          list: the request's events in order of arrival (pdserve/shared/lifecycle.py;
                               expires with the hash)
    pd:req:{<id>}:supervisor   the supervisor judging the request now (a lease)
    pd:req:{<id>}:crashes      set: the crashes charged to the request, `worker@life` (pdserve/shared/quarantine.py)
    pd:batch:{<worker>}        WorkerBatch JSON: the requests of the worker's latest engine pass (BATCH_TTL_S)
    pd:{flight}:deadlines      sorted set: requests in flight, scored by when their phase is overdue
    pd:{flight}:ended          sorted set: requests that ended in the last ENDED_KEEP_S, by when
    pd:{flight}:owned:<gw>     set: requests whose client is connected to gateway <gw>
    pd:{flight}:gateways       set: gateways with requests filed (what the supervisor checks)
    pd:session:<id>            the decode worker of a conversation's last turn (expires when idle)
    pd:route:{<id>}            hash: a request's placement as it is decided — its decode worker, then
                               the router's reply (router replicas answer a repeated request from it)
    pd:route:{<id>}:claim      the router placing the request now (expires: a dead router's lapses)
    pd:prefix:*                the prefix index when PD_PREFIX_INDEX=redis (pdserve/shared/prefix_index.py;
                               a single Redis only)

So the registry is one slot, the requests in flight another, and each request's own keys (the
bulk of the writes) fall wherever its id hashes.
"""

from __future__ import annotations

REQUEST_TTL_S = 24 * 3600  # a request in flight: its own keys outlive its latest event this long
BATCH_TTL_S = 3600         # a worker's pass record: a pass holding the same requests longer is not rewritten
WORKER_PREFIX = "pd:{registry}:worker:"
WORKERS = "pd:{registry}:workers"
REGISTRY_SEQ = "pd:{registry}:seq"          # counts registry changes (heartbeats, departures)
REGISTRY_CHANGES = "pd:{registry}:changes"  # sorted set: worker id by the number of its latest change
REGISTRY_EPOCH = "pd:{registry}:epoch"      # set with the first change: a Redis that restarted empty has another
DEADLINES = "pd:{flight}:deadlines"
ENDED = "pd:{flight}:ended"         # requests that ended lately, by when: no deadline is set for them again
ENDED_KEEP_S = 60                   # past a late deadline push (a heartbeat's, a supervisor's round)
GATEWAYS = "pd:{flight}:gateways"   # gateways that have filed requests (the supervisor's list to check)


def worker_key(worker_id: str) -> str:
    return WORKER_PREFIX + worker_id


def request_key(request_id: str) -> str:
    return f"pd:req:{{{request_id}}}"


def log_key(request_id: str) -> str:
    return request_key(request_id) + ":log"


def supervisor_key(request_id: str) -> str:
    return request_key(request_id) + ":supervisor"


def crashes_key(request_id: str) -> str:
    return request_key(request_id) + ":crashes"


def batch_key(worker_id: str) -> str:
    return f"pd:batch:{{{worker_id}}}"


def placement_key(request_id: str, attempt: int) -> str:
    """A placement's name in the routers' records: a failover's is a new placement."""
    return f"{request_id}#{attempt}" if attempt else request_id


def owned_key(gateway_id: str) -> str:
    return f"pd:{{flight}}:owned:{gateway_id}"


def session_key(session_id: str) -> str:
    return f"pd:session:{session_id}"


def route_key(request_id: str) -> str:
    return f"pd:route:{{{request_id}}}"


def claim_key(request_id: str) -> str:
    return route_key(request_id) + ":claim"
