"""OpenAI-compatible request bodies, validated. Every field means something: a field this
server does not know, or one OpenAI defines that it does not support, is refused with a 400
naming it (`refused`); advisory fields (`user`, `metadata`, ...) are accepted and do nothing
but what their description says."""

from __future__ import annotations

import json
from typing import Any, Literal, Self

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdserve.services.gateway import tools
from pdserve.services.gateway.parts import (
    NOT_SUPPORTED,
    Body,
    ChatMessage,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    StructuredOutputs,
    Tool,
    refuse,
)
from pdserve.services.gateway.tools import HERMES, CallFormat
from pdserve.shared.engine.grammar import Grammar
from pdserve.shared.engine.logprobs import MAX_TOP
from pdserve.shared.engine.sequence import MAX_SPECULATIVE_TOKENS
from pdserve.shared.messages import Sampling

MAX_CHOICES = 16  # n at most
MAX_PROMPT_CHOICES = 64  # a batch of completions prompts: prompts x n at most
# what the gateway gives a chat template itself (tokenizer.apply_chat_template, generate.chat_ids)
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                                "raise_exception", "strftime_now", "continue_final_message"})
MAX_TEMPLATE_KWARGS_CHARS = 4096
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)  # an int64, as vLLM's (and what a span attribute can carry)


