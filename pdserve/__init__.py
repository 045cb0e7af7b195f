"""pdserve: LLM serving with prefill/decode disaggregation.

`pdserve.services` (gateway, router, prefill, decode, issuer), `pdserve.shared` (what they share: the bus,
the store, the engine, the KV transports), `pdserve.local` (the local stack behind `pdserve serve`) and
`pdserve.planner` (pool sizes from a workload and its objectives)."""
