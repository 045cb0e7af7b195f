"""A Responses API request as the chat request it means, and a chat field named as it has it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.services.gateway.errors import APIError
from pdserve.services.gateway.responses_request import ResponsesRequest, param_of


def test_items_become_the_conversation_with_calls_joined_to_their_turn():
    req = ResponsesRequest(model="m", instructions="Be brief.", input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sun"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"}])
    roles = [(m["role"], len(m.get("tool_calls", ()))) for m in req.messages()]
    assert roles == [("system", 0), ("user", 0), ("assistant", 2), ("tool", 0), ("tool", 0)]
    chat = req.as_chat()
    assert chat.messages[2].content == "Checking." and chat.messages[3].tool_call_id == "c1"


def test_a_text_input_is_the_users_message_and_formats_map():
    chat = ResponsesRequest(model="m", input="hi", max_output_tokens=5, tool_choice={"type": "function", "name": "f"},
                            tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}]).as_chat()
    assert [m.role for m in chat.messages] == ["user"] and chat.max_tokens == 5
    assert chat.tools[0].function.name == "f" and chat.tool_choice.function.name == "f"
    shaped = ResponsesRequest(model="m", input="hi", text={"format": {"type": "json_schema", "name": "x",
                                                                      "schema": {"type": "object"}}}).as_chat()
    assert shaped.response_format.type == "json_schema" and shaped.response_format.json_schema.schema_ == {
        "type": "object"}


def test_a_chat_checks_message_names_this_requests_fields():
    with pytest.raises(APIError) as e:
        ResponsesRequest(model="m", input="hi", tools=[{"type": "function", "name": "f"}],
                         text={"format": {"type": "json_object"}}).as_chat()
    assert "text.format" in e.value.message and "response_format" not in e.value.message


@pytest.mark.parametrize("chat,ours", [("messages.3.content", "input"), ("max_tokens", "max_output_tokens"),
                                       ("response_format.json_schema.schema", "text.format.schema"),
                                       ("tools.2.function.parameters", "tools.2.parameters"), ("tools", "tools"),
                                       ("temperature", "temperature"), (None, None)])
def test_a_chat_field_is_named_as_this_request_names_it(chat, ours):
    assert param_of(chat) == ours


@pytest.mark.parametrize("field,value", [("previous_response_id", "resp_1"), ("conversation", "c"),
                                         ("background", True), ("store", True), ("reasoning", {"effort": "low"})])
def test_what_needs_kept_state_is_refused_by_name(field, value):
    with pytest.raises(ValidationError) as e:
        ResponsesRequest.model_validate({"model": "m", "input": "hi", field: value})
    assert e.value.errors()[0]["ctx"]["param"] == field


def test_a_chat_check_fails_as_a_400_naming_the_input():
    req = ResponsesRequest(model="m", input=[{"type": "function_call_output", "call_id": "c", "output": "x"},
                                             {"role": "assistant", "content": "ok"}], tool_choice="required")
    with pytest.raises(APIError) as e:
        req.as_chat()
    assert e.value.status == 400 and e.value.param == "tool_choice"
