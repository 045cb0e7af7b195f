"""Tool calls (OpenAI's `tools` / `tool_choice`) in the Hermes format. A chat template that
reads `tools` (Qwen2.5, Qwen3, Llama 3.1…) is given them and the earlier calls
(`template_messages`) and lists them its own way; for one that does not (SmolLM2's) this module
adds the Hermes listing (`prompt_messages`): the tools are listed in the system message, and
the model writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with arguments held to the function's JSON schema by the grammar (`grammar`): under `auto`
the model may write text and calls; under `required` or a named function, only calls (one,
or several when `parallel_tool_calls`). Earlier turns go back the same way: an assistant's
`tool_calls` as these blocks, a `tool` message's result inside <tool_response>.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from shared.engine.grammar import Grammar

BEGIN, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(BEGIN) + r"\s*(\{.*?\})\s*" + re.escape(END), re.DOTALL)

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
            calls = [block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
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


def block(name: str, arguments: str) -> str:
    return f'{BEGIN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{END}'


def grammar(functions: list[dict], choice: str, parallel: bool) -> Grammar:
    """The structural tag for `choice` ("auto", "required", or a function's name): each call's
    arguments follow its function's schema."""
    tags = [{"type": "tag", "begin": f'{BEGIN}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": f.get("parameters") or {"type": "object"}},
             "end": f"}}\n{END}"} for f in functions if choice in ("auto", "required") or f["name"] == choice]
    if choice == "auto":
        fmt: dict[str, Any] = {"type": "triggered_tags", "triggers": [BEGIN], "tags": tags,
                               "at_least_one": False, "stop_after_first": not parallel}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel or choice != "required"}
    return Grammar("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


class CallStream:
    """Splits generated text, as it comes, into content and whole tool calls; text that may
    be the start of a call is held back until it is one or cannot be."""

    def __init__(self) -> None:
        self.held = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool calls) that `text` completes."""
        self.held += text
        content = ""
        calls: list[dict] = []
        while True:
            start = self.held.find(BEGIN)
            if start < 0:
                keep = next((n for n in range(min(len(BEGIN), len(self.held)), 0, -1)
                             if BEGIN.startswith(self.held[-n:])), 0)
                content += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return content, calls
            content += self.held[:start]
            match = _CALL.match(self.held, start)
            if match is None:
                if END in self.held[start:]:  # a block that is no call (the grammar prevents it): text
                    end = self.held.index(END, start) + len(END)
                    content += self.held[start:end]
                    self.held = self.held[end:]
                    continue
                self.held = self.held[start:]
                return content, calls
            call = self._call(match.group(1))
            if call is None:
                content += match.group(0)
            else:
                calls.append(call)
            self.held = self.held[match.end():]

    def flush(self) -> str:
        """What is still held (a call cut short by max_tokens): content."""
        rest, self.held = self.held, ""
        return rest

    def _call(self, text: str) -> dict | None:
        try:
            obj = json.loads(text)
            name, arguments = obj["name"], obj["arguments"]
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(name, str):
            return None
        self.calls += 1
        return {"index": self.calls - 1, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
