"""The map: one request's path through pdserve, step by step, with the subject and the file
that handles each step. (Documentation only; nothing to import.)

 1. HTTP in — pdserve/services/gateway/middleware.py gives the request an id and opens the root span;
    pdserve/services/gateway/schemas.py validates the body (4xx in OpenAI's shape: errors.py);
    pdserve/services/gateway/generate.py renders the chat template, tokenizes, checks the context.
 2. pdserve/services/gateway/relay.py subscribes to `pd.tokens.<rid>` *before* anything can produce a
    token, then asks `pd.router.route` (RouteRequest → RouteReply).
 3. pdserve/services/router/main.py claims the request (`pd:route:{<rid>}`: a repeat, to any replica,
    gets the same placement), takes the live workers as last read (pdserve/shared/state/registry.py, the
    `pd:{registry}:workers` set and leases; pdserve/services/router/pools.py), looks the prompt up in the prefix
    index (pdserve/shared/prefix_index.py) and asks pdserve/services/router/policy.py where to prefill and
    which decode worker to try first.
 4. Admit: `pd.decode.<w>.admit` (AdmitRequest → AdmitReply). pdserve/services/decode/main.py
    reserves the prompt's KV blocks (pdserve/shared/engine/engine.py `reserve`), reusing its prefix
    cache: `first_block` says how many it already has. Refused → the router tries the next.
    Mode "local": the decode worker queues the whole prompt itself (colocated / fallback).
 5. Remote: the decode worker, after its reply, puts a PrefillJob on JetStream
    `pd.prefill.jobs.<p>` (stream PD_PREFILL, work queue) for the prefill worker the admit
    named; the router replies to the gateway and records `pd:req:{<rid>}` in the background.
 6. pdserve/services/prefill/main.py pulls the job, opens a KV handoff (pdserve/shared/kv/sender.py; refused
    at once if the decode worker's fingerprint differs) and runs the prompt
    (`prefill_only=True`, `stream_kv`); the first token goes out on `pd.tokens.<rid>` (seq 0)
    as soon as the last pass ends.
 7. Handoff, during the prefill: as the layers of each pass are computed (several in one
    message, up to PD_KV_PIECE_BYTES), a KVLayer notice on
    `pd.decode.<w>.kv` (layers, block range, per-block checksums, tag) and the payload over UCX
    (pdserve/shared/kv/ucx.py) — or, to a decode worker on the same host, the payload written into the
    prefill worker's shared-memory segment, where the notice says (pdserve/shared/kv/segment.py);
    KVEnd on `pd.decode.<w>.kv.end` with the first token; re-sends on
    `pd.prefill.<p>.kv.resend`; the blocks are freed at `pd.prefill.<p>.kv.ack` (or the lease).
 8. pdserve/services/decode/main.py (pdserve/shared/kv/receiver.py) posts each receive when its notice
    arrives (or copies the payload out of the segment), verifies fingerprint, range and
    every block's checksum, writes good blocks into the reservation, commits with the first
    token, acks. Late or bad KV → local prefill
    (the gateway drops the duplicate seq 0).
 9. Decode steps the continuous batch (pdserve/shared/engine_host.py runs the engine on one thread)
    and publishes TokenChunks (seq = index of the first token in the chunk).
10. The gateway relays chunks in seq order (duplicates dropped) as SSE or one JSON body.
    A client that leaves → `pd.decode.<w>.cancel` and `pd.prefill.<p>.cancel` (the workers of
    each of its placements, no others: pdserve/shared/holders.py): both abort and free the blocks.

Trace: gateway.request → router.route → decode.admit, prefill.queue, prefill.compute,
kv.transfer (alongside the compute); decode.generate → kv.receive. Context rides in NATS headers
(pdserve/shared/tracing.py).
"""