class _Common(Body):

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices from the one prompt (prefilled once)")
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit before sampling")
    user: str | None = Field(None, description="advisory: accepted, recorded nowhere")
    # extensions (vLLM's names)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    ignore_eos: bool = False                         # benchmark extension
    min_tokens: int = Field(0, ge=0)                 # benchmark extension
    return_token_ids: bool = False                   # extension: generated token ids in each choice
    priority: int = Field(0, ge=-100, le=100)        # extension, as vLLM's: lower is prefilled sooner
    cache_salt: str | None = Field(None, min_length=1, max_length=256, description="extension, as vLLM's: the "
                                   "prompt's KV blocks are shared only with requests of the same salt")
    session_id: str | None = Field(None, min_length=1, max_length=200)   # extension (or header x-session-id):
                                                                        # a conversation's turns share a decode worker
    include_stop_str_in_output: bool = Field(False, description="extension, vLLM's: the stop string that ended the "
                                             "text kept at its end")
    skip_special_tokens: bool = Field(True, description="extension, vLLM's: false writes special tokens in the text")
    speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "extension: draft tokens checked per decode step (prompt lookup: speculative decoding; the same tokens); "
        "0 off, absent the worker's PD_SPECULATIVE_TOKENS"))
    spaces_between_special_tokens: Literal[True] = Field(True, description="extension, vLLM's: only its default")
    # structured output: OpenAI's response_format, or one of vLLM's guided_* extensions
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="extension: a JSON schema the output follows")
    guided_regex: str | None = Field(None, min_length=1, description="extension: a regular expression it matches")
    guided_choice: list[str] | None = Field(None, min_length=1, description="extension: one of these strings")
    guided_grammar: str | None = Field(None, min_length=1, description="extension: an EBNF grammar (root ::= ...)")
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_supported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in NOT_SUPPORTED.items():
                if name in data and data[name] not in (None, "") and not _default_value(name, data[name]):
                    raise refuse(name, why)
            data = {k: v for k, v in data.items() if k not in NOT_SUPPORTED}  # (what is left means its absence)
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise ValueError(f"logit_bias keys are token ids (decimal, up to 9 digits); got {ascii(key[:24])}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values are in [-100, 100]; got {bias} for {key}")
        return v

    @model_validator(mode="after")
    def _one_grammar(self) -> Self:
        """One structured-output field at most (whether it compiles: generate.check_grammars,
        off the event loop)."""
        named = self._grammars()
        if len(named) > 1:
            raise PydanticCustomError("invalid_value", "'{param}' and '" + named[0][0] + "' cannot be used together",
                                      {"param": named[1][0]})
        return self

    def _grammars(self, calls: CallFormat = HERMES) -> list[tuple[str, Grammar]]:
        """(field, grammar) for each structured-output field set (tools: calls written as `calls`)."""
        out: list[tuple[str, Grammar]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            out.append(("response_format", Grammar("json_object")))
        elif fmt is not None and fmt.json_schema is not None:
            schema = fmt.json_schema.schema_
            out.append(("response_format.json_schema.schema",
                        Grammar("json_schema", json.dumps(schema)) if schema is not None else Grammar("json_object")))
        if self.guided_json is not None:
            spec = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            out.append(("guided_json", Grammar("json_schema", spec)))
        if self.guided_regex is not None:
            out.append(("guided_regex", Grammar("regex", self.guided_regex)))
        if self.guided_choice is not None:
            out.append(("guided_choice", Grammar("choice", json.dumps(self.guided_choice))))
        if self.guided_grammar is not None:
            out.append(("guided_grammar", Grammar("ebnf", self.guided_grammar)))
        return out + (self.structured_outputs.grammars() if self.structured_outputs else [])

    def grammar(self, calls: CallFormat = HERMES) -> Grammar | None:
        """What the output must spell (structured output), or None."""
        named = self._grammars(calls)
        return named[0][1] if named else None

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per generated token when log probabilities are asked for, else None."""
        return None

    def sampling(self, max_tokens: int, cache_salt: str = "", calls: CallFormat = HERMES,
                 tenant: str = "") -> Sampling:
        if self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({max_tokens})")
        return Sampling(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        seed=self.seed, stop=tuple(self.stop or ()), min_tokens=self.min_tokens,
                        ignore_eos=self.ignore_eos, priority=self.priority, presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                        logit_bias=tuple((int(k), b) for k, b in (self.logit_bias or {}).items()),
                        min_p=self.min_p, stop_token_ids=tuple(self.stop_token_ids or ()),
                        logprobs=self.top_logprobs_wanted(), prompt_logprobs=self.prompt_logprobs_wanted(),
                        grammar=self.grammar(calls), cache_salt=cache_salt, tenant=tenant,
                        include_stop_str_in_output=self.include_stop_str_in_output,
                        skip_special_tokens=self.skip_special_tokens, speculative_tokens=self.speculative_tokens)

    def prompt_logprobs_wanted(self) -> int | None:
        """Alternatives per prompt token when the prompt's log probabilities are asked for."""
        return None


def _default_value(name: str, value: Any) -> bool:
    """A refused field set to what it means when absent is accepted (a client library's
    explicit default)."""
    return name == "functions" and value == []


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    metadata: dict[str, str] | None = Field(None, description="advisory: accepted, recorded nowhere")
    store: bool | None = Field(None, description="false or absent: this server stores no completions")
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    safety_identifier: str | None = Field(None, description="advisory: accepted, recorded nowhere")
    prompt_cache_key: str | None = Field(None, description="advisory: prompts share cached prefixes anyway")
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="with tools, auto when absent; none: the tools are not shown to the model")
    parallel_tool_calls: bool = Field(True, description="false: at most one call an answer")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, max_length=32, description="extension, vLLM's: more variables for the chat template (enable_thinking, "
        "...); not the ones the server sets")

    @model_validator(mode="after")
    def _chat(self) -> Self:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("invalid_value", "'top_logprobs' needs 'logprobs' set to true",
                                      {"param": "top_logprobs"})
        if self.store:
            raise refuse("store", "this server stores no completions")
        taken = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_VARIABLES)
        if taken:
            raise PydanticCustomError("invalid_value", "'{param}' may not set " + ", ".join(taken) + " (the server "
                                      "sets it)", {"param": "chat_template_kwargs"})
        if len(json.dumps(self.chat_template_kwargs or {})) > MAX_TEMPLATE_KWARGS_CHARS:
            raise PydanticCustomError("invalid_value", "'{param}' is over " + str(MAX_TEMPLATE_KWARGS_CHARS) +
                                      " characters of JSON", {"param": "chat_template_kwargs"})
        names = [t.function.name for t in self.tools or ()]
        if self.tool_choice not in (None, "none") and not names:
            raise PydanticCustomError("invalid_value", "'tool_choice' needs 'tools'", {"param": "tool_choice"})
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise PydanticCustomError("invalid_value", "'tool_choice' names no function in 'tools'",
                                      {"param": "tool_choice"})
        return self

    def functions(self) -> list[dict] | None:
        """The function definitions shown to the model (None: no tools, or tool_choice none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools]

    def _grammars(self, calls: CallFormat = HERMES) -> list[tuple[str, Grammar]]:
        functions = self.functions()
        if functions is None:
            return super()._grammars(calls)
        choice = self.tool_choice or "auto"
        name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
        if name not in ("auto", "required") and all(f["name"] != name for f in functions):
            return super()._grammars(calls)  # (refused by name in _chat)
        return [*super()._grammars(calls), ("tools", tools.grammar(functions, name, self.parallel_tool_calls, calls))]

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        min_length=1, description="a text, token ids, or a batch of either: each prompt answered as its own choices "
        "(index prompt x n + choice, as OpenAI numbers them)")
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: the prompt scored, nothing generated")
    echo: bool = Field(False, description="the prompt before the completion (with logprobs: the prompt's too)")
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=1, description="one candidate per request")

    @model_validator(mode="after")
    def _completion(self) -> Self:
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("invalid_value", "'max_tokens' of 0 needs 'echo' (the prompt scored alone)",
                                      {"param": "max_tokens"})
        prompts = self.prompts()
        if any(len(p) == 0 for p in prompts):
            raise PydanticCustomError("invalid_value", "'{param}' holds an empty prompt", {"param": "prompt"})
        if len(prompts) * self.n > MAX_PROMPT_CHOICES:
            raise PydanticCustomError("invalid_value", "'{param}' asks for " + str(len(prompts) * self.n) +
                                      " choices (prompts x n); this server answers at most " +
                                      str(MAX_PROMPT_CHOICES) + " a request", {"param": "prompt"})
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch's."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None


class TokenizeRequest(Body):
    """vLLM's /tokenize: a text, or a conversation through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = Field(True, description="with `prompt`: the tokenizer's BOS rule; false: none")
    add_generation_prompt: Literal[True] = True

    @model_validator(mode="after")
    def _one(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "'{param}' or 'messages', one of them", {"param": "prompt"})
        return self


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
