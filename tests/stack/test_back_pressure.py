"""Back-pressure on the live stack: a client that reads nothing of its stream is cut off after
PD_SEND_DEADLINE_S, and its request is cancelled as a client that disconnects is — the KV freed
on the prefill and the decode worker. (What the gateway holds meanwhile is bounded per choice:
tests/unit/test_gateway_pending.py.) On the fake model (tests/stack/conftest.py): the path is
what is tested, not the model's numbers."""

from __future__ import annotations

import json
import socket
import time

import pytest
from conftest import FAKE, MODEL, fake_env

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.state import request_key, worker_key
from pdserve.shared.urls import sync_redis

pytestmark = pytest.mark.slow
DEADLINE_S = 1.0
WORKERS = ("prefill-0", "decode-0")


def unread_stream(url: str, body: dict) -> tuple[socket.socket, str]:
    """A streamed request whose client reads its answer's head, then nothing: its socket and
    the request's id."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    rid = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
               if line.lower().startswith(b"x-request-id:"))
    return sock, rid


def test_a_client_that_reads_nothing_is_cut_off_and_its_kv_freed_on_both_workers(tmp_path):
    """16 choices with 20 log probabilities a token (~25 KB of frames a step) fill the
    connection's buffers in a few hundred steps; the client reads none of it. Within the send
    deadline (plus the time to fill them) the gateway closes the connection and counts it, the
    request's choices are cancelled, and both workers' KV pools are whole again while the
    answer had tokens to go."""
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=2048, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(PD_PLACEMENT="remote", PD_SEND_DEADLINE_S=str(DEADLINE_S)))
    body = {"model": MODEL, "stream": True, "n": 16, "max_tokens": 1500, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 20, "messages": [{"role": "user", "content": "Tell a long story."}]}
    with Stack(cfg) as stack:
        store = sync_redis(stack.redis_url)

        def pools() -> dict[str, tuple[int, int, int]]:
            return {w: (e["free_blocks"], e["total_blocks"], e["running"]) for w in WORKERS
                    if (e := json.loads(store.get(worker_key(w)) or "{}"))}

        sock, rid = unread_stream(stack.url, body)
        with sock:
            started, cut, used = time.monotonic(), None, dict.fromkeys(WORKERS, 0)
            while cut is None and time.monotonic() - started < 30:
                for w, (free, total, _) in pools().items():
                    used[w] = max(used[w], total - free)
                if stack.metric_total("gateway", "pd_send_deadline_closes_total") >= 1:
                    cut = time.monotonic() - started
                time.sleep(0.2)
            while time.monotonic() - started < 40 and any(f != t or r for f, t, r in pools().values()):
                time.sleep(0.2)
            whole, freed = pools(), time.monotonic() - started
        record = {k.decode(): v.decode() for k, v in store.hgetall(request_key(rid)).items()}
    print(f"cut off {cut} s after its head, pools whole {freed:.1f} s after it (most blocks used before: {used}); "
          f"{record.get('tokens')} tokens of choice 0 streamed")
    assert cut is not None, "the connection was never cut"
    assert used["decode-0"] > 0 and all(f == t and r == 0 for f, t, r in whole.values()), (used, whole)
    assert record.get("phase") == "cancelled", record
    assert int(record.get("tokens", 0)) < body["max_tokens"], record
