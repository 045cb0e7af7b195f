"""Chat with a model through the engine in this process: `python -m pdserve.shared.engine.cli "Hi"`."""

from __future__ import annotations

import argparse
import sys
import time

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.engine.weights import SETTINGS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("prompt")
    ap.add_argument("--model", default="smollm2", help="smollm2, a .gguf path or a safetensors directory")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--weights", choices=SETTINGS, default="auto",
                    help="native: the GGUF's own blocks as they are; fp32: dequantized; auto: native for a GGUF on CPU")
    args = ap.parse_args()

    loaded = load(args.model, weights=args.weights)
    engine = Engine(loaded, EngineConfig(num_blocks=1024))
    assert loaded.tokenizer is not None, "the model file has no tokenizer"
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    ids = loaded.tokenizer.encode(prompt)
    engine.add_request("cli", ids, SamplingParams(max_tokens=args.max_tokens,
                                                  temperature=args.temperature, seed=args.seed))
    start, n, out = time.perf_counter(), 0, None
    while engine.has_work():
        for out in engine.step():
            n += len(out.new_token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    print(f"\n[{len(ids)} prompt tokens, {n} generated in {elapsed:.2f}s, finish: {out.finish_reason if out else '-'}]",
          file=sys.stderr)


if __name__ == "__main__":
    main()
