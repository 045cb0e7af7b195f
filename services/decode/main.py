"""Decode worker: receives a request's KV, generates its tokens in a continuous batch.

1. Start: load the model, build the engine, open the UCX transport, register in Redis with a
   heartbeat lease (free blocks, running sequences, UCX address) — only once all of that
   works — and subscribe to `pd.decode.<id>.admit` and `pd.cancel.*`.
2. Admit (router → here): mode "remote" reserves the prompt's blocks (reusing this worker's
   prefix cache) and replies with the first block to send and a UCX tag, then waits for the
   KV; mode "local" queues the whole prompt here (colocated, or the fallback). No room →
   refuse, so the router tries another worker before any prefill work is spent.
3. KV arrives: its header on `pd.decode.<id>.kv` (NATS), then the layer payloads over UCX,
   received only once the header is here. Check the model fingerprint, the layout and every
   layer's checksum, write the layers into the reserved blocks, join the batch with the first
   token, ack the prefill worker (`pd.kv.ack.<rid>`) so it frees its copy. KV late or bad →
   drop the reservation and prefill locally (no gap for the client: chunks carry sequence
   numbers, the gateway drops duplicates).
4. Loop: step the engine; publish each output as a TokenChunk on `pd.tokens.<rid>`.
5. Cancel: abort the request wherever it is; its blocks return to the pool.
6. SIGTERM: leave the registry, refuse new admits, finish running sequences, drain NATS.
"""

from __future__ import annotations

import asyncio
import logging
import random

import numpy as np
import torch
from nats.aio.msg import Msg
from opentelemetry import trace

from shared import subjects
from shared.bus import Bus, context_of
from shared.config import DecodeSettings
from shared.engine.block_manager import OutOfBlocks
from shared.engine.engine import Engine, RequestOutput
from shared.engine_host import EngineHost
from shared.kv import KVTransport, checksum
from shared.messages import AdmitReply, AdmitRequest, Cancel, KVAck, KVHeader, TokenChunk
from shared.service import heartbeat, run, setup_logging
from shared.worker import serve_worker, worker_id, worker_info
from shared.state import State

log = logging.getLogger("decode")


