"""Tool calls (OpenAI's `tools` / `tool_choice`) in the format the model writes them
(`CallFormat`, vLLM's `--tool-call-parser` names):

- `hermes` (Qwen2.5, Qwen3, Hermes; and every template that lists no tools):
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 templates), calls separated by "; ":
      {"name": "get_weather", "parameters": {"city": "Paris"}}

A chat template that reads `tools` is given them and the earlier calls (`template_messages`)
and lists them its own way; its format is the one it describes (`call_format`, or
PD_TOOL_CALL_PARSER). For a template that does not (SmolLM2's) this module adds the Hermes
listing (`prompt_messages`) to the system message, earlier calls as Hermes blocks and a `tool`
message's result inside <tool_response>. The grammar (`grammar`) holds each call's arguments to
its function's JSON schema: under `auto` the model may write text and calls; under `required`
or a named function, only calls (one, or several when `parallel_tool_calls`). `CallStream`
takes whole calls out of the text as it comes.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.shared.engine.grammar import Grammar


@dataclass(frozen=True)
class CallFormat:
    """A call is `begin` + {"name": NAME, "<key>": ARGUMENTS} + `end`; calls are joined by `sep`.
    `trigger` opens a call in free text (under `auto`): the grammar's trigger, the stream's cue."""
    name: str
    trigger: str
    begin: str
    key: str
    end: str
    sep: str

    def block(self, name: str, arguments: str) -> str:
        """A call as the model writes it (`arguments`: JSON text)."""
        return f'{self.begin}{{"name": {json.dumps(name)}, "{self.key}": {arguments}}}{self.end}'


HERMES = CallFormat("hermes", "<tool_call>", "<tool_call>\n", "arguments", "\n</tool_call>", "\n")
LLAMA3_JSON = CallFormat("llama3_json", '{"name"', "", "parameters", "", "; ")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


def call_format(template: str | None, takes_tools: bool, parser: str = "auto") -> CallFormat:
    """The format calls are written in. A template that lists no tools gets this module's Hermes
    listing, so Hermes; one that does: `parser` when named (PD_TOOL_CALL_PARSER), else the format
    it asks for: Llama 3.x's ({"name": function name, "parameters": ...}, its header tokens, no
    <tool_call> tags) or Hermes."""
    if not takes_tools or template is None:
        return HERMES
    if parser != "auto":
        return FORMATS[parser]
    llama = "<|start_header_id|>" in template and '"parameters"' in template and HERMES.trigger not in template
    return LLAMA3_JSON if llama else HERMES


SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as a template that takes tools reads them: calls' arguments as objects
    (templates write them with `tojson`; OpenAI sends them as JSON text)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


def _arguments(function: dict) -> Any:
    try:
        return json.loads(function["arguments"])
    except (TypeError, ValueError):
        return function["arguments"]


def listing(functions: list[dict]) -> list[dict]:
    """OpenAI's tool objects for a template's `tools`."""
    return [{"type": "function", "function": f} for f in functions]


def prompt_messages(messages: list[dict], functions: list[dict] | None) -> list[dict]:
    """The chat template's messages: `functions` (OpenAI function objects; None: no tools)
    described in the system message, earlier calls and results written as the model writes them."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = [HERMES.block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = "\n".join([content, *calls]) if content else "\n".join(calls)
        if m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if functions:
        listing = SYSTEM.format(tools="\n".join(json.dumps({"type": "function", "function": f}) for f in functions))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def grammar(functions: list[dict], choice: str, parallel: bool, fmt: CallFormat) -> Grammar:
    """The structural tag for `choice` ("auto", "required", or a function's name): each call's
    arguments follow its function's schema."""
    tags = [{"type": "tag", "begin": f'{fmt.begin}{{"name": {json.dumps(f["name"])}, "{fmt.key}": ',
             "content": {"type": "json_schema", "json_schema": f.get("parameters") or {"type": "object"}},
             "end": f"}}{fmt.end}"} for f in functions if choice in ("auto", "required") or f["name"] == choice]
    if choice == "auto":
        spec: dict[str, Any] = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
                                "at_least_one": False, "stop_after_first": not parallel}
    else:
        spec = {"type": "tags_with_separator", "tags": tags, "separator": fmt.sep, "at_least_one": True,
                "stop_after_first": not parallel or choice != "required"}
    return Grammar("structural_tag", json.dumps({"type": "structural_tag", "format": spec}))


class CallStream:
    """Splits generated text, as it comes, into content and whole tool calls: text that may be
    the start of a call is withheld until it is one or cannot be; the separator after a call
    is dropped."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.withheld = ""
        self.calls = 0
        self.after_call = False
        self.json = json.JSONDecoder()

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool calls) that `text` completes."""
        self.withheld += text
        content = ""
        calls: list[dict] = []
        while self.withheld:
            if self.after_call:
                sep = self.fmt.sep
                if sep.startswith(self.withheld) and len(self.withheld) < len(sep):
                    break  # (maybe the separator, still coming)
                self.withheld = self.withheld[len(sep):] if self.withheld.startswith(sep) else self.withheld
                self.after_call = False
            trigger = self.fmt.trigger
            start = self.withheld.find(trigger)
            if start < 0:
                keep = next((n for n in range(min(len(trigger), len(self.withheld)), 0, -1)
                             if trigger.startswith(self.withheld[-n:])), 0)
                content += self.withheld[:len(self.withheld) - keep]
                self.withheld = self.withheld[len(self.withheld) - keep:]
                break
            content += self.withheld[:start]
            self.withheld = self.withheld[start:]
            taken = self._take()
            if taken is None:
                break  # (a call still coming)
            call, n = taken
            if call is None:
                content += self.withheld[:n]
            else:
                calls.append(call)
                self.after_call = True
            self.withheld = self.withheld[n:]
        return content, calls

    def flush(self) -> str:
        """What is still withheld (a call cut short by max_tokens): content."""
        rest, self.withheld = self.withheld, ""
        return rest

    def _take(self) -> tuple[dict | None, int] | None:
        """At a trigger: (the call, or None where this is text, characters it spans), or None
        while the text so far could still become a call."""
        fmt, text = self.fmt, self.withheld
        if not text.startswith(fmt.begin):
            return None if fmt.begin.startswith(text) else (None, len(fmt.trigger))
        at = len(fmt.begin)
        try:
            obj, at = self.json.raw_decode(text, at)
        except ValueError:
            if fmt.end and fmt.end in text:  # a block that is no call (the grammar prevents it): text
                return None, text.index(fmt.end) + len(fmt.end)
            return None  # (cut short: flush gives it back as text)
        if not text.startswith(fmt.end, at):
            return None if fmt.end.startswith(text[at:]) else (None, at)
        return self._call(obj), at + len(fmt.end)

    def _call(self, obj: Any) -> dict | None:
        args = obj.get(self.fmt.key, obj.get("arguments")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
            return None
        self.calls += 1
        return {"index": self.calls - 1, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
