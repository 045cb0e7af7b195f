"""The gateway's connections (pdserve/services/gateway/connections.py) on a real uvicorn server: a
connection that sends nothing, or trickles its request's headers, is closed after the head
deadline; a request whose head arrives in time is served however long its body and answer
take, and an idle keep-alive connection outlives the head deadline."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

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


def _serving(app, **config) -> Iterator[int]:
    """`app` served by uvicorn on a thread (`config`: uvicorn.Config's), its port yielded until the end."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for_port(port)
    yield port
    server.should_exit = True
    thread.join(5)


@pytest.fixture(scope="module")
def port():
    yield from _serving(_slow_app, log_level="warning", timeout_keep_alive=30,
                        http=connections.protocol(HEAD_TIMEOUT_S))


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


SEND_DEADLINE_S = 2.0  # (longer than a pause of this process: a collection of the suite's heap, a busy machine)
STREAM_ENDS: list[str] = []   # how each request to the streaming app ended


async def _streaming_app(scope, receive, send):
    """64 KiB frames until the client is gone; notes how the request ended."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    sent = 0
    try:
        while sent < 64 << 20:
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            sent += 65536
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        STREAM_ENDS.append("done")
    except BaseException:
        STREAM_ENDS.append("cancelled")
        raise
    if (await receive())["type"] == "http.disconnect":   # (uvicorn: a send to a closed connection is dropped)
        STREAM_ENDS[-1] = "disconnected"


@pytest.fixture(scope="module")
def streaming_port():
    yield from _serving(_streaming_app, log_level="error", http=connections.protocol(HEAD_TIMEOUT_S, SEND_DEADLINE_S))


def _streaming_request(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # (the kernel's buffers fill at once)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return s


def test_a_client_that_takes_nothing_is_cut_off_after_the_send_deadline(streaming_port):
    """It reads nothing: the server's writes pause, and SEND_DEADLINE_S later the connection is
    closed (reset) and the app sees the client gone."""
    STREAM_ENDS.clear()
    with _streaming_request(streaming_port) as s:
        started = time.monotonic()
        time.sleep(SEND_DEADLINE_S * 1.5)   # reading nothing
        assert _closed_within(s, 5)
        waited = time.monotonic() - started
    deadline = time.monotonic() + 5
    while not STREAM_ENDS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert STREAM_ENDS and STREAM_ENDS[0] != "done", STREAM_ENDS
    assert waited < SEND_DEADLINE_S * 1.5 + 2


def test_a_client_that_reads_slowly_is_not_cut_off(streaming_port):
    """It takes 64 KiB every 0.1 s, far slower than the app sends: the writes pause and resume,
    never paused a whole SEND_DEADLINE_S, so the stream goes on."""
    STREAM_ENDS.clear()
    with _streaming_request(streaming_port) as s:
        s.settimeout(SEND_DEADLINE_S)
        got, until = 0, time.monotonic() + SEND_DEADLINE_S * 2
        while time.monotonic() < until:
            data = s.recv(65536)
            assert data, "closed"
            got += len(data)
            time.sleep(0.1)
        ended = list(STREAM_ENDS)   # (read before this client closes: its own close ends the stream too)
    assert got > 64 * 1024 and not ended, ended
