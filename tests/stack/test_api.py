"""The OpenAI-compatible API through the real stack (1 prefill + 1 decode worker). The tests of
the API's shapes whose answers need no model's numbers (streamed equals whole, text or token
prompts, batches, seeded sampling) take the session's fake-model stack (`fake_client`,
tests/stack/conftest.py); those that check the model's answer, tokens, logprobs or the
penalties' effect on its output keep the real one."""

from __future__ import annotations

import asyncio

import httpx
import nats
import pytest
from conftest import MODEL
from helpers import generate, run_all

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.state import worker_key

pytestmark = pytest.mark.slow
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_non_streaming_names_paris_with_ids_in_headers(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=32)
    resp = raw.parse()
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens > 20 and 0 < resp.usage.completion_tokens <= 32
    assert resp.id == "chatcmpl-" + raw.headers["x-request-id"] and len(raw.headers["x-trace-id"]) == 32


def test_chat_streaming_matches_non_streaming(fake_client):
    client = fake_client
    messages = [{"role": "user", "content": "Write a haiku about rain."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    every = list(client.chat.completions.create(  # vLLM's continuous_usage_stats (guidellm sends it)
        model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in every if c.choices and c.usage]
    assert counts == sorted(counts) and counts[-1] == full.usage.completion_tokens and len(counts) > 1
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in every if c.usage)


def test_the_stop_string_kept_on_request(client):
    kw = dict(model=MODEL, messages=PARIS, temperature=0, max_tokens=32, stop=["Paris"])
    cut = client.chat.completions.create(**kw).choices[0].message.content
    kept = client.chat.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert "Paris" not in cut and kept.choices[0].message.content == cut + "Paris"


def test_completions_with_text_and_token_prompts(fake_client, fake):
    client = fake_client
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    ids = fake.tokenizer.encode("The capital of France is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert text.choices[0].text == by_ids.choices[0].text and text.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, stream=True))
    assert streamed == text.choices[0].text


def test_a_batch_of_prompts_is_answered_prompt_by_prompt(fake_client, fake):
    """Completions' batched prompts (lm-eval's local-completions sends them): choice j x n + i
    is prompt j's choice i, each the answer that prompt alone gets; token-id batches too, and
    log-likelihood scoring (echo, max_tokens 0) of each."""
    client = fake_client
    prompts = ["The capital of France is", "Two plus two equals"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    ids = [fake.tokenizer.encode(p) for p in prompts]
    two = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, n=2, seed=3)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [two.choices[k].text for k in (0, 2)] == [a.choices[0].text for a in alone]  # (greedy: n alike)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: alone[0].choices[0].text, 1: alone[1].choices[0].text}
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert [len(c.logprobs.tokens) for c in scored.choices] == [len(i) for i in ids]


def test_greedy_tokens_equal_the_engine_in_process(client, smollm2):
    tok = smollm2.tokenizer
    questions = ["Name three rivers in Europe.", "What is 2 + 2?", "Why do cats purr?"]
    for q in questions:
        messages = [{"role": "user", "content": q}]
        ids = tok.encode(tok.apply_chat_template(messages))
        expected = generate(smollm2, {"q": ids}, SamplingParams(max_tokens=20, temperature=0))["q"]
        resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                              extra_body={"return_token_ids": True})
        assert resp.choices[0].model_extra["token_ids"] == expected, q


def test_seeded_sampling_is_reproducible_through_the_stack(fake_client):
    client = fake_client
    kw = dict(model=MODEL, messages=PARIS, temperature=1.0, top_p=0.9, seed=1234, max_tokens=20)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_models_health_ready(stack):
    assert httpx.get(stack.metrics_url("gateway", "/health")).json()["live"]
    ready = httpx.get(stack.metrics_url("gateway", "/ready")).json()
    assert ready["ready"] and ready["workers"] == {"router": 1, "prefill": 1, "decode": 1}
    models = httpx.get(stack.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_vllms_model_version_and_token_endpoints(stack, client, smollm2):
    one = httpx.get(f"{stack.url}/v1/models/{MODEL}")
    assert one.status_code == 200 and one.json()["id"] == MODEL
    other = httpx.get(f"{stack.url}/v1/models/nope")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert httpx.get(stack.url + "/version").json()["version"]
    text = "The capital of France is"
    r = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == smollm2.tokenizer.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"]
    chat = httpx.post(stack.url + "/tokenize", json={"messages": PARIS}).json()
    usage = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens  # the conversation as a chat request's prompt
    assert httpx.post(stack.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    bad = httpx.post(stack.url + "/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(stack.url + "/tokenize", json={"prompt": "a", "messages": PARIS})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"


BAD = [
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages"),
    ("negative max_tokens", {"model": MODEL, "messages": PARIS, "max_tokens": -5}, 400, "max_tokens"),
    ("temperature too high", {"model": MODEL, "messages": PARIS, "temperature": 7}, 400, "temperature"),
    ("n over the limit", {"model": MODEL, "messages": PARIS, "n": 17}, 400, "n"),
    ("bad role", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("unknown model", {"model": "gpt-9", "messages": PARIS}, 404, "model"),
    ("prompt over the context", {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 9000}]},
     400, "messages"),
    ("max_tokens over the context", {"model": MODEL, "messages": PARIS, "max_tokens": 9000}, 400, "messages"),
]


def test_bad_requests_get_4xx_and_reach_no_worker(stack):
    async def run():
        nc = await nats.connect(stack.nats_url)
        seen = []

        async def record(msg):
            seen.append(msg.subject)

        await nc.subscribe("pd.>", cb=record)
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            results = [(name, await http.post("/v1/chat/completions", json=body), status, param)
                       for name, body, status, param in BAD]
            results.append(("malformed JSON", await http.post(
                "/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={
                    "content-type": "application/json"}), 400, None))
            results.append(("bad completions prompt", await http.post(
                "/v1/completions", json={"model": MODEL, "prompt": [1, 99999999]}), 400, "prompt"))
        await asyncio.sleep(0.3)
        await nc.close()
        return results, seen

    results, seen = asyncio.run(run())
    for name, resp, status, param in results:
        assert resp.status_code == status, (name, resp.text)
        err = resp.json()["error"]
        assert err["message"] and err["type"], name
        assert resp.headers["x-request-id"] and len(resp.headers["x-trace-id"]) == 32, name
        if param:
            assert param in (err["param"] or "") or param in err["message"], (name, err)
    context = next(r for n, r, *_ in results if n == "prompt over the context").json()["error"]
    assert "8192" in context["message"] and context["code"] == "context_length_exceeded"
    assert not [s for s in seen if not s.startswith("pd.kv.events")], seen


def test_client_that_leaves_mid_stream_frees_its_blocks(stack):
    import json as _json
    import time

    import redis

    store = redis.Redis.from_url(stack.redis_url)

    def free_blocks():
        infos = [_json.loads(store.get(k)) for k in store.keys(worker_key("*"))]
        return {w["worker_id"]: (w["free_blocks"], w["total_blocks"]) for w in infos
                if w["role"] in ("prefill", "decode")}

    with httpx.Client(base_url=stack.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
            frames = 0
            for line in r.iter_lines():
                frames += line.startswith("data: ")
                if frames == 4:
                    break  # hang up mid-stream
    deadline = time.monotonic() + 5  # generating 4000 tokens would take minutes here
    while time.monotonic() < deadline and any(f != t for f, t in free_blocks().values()):
        time.sleep(0.3)
    assert all(f == t for f, t in free_blocks().values()), free_blocks()
    assert len(free_blocks()) == 2


def test_logprobs_match_the_engine_in_process_streamed_or_not(client, smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode(tok.apply_chat_template(PARIS))
    engine = Engine(smollm2, EngineConfig(num_blocks=256))
    engine.add_request("x", ids, SamplingParams(max_tokens=8, temperature=0, logprobs=3))
    expected = [o.logprobs[0] for o in run_all(engine)["x"]]
    resp = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=8,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert [bytes(e.bytes) for e in content] == [tok.token_bytes(lp.token_id) for lp in expected]
    for got, want in zip(content, expected, strict=True):
        assert abs(got.logprob - want.logprob) < 1e-3 and got.logprob <= 0
        assert [t.token for t in got.top_logprobs] == [tok.token_bytes(i).decode() for i, _ in want.top]
    streamed = [e for c in client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3, stream=True)
        if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_echo_scores_the_prompt_as_log_likelihood_evaluation_does(client, smollm2):
    """lm-eval's request: echo, max_tokens 0, logprobs 1; the continuation's log-likelihood is
    the sum of its tokens' logprobs, and it is greedy when each is the top alternative."""
    context, continuation = "The capital of France is", " Paris"
    ids = smollm2.tokenizer.encode(context + continuation)
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text == context + continuation and resp.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:]) and lp.text_offset[-1] == len(context)
    engine = Engine(smollm2, EngineConfig(num_blocks=256))
    engine.add_request("x", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    want = run_all(engine)["x"][0].prompt_logprobs
    assert all(abs(a - b.logprob) < 1e-3 for a, b in zip(lp.token_logprobs[1:], want[1:], strict=True))
    assert max(lp.top_logprobs[-1], key=lp.top_logprobs[-1].get) == " Paris"  # the greedy continuation
    with_text = client.completions.create(model=MODEL, prompt=context, max_tokens=3, echo=True, temperature=0)
    assert with_text.choices[0].text.startswith(context) and with_text.usage.completion_tokens == 3


def test_penalties_bias_and_stop_token_ids_change_the_output_as_they_should(client, smollm2):
    ask = [{"role": "user", "content": "List ten fruits, one per line."}]
    kw = dict(model=MODEL, messages=ask, temperature=0, max_tokens=48, extra_body={"return_token_ids": True})
    plain = client.chat.completions.create(**kw).choices[0].model_extra["token_ids"]
    penalized = client.chat.completions.create(**kw, frequency_penalty=2.0).choices[0].model_extra["token_ids"]
    assert penalized != plain
    assert max(map(penalized.count, penalized)) < max(map(plain.count, plain))
    newline = smollm2.tokenizer.encode("\n")[0]
    assert newline in plain
    banned = client.chat.completions.create(**kw, logit_bias={str(newline): -100}).choices[0].model_extra["token_ids"]
    assert newline not in banned
    stopped = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=48,
                                             extra_body={"return_token_ids": True, "stop_token_ids": [newline]})
    assert stopped.choices[0].model_extra["token_ids"] == plain[:plain.index(newline) + 1]
    assert stopped.choices[0].finish_reason == "stop"


def test_unknown_and_unsupported_fields_are_refused_by_name(client):
    import openai

    for extra, code in [({"no_such_field": 1}, "unknown_parameter"),
                        ({"prediction": {"type": "content", "content": "x"}}, "unsupported_parameter")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == next(iter(extra)) and e.value.body["code"] == code
    ok = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2, user="u1", metadata={"k": "v"})
    assert ok.choices[0].message.content is not None