class DecodeWorker:
    def __init__(self, settings: DecodeSettings, engine: Engine, bus: Bus, state: State,
                 transport: KVTransport, tracer: trace.Tracer):
        self.settings, self.engine, self.bus, self.state = settings, engine, bus, state
        self.transport, self.tracer = transport, tracer
        self.id = worker_id(settings, "decode")
        self.host = EngineHost(engine)
        self.spans: dict[str, trace.Span] = {}
        self.receiving: dict[str, asyncio.Task] = {}
        self.headers: dict[str, asyncio.Future] = {}  # rid -> the KVHeader, once announced
        self.draining = False
        bs, mc = engine.cfg.block_size, engine.model_config
        self.block_nbytes = 2 * bs * mc.num_kv_heads * mc.head_dim * engine.runner.kv.element_size()

    def info(self):
        return worker_info(self.engine, self.id, "decode", self.settings, self.transport.address)

    async def serve(self, stop: asyncio.Event) -> None:
        await self.bus.subscribe(subjects.decode_admit(self.id), self.on_admit)
        await self.bus.subscribe(subjects.decode_kv(self.id), self.on_kv_header)
        await self.bus.subscribe(subjects.CANCEL_ALL, self.on_cancel)
        beat = asyncio.create_task(heartbeat(self.state, self.info, self.settings.heartbeat_s, stop))
        engine_loop = asyncio.create_task(self.host.run(self.publish, stop))
        log.info("decode worker %s ready: %d KV blocks", self.id, self.engine.num_blocks)
        await stop.wait()
        self.draining = True
        await beat
        await self.state.deregister(self.id)
        await engine_loop  # after stop it returns once the running sequences are done
        for task in list(self.receiving.values()):
            task.cancel()
        self.host.close()

    # -- admission ---------------------------------------------------------------------------
    async def on_admit(self, msg: Msg) -> None:
        req = AdmitRequest.decode(msg.data)
        parent = context_of(msg)
        with self.tracer.start_as_current_span("decode.admit", context=parent) as span:
            span.set_attributes({"request_id": req.request_id, "mode": req.mode, "worker": self.id})
            reply = await self.admit(req)
            span.set_attributes({"ok": reply.ok, "reason": reply.reason, "first_block": reply.first_block})
            if reply.ok:
                self.spans[req.request_id] = self.tracer.start_span("decode.generate", context=parent,
                                                                    attributes={"request_id": req.request_id})
            await self.bus.respond(msg, reply)

    async def admit(self, req: AdmitRequest) -> AdmitReply:
        rid, params = req.request_id, req.sampling.to_engine()
        if self.draining:
            return AdmitReply(request_id=rid, ok=False, reason="draining")
        try:
            if req.mode == "local":
                await self.prefill_locally(req)
                return AdmitReply(request_id=rid, ok=True, reason="local prefill")
            res = await self.host.call(self.engine.reserve, rid, req.prompt_token_ids, params)
        except OutOfBlocks as e:
            return AdmitReply(request_id=rid, ok=False, reason=f"no room: {e}")
        except ValueError as e:
            return AdmitReply(request_id=rid, ok=False, reason=str(e))
        kv_tag = random.getrandbits(47) << 16  # low 16 bits number the layers
        self.headers[rid] = asyncio.get_running_loop().create_future()
        self.receiving[rid] = asyncio.create_task(self.receive_kv(req, res.first_block, res.num_blocks, kv_tag))
        return AdmitReply(request_id=rid, ok=True, first_block=res.first_block, num_blocks=res.num_blocks,
                          kv_tag=kv_tag)

    async def prefill_locally(self, req: AdmitRequest) -> None:
        """The whole prompt runs here (colocated mode, or the fallback from a failed handoff)."""
        await self.host.call(self.engine.add_request, req.request_id, req.prompt_token_ids, req.sampling.to_engine())
        self.host.wake.set()

    # -- KV arrival --------------------------------------------------------------------------
    async def on_kv_header(self, msg: Msg) -> None:
        header = KVHeader.decode(msg.data)
        waiter = self.headers.get(header.request_id)
        if waiter is None or waiter.done():  # cancelled, expired or a duplicate
            await self.bus.publish(subjects.kv_ack(header.request_id),
                                   KVAck(request_id=header.request_id, ok=False, error="no reservation"))
            return
        waiter.set_result(header)

    async def receive_kv(self, req: AdmitRequest, first_block: int, num_blocks: int, kv_tag: int) -> None:
        rid = req.request_id
        deadline = asyncio.get_running_loop().time() + self.settings.kv_timeout_s
        try:
            header = await asyncio.wait_for(self.headers[rid], self.settings.kv_timeout_s)
            self.check_layout(header, first_block, num_blocks)
            remaining = deadline - asyncio.get_running_loop().time()
            layers = await asyncio.wait_for(
                self.transport.receive(kv_tag, header.num_layers, header.layer_nbytes), remaining)
            self.verify(header, layers)
            for i, payload in enumerate(layers):
                await self.host.call(self.engine.import_layer, rid, i, torch.from_numpy(payload), first_block)
            out = await self.host.call(self.engine.commit_import, rid, header.first_token)
            await self.bus.publish(subjects.kv_ack(rid), KVAck(request_id=rid, ok=True))
            if out.finished:
                await self.publish([out])
            self.host.wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # late, corrupt or mismatched KV: never decode from it
            reason = "deadline passed" if isinstance(e, asyncio.TimeoutError) else str(e) or type(e).__name__
            log.warning("%s: KV handoff failed (%s); prefilling locally", rid, reason)
            await self.bus.publish(subjects.kv_ack(rid), KVAck(request_id=rid, ok=False, error=reason))
            await self.host.call(self.engine.abort, rid)
            await self.prefill_locally(req)
        finally:
            self.receiving.pop(rid, None)
            self.headers.pop(rid, None)

    def check_layout(self, header: KVHeader, first_block: int, num_blocks: int) -> None:
        if header.fingerprint != self.engine.fingerprint:
            raise ValueError(f"model fingerprint {header.fingerprint} != {self.engine.fingerprint}")
        expected = (self.engine.model_config.num_layers, (num_blocks - first_block) * self.block_nbytes, first_block)
        got = (header.num_layers, header.layer_nbytes, header.first_block)
        if got != expected:
            raise ValueError(f"KV layout (layers, bytes, first block) {got} != reserved {expected}")

    def verify(self, header: KVHeader, layers: list[np.ndarray]) -> None:
        for i, payload in enumerate(layers):
            if checksum(payload) != header.checksums[i]:
                raise ValueError(f"checksum mismatch in layer {i}")

    # -- output and cancellation -----------------------------------------------------------
    async def publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            await self.bus.publish(subjects.tokens(out.request_id), TokenChunk.from_output(out))
            if out.finished and (span := self.spans.pop(out.request_id, None)) is not None:
                span.set_attributes({"output_tokens": out.num_generated_tokens,
                                     "finish_reason": out.finish_reason or ""})
                span.end()

    async def on_cancel(self, msg: Msg) -> None:
        rid = Cancel.decode(msg.data).request_id
        task = self.receiving.pop(rid, None)
        if task is not None:  # release the prefill side's lease now rather than at its deadline
            task.cancel()
            await self.bus.publish(subjects.kv_ack(rid), KVAck(request_id=rid, ok=False, error="cancelled"))
        if task is not None or rid in self.engine.seqs:
            await self.host.call(self.engine.abort, rid)
        if (span := self.spans.pop(rid, None)) is not None:
            span.add_event("cancelled")
            span.end()


def main() -> None:
    settings = DecodeSettings()
    setup_logging(settings.log_level, "decode")
    run(serve_worker("decode", settings, DecodeWorker))


if __name__ == "__main__":
    main()
