"""KV transfer between engines: one interface (base.py), backends `ucx` and `fake`; the
handoff protocol on top of it: sender.py (prefill side), receiver.py (decode side)."""

from pdserve.shared.kv.base import TAG_SPAN, Faults, KVTransport, block_checksums, checksum, create_transport  # noqa: F401
