"""OpenAI-compatible request bodies, validated (unknown fields are ignored, as OpenAI does)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.messages import Sampling


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)                     # extension
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                         # benchmark extension
    min_tokens: int = Field(0, ge=0)                 # benchmark extension
    return_token_ids: bool = False                   # extension: generated token ids in each choice
    priority: int = Field(0, ge=-100, le=100)        # extension, as vLLM's: lower is prefilled sooner
    user: str | None = None
    session_id: str | None = Field(None, min_length=1, max_length=200)   # extension (or header x-session-id):
                                                                        # a conversation's turns share a decode worker

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def sampling(self, max_tokens: int) -> Sampling:
        if self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({max_tokens})")
        return Sampling(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        seed=self.seed, stop=tuple(self.stop or ()), min_tokens=self.min_tokens,
                        ignore_eos=self.ignore_eos, priority=self.priority)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _max(self):
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v
