"""PD_KV_TRANSPORT=none: no UCX in the workers; on one host the prefill worker's segment carries
every KV payload, and a remotely prefilled request's stream is exactly the in-process engine's.
On the fake model (tests/stack/conftest.py): the KV path is what is tested, not the numbers."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import FAKE, MODEL, fake_env
from helpers import generate
from prometheus_client.parser import text_string_to_metric_families

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.engine.sequence import SamplingParams

pytestmark = pytest.mark.slow
QUESTION = "Describe a lighthouse on a stormy night, and the keeper who tends its lamp."


def counter(stack: Stack, worker: str, name: str, **labels: str) -> float:
    text = httpx.get(stack.metrics_url(worker), timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and set(labels.items()) <= set(s.labels.items()))


def test_with_no_transport_the_segment_carries_the_kv_and_the_stream_is_exact(fake, tmp_path):
    tok = fake.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    expected = generate(fake, {"q": prompt}, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))["q"]
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=256, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(PD_KV_TRANSPORT="none", PD_PLACEMENT="remote"))
    with Stack(cfg) as stack, httpx.Client(base_url=stack.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": 16, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected
        sent = counter(stack, "prefill-0", "pd_kv_transfer_bytes_total", transport="segment")
        assert sent > 0 and counter(stack, "prefill-0", "pd_kv_transfer_bytes_total", transport="none") == 0
        assert counter(stack, "decode-0", "pd_kv_received_bytes_total") == sent
        for worker in ("prefill-0", "decode-0"):   # UCX never loaded: no libucp mapped in either worker
            maps = Path(f"/proc/{stack.procs[worker].pid}/maps").read_text()
            assert "libucp" not in maps
