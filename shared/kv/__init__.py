"""KV transfer between engines: one interface (base.py), backends `ucx` and `fake`."""

from shared.kv.base import HEADER_BYTES, KVTransport, checksum, make  # noqa: F401
