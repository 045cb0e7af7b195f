"""KV transfer between engines: one interface (base.py), backends `ucx` and `fake`."""

from shared.kv.base import KVTransport, checksum, layer_tag, make  # noqa: F401
