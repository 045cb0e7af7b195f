"""OpenAI's Responses API request (`POST /v1/responses`), validated, and the chat request it
means: `instructions` and `input` become the conversation (a function call and its output
become an assistant's tool call and a tool message), tools and `text.format` become their chat
counterparts. The chat request's own checks then apply as to any chat request.

pdserve keeps no responses: `previous_response_id`, `conversation`, `background` and
`store: true` are refused by name (send the whole conversation in `input`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from pdserve.services.gateway.errors import APIError, describe, plain
from pdserve.services.gateway.parts import Body, FunctionDef, JSONSchemaFormat, Strict, refuse
from pdserve.services.gateway.schemas import MAX_TEMPLATE_KWARGS_CHARS, ChatCompletionRequest
from pdserve.shared.engine.sequence import MAX_SPECULATIVE_TOKENS

KEEPS_NOTHING = "this server keeps no responses: send the whole conversation in 'input'"
REFUSED = {
    "previous_response_id": KEEPS_NOTHING,
    "conversation": KEEPS_NOTHING,
    "background": "responses are answered while the client waits (or streamed)",
    "prompt": "this server keeps no prompt templates",
    "reasoning": "this model is not a reasoning model",
}
# a chat request's field -> this request's (the first that begins the chat field's path)
CHAT_PARAMS = (("messages", "input"), ("max_tokens", "max_output_tokens"),
               ("response_format.json_schema.schema", "text.format.schema"),
               ("response_format.json_schema", "text.format"), ("response_format", "text.format"))


def param_of(chat: str | None) -> str | None:
    """The field of this request that a chat request's field `chat` came from."""
    if chat is None:
        return None
    for field, ours in CHAT_PARAMS:
        if chat == field or chat.startswith(field + "."):
            return ours if field == "messages" else ours + chat[len(field):]  # (messages: not one item each)
    tool = re.fullmatch(r"tools\.(\d+)\.function(\..+)?", chat)
    return f"tools.{tool[1]}{tool[2] or ''}" if tool else chat


def renamed(message: str) -> str:
    """A chat check's message with the fields it quotes named as this request names them."""
    return re.sub(r"'([A-Za-z0-9_.]+)'", lambda m: f"'{param_of(m[1])}'", message)


class TextContent(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = Field(None, description="an output_text's, returned: not shown to the model")
    logprobs: list[Any] | None = Field(None, description="an output_text's, returned: not shown to the model")


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]
    id: str | None = Field(None, description="a returned item's: not shown to the model")
    status: str | None = Field(None, description="a returned item's: not shown to the model")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as a JSON text")
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")] |
                 Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                 Discriminator(_item_type, custom_error_type="invalid_value", custom_error_message=(
                     "this input item's type is not supported (message, function_call and function_call_output "
                     "are)"))]


class FunctionTool(FunctionDef):
    """A chat tool's function, flat."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise refuse("type", "this server's tools are functions (no hosted tools)")
        return data


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(None, description="this model has one verbosity")


class ResponsesRequest(Body):
    model: str
    input: list[Item] = Field(min_length=1, description="a text (the user's message) or the conversation's items")
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    metadata: dict[str, str] | None = Field(None, description="advisory: returned on the response, kept nowhere")
    user: str | None = Field(None, description="advisory: accepted, recorded nowhere")
    store: bool | None = Field(None, description="false or absent: this server keeps no responses")
    include: list[str] | None = Field(None, max_length=0, description="no extra output is available")
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = Field(None, description="advisory: accepted, recorded nowhere")
    prompt_cache_key: str | None = Field(None, description="advisory: prompts share cached prefixes anyway")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, max_length=32, description=f"extension, vLLM's: as a chat request's (at most "
        f"{MAX_TEMPLATE_KWARGS_CHARS} characters)")
    speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS,
                                           description="extension: as a chat request's (speculative decoding)")

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_user_message(cls, v: Any) -> Any:
        return [{"role": "user", "content": v}] if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in REFUSED.items():
                if data.get(name) not in (None, False, {}):
                    raise refuse(name, why)
            data = {k: v for k, v in data.items() if k not in REFUSED}
            if data.get("store"):
                raise refuse("store", KEEPS_NOTHING)
        return data

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request this one means; its refusal is a 400 naming this request's field."""
        body: dict[str, Any] = {
            "model": self.model, "messages": self.messages(), "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls, "chat_template_kwargs": self.chat_template_kwargs,
            "speculative_tokens": self.speculative_tokens}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else \
                {"type": "function", "function": {"name": self.tool_choice.name}}
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            spec = JSONSchemaFormat(name=fmt.name or "output", schema_=fmt.schema_, strict=fmt.strict)
            body["response_format"] = {"type": "json_schema", "json_schema": spec.model_dump(by_alias=True)}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            message, param, code = describe(plain(e.errors()))
            raise APIError(400, renamed(message), param_of(param), code) from None

    def messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as a chat conversation."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)  # (one assistant turn: its text, its calls)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out
