"""What a weights' format costs in quality, against the fp32 reference (transformers on the same
GGUF, an independent implementation): `make bench-engine` reports both.

- Greedy agreement: the reference's greedy continuation of each engine test prompt
  (pdserve/shared/tools/held_prompts.py) and of a longer held text; the share of its tokens that the
  model under test also ranks first given the same prefix (teacher-forced, so one early
  difference does not count every token after it).
- Perplexity of a few thousand tokens of English prose shipped with Python (the interpreter's
  own help topics, `pydoc_data.topics`), in windows of WINDOW tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pdserve.shared.engine.batch import ForwardBatch
from pdserve.shared.engine.kernels import select
from pdserve.shared.engine.loader import LoadedModel
from pdserve.shared.tools.held_prompts import CONVERSATIONS

WINDOW = 512
HELD_TOPICS = ("assignment", "exceptions", "function", "class", "import", "for", "while", "if", "try", "with")


def held_text() -> str:
    """Python's help topics on its statements: prose and code, shipped with the interpreter."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[t] for t in HELD_TOPICS)


def logits_all(loaded: LoadedModel, ids: list[int], start: int = 0) -> torch.Tensor:
    """Next-token logits (n - start, vocab) at every position from `start` of one prefill of `ids`."""
    cfg, n, bs = loaded.config, len(ids), 16
    blocks = -(-n // bs)
    kv = torch.zeros((cfg.num_layers, blocks, 2, bs, cfg.num_kv_heads, cfg.head_dim),
                     dtype=loaded.decoder.embed_tokens.weight.dtype)
    every = torch.arange(n)
    batch = ForwardBatch(torch.tensor(ids), every, every, every[start:],
                         chunks=[(0, n, n, torch.arange(blocks))])
    return loaded.model(batch, kv, select("torch", "cpu"))


def prompts(loaded: LoadedModel, held_tokens: int = 384) -> dict[str, list[int]]:
    """The engine test prompts as the chat template renders them (their messages' text, one a
    line, for a model without one), and a stretch of the held text."""
    tok = loaded.tokenizer
    assert tok is not None
    render = tok.apply_chat_template if tok.chat_template else lambda msgs: "\n".join(m["content"] for m in msgs)
    out = {name: tok.encode(render(msgs)) for name, msgs in CONVERSATIONS.items()}
    out["held text"] = tok.encode(held_text())[:held_tokens]
    return out


def reference_greedy(hf_model, ids: list[int], new: int) -> list[int]:
    """transformers' greedy continuation (its own KV cache)."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), use_cache=True)
        got = [int(out.logits[0, -1].argmax())]
        for _ in range(new - 1):  # (no forward pass past the last token)
            out = hf_model(torch.tensor([got[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            got.append(int(out.logits[0, -1].argmax()))
    return got


def agreement(loaded: LoadedModel, ids: list[int], continuation: list[int]) -> tuple[int, int]:
    """(tokens of `continuation` this model also ranks first after the same prefix, tokens)."""
    logits = logits_all(loaded, ids + continuation[:-1], start=len(ids) - 1)
    return int((logits.argmax(-1) == torch.tensor(continuation)).sum()), len(continuation)


def perplexity(logits_of, ids: list[int], window: int = WINDOW) -> float:
    """exp(mean negative log-likelihood) of `ids` in consecutive windows; `logits_of(window_ids)`
    gives (n, vocab) logits at every position."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        part = ids[start:start + window]
        if len(part) < 2:
            break
        logits = logits_of(part)[:-1].float()
        nll += float(F.cross_entropy(logits, torch.tensor(part[1:]), reduction="sum"))
        count += len(part) - 1
    return math.exp(nll / count)


def hf_logits(hf_model):
    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf_model(torch.tensor([ids])).logits[0]
    return run


def measure(formats: dict[str, LoadedModel], hf_model, new_tokens: int = 64, ppl_tokens: int = 4096) -> dict:
    """Agreement with the reference's greedy tokens and perplexity, per weights' format."""
    base = next(iter(formats.values()))
    assert base.tokenizer is not None
    cases = prompts(base)
    ref = {name: reference_greedy(hf_model, ids, new_tokens) for name, ids in cases.items()}
    text = base.tokenizer.encode(held_text())[:ppl_tokens]
    out: dict = {"reference": "transformers fp32 on the same GGUF", "held_text": f"pydoc_data.topics {HELD_TOPICS}",
                 "new_tokens": new_tokens, "perplexity_tokens": len(text), "window": WINDOW,
                 "reference_perplexity": perplexity(hf_logits(hf_model), text), "formats": {}}
    for name, loaded in formats.items():
        per = {case: agreement(loaded, ids, ref[case]) for case, ids in cases.items()}
        same = sum(a for a, _ in per.values())
        total = sum(n for _, n in per.values())
        ppl = perplexity(lambda ids, m=loaded: logits_all(m, ids), text)
        out["formats"][name] = {"greedy_agreement": same / total, "per_prompt": {c: a / n for c, (a, n) in per.items()},
                                "perplexity": ppl, "perplexity_ratio": ppl / out["reference_perplexity"]}
    return out
