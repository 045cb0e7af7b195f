"""What the security measures cost per unit of work, each beside what it adds to, on this
machine: a prompt's block hashes with BLAKE2b-64 (pdserve/shared/hashing.py) against xxh3-64, the
hash it replaces; a token chunk's MAC, signing and opening (pdserve/shared/macs.py) against a chunk's
plain encoding and decoding. Writes bench/results/security.json (`make bench-security`, ~20 s).

    python -m bench.security [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from bench.scale.index_compare import machine
from pdserve.shared import hashing, macs
from pdserve.shared.messages import TokenChunk

PROMPT_TOKENS, BLOCK = 4096, 16


def best_us(f: Callable[[], object], number: int, repeat: int = 7) -> float:
    """Microseconds per call: the best of `repeat` rounds (the least disturbed by anything else)."""
    return min(timeit.repeat(f, number=number, repeat=repeat)) / number * 1e6


def xxh3_hashes(tokens: list[int], block: int) -> list[int]:
    """pdserve/shared/hashing.py's chain with xxh3-64 in place of BLAKE2b-64."""
    data, step, out, parent = np.asarray(tokens, dtype="<i4").tobytes(), 4 * block, [], 0
    for start in range(0, (len(tokens) // block) * step, step):
        parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + data[start:start + step])
        out.append(parent)
    return out


def hashes() -> dict:
    tokens = np.random.default_rng(0).integers(0, 49152, PROMPT_TOKENS).tolist()   # (ints, as a prompt arrives)
    blake = best_us(lambda: hashing.block_hashes(tokens, BLOCK), 200)
    xxh3 = best_us(lambda: xxh3_hashes(tokens, BLOCK), 200)
    return {"prompt_tokens": PROMPT_TOKENS, "block_size": BLOCK, "blake2b_64_us": round(blake, 1),
            "xxh3_64_us": round(xxh3, 1), "blake2b_per_token_us": round(blake / PROMPT_TOKENS, 4)}


def chunks() -> dict:
    secret, rid = macs.new_secret(), "9f" * 16
    chunk = TokenChunk(request_id=rid, seq=7, token_ids=[1234], text=" token", worker="decode-0", attempt=1)
    signed = macs.sign(chunk, secret)
    data = chunk.encode()
    return {"encode_us": round(best_us(chunk.encode, 20000), 2),
            "decode_us": round(best_us(lambda: TokenChunk.decode(data), 20000), 2),
            "mac_us": round(best_us(lambda: macs.mac(secret, data), 20000), 2),
            "sign_us": round(best_us(lambda: macs.sign(chunk, secret), 20000), 2),
            "open_us": round(best_us(lambda: macs.opened(rid, {1: secret}, signed.data, signed.mac), 20000), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/security.json")
    args = ap.parse_args()
    h, c = hashes(), chunks()
    summary = {"block_hashes_blake2b_over_xxh3": round(h["blake2b_64_us"] / h["xxh3_64_us"], 2),
               "block_hashes_blake2b_us_per_4k_prompt": h["blake2b_64_us"],
               "chunk_signed_over_encoded": round(c["sign_us"] / c["encode_us"], 2),
               "chunk_opened_over_decoded": round(c["open_us"] / c["decode_us"], 2),
               "chunk_mac_us": c["mac_us"]}
    out = {"machine": machine(), "block_hashes": h, "token_chunk": c, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
