"""The gateway's connections (pdserve/services/gateway/connections.py) on a real uvicorn server: a
connection that sends nothing, or trickles its request's headers, is closed after the head
deadline; a request whose head arrives in time is served however long its body and answer
take, and an idle keep-alive connection outlives the head deadline."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from pdserve.local.servers import free_port, wait_for_port
from pdserve.services.gateway import connections

HEAD_TIMEOUT_S = 0.6


async def _slow_app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port():
    port = free_port()
    config = uvicorn.Config(_slow_app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=30,
                            http=connections.protocol(HEAD_TIMEOUT_S))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for_port(port)
    yield port
    server.should_exit = True
    thread.join(5)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reading what it sends until then)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _request(sock: socket.socket) -> bytes:
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    return sock.recv(4096)


def test_a_connection_that_sends_nothing_is_closed_after_the_head_deadline(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        started = time.monotonic()
        assert _closed_within(s, 5)
        assert time.monotonic() - started >= HEAD_TIMEOUT_S * 0.9


def test_trickled_headers_are_cut_off(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        started = time.monotonic()
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(HEAD_TIMEOUT_S / 10)
        assert _closed_within(s, 5)
        assert time.monotonic() - started < HEAD_TIMEOUT_S * 4   # not after all 56 bytes' 3.4 s


def test_a_head_in_time_is_served_and_its_body_may_take_longer(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        time.sleep(HEAD_TIMEOUT_S * 1.5)
        s.sendall(b"cd")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_an_idle_keep_alive_connection_outlives_the_head_deadline(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        assert _request(s).startswith(b"HTTP/1.1 200")
        assert not _closed_within(s, HEAD_TIMEOUT_S * 2)
        assert _request(s).startswith(b"HTTP/1.1 200")   # the same connection, reused
