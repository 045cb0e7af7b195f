"""The parts of a request body (pdserve/services/gateway/schemas.py): messages, tools, output formats;
what every part shares (`Strict`: a field it does not define is refused by name), what every
body gets checked for first (`Body`: text UTF-8 can encode, nesting within MAX_DEPTH), and the
OpenAI parameters this server refuses."""

from __future__ import annotations

import json
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pdserve.shared.engine.grammar import Grammar

# OpenAI parameters this server refuses (400, code "unsupported_parameter"), and why
NOT_SUPPORTED = {
    "functions": "function calls are not supported (deprecated by OpenAI for tools)",
    "function_call": "function calls are not supported (deprecated by OpenAI for tools)",
    "audio": "this model produces text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "this server has no web search",
    "reasoning_effort": "this model is not a reasoning model",
    "verbosity": "this model is not a reasoning model",
    "suffix": "this model has no fill-in-the-middle mode",
}


_RETURNED = ("function_call", "audio", "annotations")  # fields of a returned assistant message, refused unless empty
MAX_DEPTH = 64  # a request body's nesting (a body's own is under 10; a JSON schema in it, a few dozen at most)


class Strict(BaseModel):
    """A request's part: a field it does not define is refused by name."""

    model_config = ConfigDict(extra="forbid")


class Body(Strict):
    """A request's body, checked whole before its fields (`unreadable`): a string UTF-8 cannot
    encode, or nesting past MAX_DEPTH, is a 400 naming where. (A subclass's own before-checks
    run first: they look at the top level only.)"""

    @model_validator(mode="before")
    @classmethod
    def _readable(cls, data: Any) -> Any:
        if (found := unreadable(data)) is not None:
            param, why = found
            raise PydanticCustomError("invalid_value", "'{param}' " + why, {"param": param})
        return data


def unreadable(data: Any) -> tuple[str, str] | None:
    """(where, why) of the first place in a request body that no check may read: a string (a
    value or a key) UTF-8 cannot encode — JSON's \\ud800 escapes parse into such strings, and no
    tokenizer or message takes them — or nesting deeper than MAX_DEPTH, which the interpreter's
    recursion (a check, an error's JSON, a schema's grammar) would not survive. Walked with a
    stack of its own, not recursion: a body nested as deep as the JSON parser allows is read."""
    todo: list[tuple[str, str, Any, int]] = [("", "", data, 0)]  # (path, its top-level field, value, depth)
    while todo:
        path, top, value, depth = todo.pop()
        if isinstance(value, str):
            if not _utf8(value):
                return path or "body", "is not valid unicode (it holds a lone surrogate, half of a UTF-16 pair)"
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        children = [(k, v) for k, v in items if isinstance(v, (str, dict, list)) or isinstance(k, str)]
        if depth == MAX_DEPTH and any(isinstance(v, (dict, list)) for _, v in children):
            return top or "body", f"is nested deeper than {MAX_DEPTH} levels"
        for key, item in reversed(children):  # (popped in the body's order)
            if isinstance(key, str) and not _utf8(key):
                return path or "body", "is not valid unicode (it holds a lone surrogate, half of a UTF-16 pair)"
            name = f"{path}.{key}" if path else str(key)
            todo.append((name, top or name, item, depth + 1))
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="none only on an assistant's tool calls")
    name: str | None = Field(None, description="advisory: accepted, not shown to the model")
    refusal: str | None = Field(None, description="advisory: a returned assistant message's, not shown to the model")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls, as this server returned them")
    tool_call_id: str | None = Field(None, description="a tool message's: the call it answers")

    @model_validator(mode="before")
    @classmethod
    def _returned_fields(cls, data: Any) -> Any:
        """An assistant message passed back as the SDK returned it carries these empty: accepted."""
        if isinstance(data, dict):
            for key in _RETURNED:
                if data.get(key) not in (None, []):
                    raise refuse(key, NOT_SUPPORTED.get(key, f"this server returns no {key}"))
            data = {k: v for k, v in data.items() if k not in _RETURNED}
        return data

    @model_validator(mode="after")
    def _content(self) -> Self:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("invalid_value", "a {role} message needs 'content'",
                                      {"param": "content", "role": self.role})
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise PydanticCustomError("invalid_value", "'tool_call_id' goes with (and only with) a tool message",
                                      {"param": "tool_call_id"})
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """Role and text as the chat template takes them (developer is system), and any calls."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return msg


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema; absent: any JSON object")
    strict: bool | None = Field(None, description="arguments always follow the parameters, strict or not")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="extension, vLLM's: with include_usage, each chunk "
                                         "carries the usage so far")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = Field(None, description="advisory: not shown to the model")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="absent: any JSON object")
    strict: bool | None = Field(None, description="the schema is always enforced, strict or not")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> Self:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("invalid_value", "'response_format.json_schema' goes with type 'json_schema'",
                                      {"param": "json_schema"})
        return self


def refuse(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", "'{param}' is not supported: {why}",
                               {"param": field, "why": why})


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` (its successor to the guided_* fields): one of these."""
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema the output follows")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1, description="an EBNF grammar (root ::= ...)")
    json_object: bool | None = None
    structural_tag: str | None = Field(None, min_length=1, description="xgrammar's structural tag, as JSON text")

    def grammars(self) -> list[tuple[str, Grammar]]:
        out: list[tuple[str, Grammar]] = []
        if self.json_ is not None:
            schema = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            out.append(("structured_outputs.json", Grammar("json_schema", schema)))
        for field, kind, spec in (("regex", "regex", self.regex), ("grammar", "ebnf", self.grammar),
                                  ("structural_tag", "structural_tag", self.structural_tag),
                                  ("choice", "choice", json.dumps(self.choice) if self.choice else None),
                                  ("json_object", "json_object", "" if self.json_object else None)):
            if spec is not None:
                out.append((f"structured_outputs.{field}", Grammar(kind, spec)))  # type: ignore[arg-type]
        return out
