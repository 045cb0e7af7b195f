"""KV transport over UCX (ucxx): tagged messages between worker addresses.

Endpoints are made from the peer's exchanged worker address with UCX's peer-failure handling
(`error_handling`, the default): a peer killed mid-transfer fails that transfer on this side
with an error, and nothing else. UCX then selects only transports that declare they detect a
dead peer. Its shared-memory transports declare it only when asked (SHM_DEFAULTS, applied
unless the environment says otherwise): sysv/posix for small messages and rendezvous control
(`UCX_MM_ERROR_HANDLING`: a peer is dead when its process is gone) and cma for the payloads —
the receiver reads the sender's buffer with one process_vm_readv (`UCX_CMA_MEMORY_INVALIDATE`;
UCX 1.21 does not yet revoke that access when an endpoint fails, so a receiver could read a
buffer its failed sender already reused: KV blocks are checksummed before they are used).
Without them two processes on one host talk over TCP on loopback (`make bench-transfer`:
ucx_services vs ucx_peer_tcp). Between hosts UCX uses TCP (or RDMA where there is some).

Without error handling UCX picks shared memory too, but a sender killed while several
rendezvous transfers to a receiver are in flight crashes the receiver (SIGSEGV in
ucp_proto_rndv_send_reply, UCX 1.21; reproduced by tests/integration/test_ucx_peer_failure.py):
one dead prefill worker would take down every decode worker it was sending to.

A UCX request reads or writes its buffer until UCX completes it, and ucxx cannot cancel one:
cancelling the coroutine that awaits it leaves the request running. So every request runs in
a task this transport holds, with its buffer, until it completes; callers await it shielded.
A receive whose caller gave up and whose message never comes (its sender died between the
notice and the send) is retired after `orphan_grace_s` with a one-byte message to itself on
that tag. Before this, a receive cancelled with its message still on the way wrote into freed
memory: heap corruption, aborts and hung event loops in decode workers under cancellations.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import numpy as np
import ucxx
from ucxx._lib_async import Endpoint

from pdserve.shared.kv.base import Faults, KVTransport
from pdserve.shared.tasks import Background

log = logging.getLogger("kv.ucx")


# UCX over TCP (another host without RDMA) with its default 8 KiB segments moved 0.8 GB/s
# between two processes here; 512 KiB segments and 8 MiB socket buffers 2.0-2.2 GB/s (16-64
# MiB payloads; a plain socket does 4.4). Applied unless the environment says otherwise.
TCP_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k",
                "UCX_TCP_SNDBUF": "8m", "UCX_TCP_RCVBUF": "8m"}
# Shared memory with peer-failure handling (see above): sysv/posix declare it with
# MM_ERROR_HANDLING, cma's zero-copy reads with CMA_MEMORY_INVALIDATE.
SHM_DEFAULTS = {"UCX_MM_ERROR_HANDLING": "y", "UCX_CMA_MEMORY_INVALIDATE": "y"}


class UcxTransport(KVTransport):
    name = "ucx"

    def __init__(self, progress_mode: str = "thread", faults: Faults | None = None,
                 error_handling: bool = True, orphan_grace_s: float = 5.0) -> None:
        super().__init__(faults)
        self.error_handling, self.orphan_grace_s = error_handling, orphan_grace_s
        # UCX requests not completed yet, with their buffers (failures: their callers' to report)
        self.requests = Background(log, "UCX request", logging.DEBUG)
        self.retired = 0                          # receives completed by this side after their caller left
        # Measured here, 64 MiB between two processes: "blocking" and "polling" reach 17-18
        # GB/s but then keep both processes at ~100% CPU after a transfer; "thread" reaches
        # 8.5 GB/s and idles at ~2%.
        for key, value in {**TCP_DEFAULTS, **SHM_DEFAULTS}.items():  # read when the UCX context is made
            os.environ.setdefault(key, value)
        threaded = progress_mode.startswith("thread")
        try:
            # Python futures: a notifier thread completes each request's future. Without them
            # ucxx awaits a request by polling it with asyncio.sleep(0), which keeps the event
            # loop (and the GIL) busy for as long as any receive or send is open: 30-50 ms of
            # CPU per short request on each side, taken from the engine thread.
            ucxx.init(progress_mode=progress_mode, enable_python_future=threaded)
        except RuntimeError:  # one UCX context per process: already made, keep it
            pass
        else:
            if threaded:  # its notifier thread would otherwise keep the process from exiting
                # runs before Python joins threads (a private hook of `threading`, stable since 3.9)
                threading._register_atexit(ucxx.stop_notifier_thread)  # type: ignore[attr-defined]
        self._address = bytes(ucxx.get_worker_address()).hex()
        self._endpoints: dict[str, Endpoint] = {}

    @property
    def address(self) -> str:
        return self._address

    async def _endpoint(self, peer: str) -> Endpoint:
        ep = self._endpoints.get(peer)
        if ep is None:
            addr = ucxx.get_ucx_address_from_buffer(bytes.fromhex(peer))
            ep = await ucxx.create_endpoint_from_worker_address(addr, endpoint_error_handling=self.error_handling)
            self._endpoints[peer] = ep
        return ep

    def has_endpoint(self, peer: str) -> bool:
        return peer in self._endpoints

    async def _send(self, peer: str, tag: int, payload: np.ndarray) -> None:
        ep = await self._endpoint(peer)
        try:
            await asyncio.shield(self.requests.start(ep.send(payload, tag=tag, force_tag=True)))
        except asyncio.CancelledError:
            raise  # the send goes on, holding its payload; a dead peer's endpoint is dropped by forget()
        except Exception:
            self._endpoints.pop(peer, None)  # never reuse an endpoint that failed
            raise

    async def forget(self, peer: str) -> None:
        ep = self._endpoints.pop(peer, None)
        if ep is not None:
            try:
                await ep.close()
            except Exception:  # noqa: BLE001 - already broken: dropping our reference is all that is left
                pass

    async def recv(self, tag: int, out: np.ndarray) -> None:
        request = self.requests.start(ucxx.recv(out, tag=tag))
        try:
            await asyncio.shield(request)
        except asyncio.CancelledError:
            if not request.done():
                asyncio.get_running_loop().call_later(self.orphan_grace_s, self._retire, tag, request)
            raise

    def _retire(self, tag: int, request: asyncio.Task) -> None:
        """Complete a receive nobody awaits any more: its message never came."""
        if request.done():
            return
        self.retired += 1
        log.info("retiring a KV receive on tag %#x: no message %.0f s after its caller left", tag, self.orphan_grace_s)
        self.requests.start(self._send(self._address, tag, np.zeros(1, dtype=np.uint8)))

    async def close(self) -> None:
        for ep in self._endpoints.values():
            try:
                await ep.close()
            except Exception:  # noqa: BLE001 - the peer may already be gone; nothing to release on our side
                pass
        self._endpoints.clear()
