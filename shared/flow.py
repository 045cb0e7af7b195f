"""The map: one request's path through pdserve, step by step, with the subject and the file
that handles each step. (Documentation only; nothing to import.)

 1. HTTP in — services/gateway/middleware.py gives the request an id and opens the root span;
    services/gateway/schemas.py validates the body (4xx in OpenAI's shape: errors.py);
    services/gateway/generate.py renders the chat template, tokenizes, checks the context.
 2. services/gateway/relay.py subscribes to `pd.tokens.<rid>` *before* anything can produce a
    token, then asks `pd.router.route` (RouteRequest → RouteReply).
 3. services/router/main.py reads the live workers (shared/state.py, `pd:worker:*`, leases),
    asks services/router/policy.py where to prefill and which decode worker to try first.
 4. Admit: `pd.decode.<w>.admit` (AdmitRequest → AdmitReply). services/decode/main.py
    reserves the prompt's KV blocks (shared/engine/engine.py `reserve`), reusing its prefix
    cache: `first_block` says how many it already has. Refused → the router tries the next.
    Mode "local": the decode worker queues the whole prompt itself (colocated / fallback).
 5. Remote: the router puts a PrefillJob on JetStream `pd.prefill.jobs.<p>` (stream
    PD_PREFILL, work queue), records `pd:req:<rid>` and replies to the gateway.
 6. services/prefill/main.py pulls the job, runs the prompt (`prefill_only=True`), publishes
    the first token on `pd.tokens.<rid>` (seq 0) at once.
 7. Handoff: export the blocks from `first_block` on (kv_io.py), publish a KVHeader on
    `pd.decode.<w>.kv` (fingerprint, layout, checksums, first token), send the layers over
    UCX (shared/kv/ucx.py, tags kv_tag+1+layer), wait for `pd.kv.ack.<rid>`, free, ack the job.
 8. services/decode/main.py posts the UCX receives when the header arrives, verifies
    fingerprint, layout and checksums, imports the layers, commits with the first token, acks.
    Late or bad KV → local prefill (the gateway drops the duplicate seq 0).
 9. Decode steps the continuous batch (shared/engine_host.py runs the engine on one thread)
    and publishes TokenChunks (seq = index of the first token in the chunk).
10. The gateway relays chunks in seq order (duplicates dropped) as SSE or one JSON body.
    A client that leaves → `pd.cancel.<rid>`: both workers abort and free the blocks.

Trace: gateway.request → router.route → decode.admit, prefill.queue, prefill.compute →
kv.transfer; decode.generate. Context rides in NATS headers (shared/tracing.py).
"""
