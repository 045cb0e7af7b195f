"""Tool calls at the gateway: the request's checks, the prompt the model sees, the grammar
that holds arguments to their schema, and calls taken out of streamed text."""

import asyncio
import json

import pytest
from pydantic import ValidationError

from pdserve.services.gateway import tools
from pdserve.services.gateway.checks import check_grammars
from pdserve.services.gateway.errors import APIError, describe
from pdserve.services.gateway.schemas import ChatCompletionRequest
from pdserve.shared.engine.grammar import Grammars, check

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **kw})


def param_of(**kw) -> str:
    with pytest.raises(ValidationError) as e:
        request(**kw)
    return describe(json.loads(json.dumps(e.value.errors(), default=str)))[1]


def test_tool_choice_and_messages_are_checked():
    assert param_of(tool_choice="required") == "tool_choice"  # no tools
    assert param_of(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}) == "tool_choice"
    assert param_of(tools=[WEATHER], response_format={"type": "json_object"}) == "tools"
    assert param_of(tools=[{"type": "function", "function": {"name": "bad name!"}}]).startswith("tools")
    with pytest.raises(APIError) as e:  # (compiled off the event loop, by the gateway's generate)
        bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
        asyncio.run(check_grammars(request(tools=[bad]), tools.HERMES))
    assert e.value.param == "tools" and "does not compile" in e.value.message
    assert param_of(messages=[*ASK, {"role": "tool", "content": "12 C"}]) == "messages.1.tool_call_id"
    assert param_of(messages=[{"role": "user"}]) == "messages.0.content"
    assert request(tools=[WEATHER], tool_choice="none").grammar() is None
    assert request(tools=[WEATHER]).grammar().kind == "structural_tag"


def test_the_prompt_lists_the_tools_and_replays_earlier_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "c"}'}}
    body = request(tools=[WEATHER], messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                                              {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}])
    msgs = tools.prompt_messages([m.for_template() for m in body.messages], body.functions())
    assert msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant",
                       "content": tools.HERMES.block("get_weather", '{"city": "Paris", "unit": "c"}')}
    assert msgs[3] == {"role": "tool", "content": "<tool_response>\n12 C\n</tool_response>"}
    assert tools.prompt_messages([m.for_template() for m in body.messages], None)[0]["role"] == "user"


def walk(grammar, text: str) -> bool:
    """Whether `text` (then the end) is in the grammar, over a vocabulary of bytes."""
    m = Grammars([bytes([i]) if i else b"" for i in range(256)], (0,)).matcher(grammar)
    return all(m.accept(b) for b in text.encode()) and m.accept(0)


@pytest.mark.parametrize("fmt", tools.FORMATS.values(), ids=tools.FORMATS)
def test_the_grammar_holds_calls_to_their_schemas_under_each_choice(fmt):
    fns = [WEATHER["function"], NOW["function"]]
    ok = fmt.block("get_weather", '{"city": "Paris", "unit": "c"}')
    bad_unit = fmt.block("get_weather", '{"city": "Paris", "unit": "k"}')
    now = fmt.block("now", "{}")
    auto, required = tools.grammar(fns, "auto", True, fmt), tools.grammar(fns, "required", True, fmt)
    named, single = tools.grammar(fns, "now", True, fmt), tools.grammar(fns, "required", False, fmt)
    for g in (auto, required, named, single):
        check(g)
    assert walk(auto, "Let me look. " + ok + " Done.") and walk(auto, "No call at all.")
    assert not walk(auto, "Let me look. " + bad_unit)
    assert walk(required, ok + fmt.sep + now) and not walk(required, "Sure. " + ok) and not walk(required, "")
    assert walk(named, now) and not walk(named, ok)
    assert walk(single, ok) and not walk(single, ok + fmt.sep + now)


@pytest.mark.parametrize("fmt", tools.FORMATS.values(), ids=tools.FORMATS)
def test_calls_are_taken_out_of_streamed_text_whatever_the_pieces(fmt):
    tail = " " + fmt.trigger[:4]  # (might have been a call's start)
    text = "Checking. " + fmt.block("get_weather", '{"city": "Paris", "unit": "c"}') + fmt.sep + \
        fmt.block("now", "{}") + tail
    for size in (1, 3, 7, len(text)):
        s = tools.CallStream(fmt)
        parts = [s.feed(text[i:i + size]) for i in range(0, len(text), size)]
        content = "".join(c for c, _ in parts) + s.flush()
        calls = [c for _, cs in parts for c in cs]
        assert content == "Checking. " + tail  # (the separator between the calls dropped)
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [(0, "get_weather", {"city": "Paris", "unit": "c"}), (1, "now", {})]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_json_that_is_no_call_stays_text():
    s = tools.CallStream(tools.LLAMA3_JSON)
    text = 'Say {"name": 3} or {"name": "f"}; {"name": "now", "arguments": {}}'
    content, calls = s.feed(text)
    assert content == 'Say {"name": 3} or {"name": "f"}; ' and s.flush() == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("now", "{}")]
    s = tools.CallStream(tools.HERMES)
    assert s.feed("<tool_call>\nnot json\n</tool_call> ok") == ("<tool_call>\nnot json\n</tool_call> ok", [])


# the shapes of the templates' tool instructions (Llama 3.1's, Qwen2.5's) and one that lists no tools
LLAMA = """<|start_header_id|>user<|end_header_id|>{% if tools %}Respond in the format {"name": function name,
"parameters": dictionary of argument name and its value}.{% endif %}"""
QWEN = """<|im_start|>system{% if tools %}<tool_call>{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>{% endif %}"""


def test_the_call_format_is_the_one_the_template_asks_for():
    assert tools.call_format(LLAMA, True) is tools.LLAMA3_JSON
    assert tools.call_format(QWEN, True) is tools.HERMES
    assert tools.call_format(LLAMA, True, "hermes") is tools.HERMES  # PD_TOOL_CALL_PARSER
    assert tools.call_format(QWEN, True, "llama3_json") is tools.LLAMA3_JSON
    assert tools.call_format(None, False, "llama3_json") is tools.HERMES  # (the Hermes listing is added)
