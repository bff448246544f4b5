"""Reasoning and tool-call parsing of chat output (vLLM's `--reasoning-parser` and `--tool-call-parser`).

One function per parser splits a choice's whole output text so far into what may be shown now; streaming diffs
successive splits, so a stream's deltas concatenate to exactly the non-streamed message. Every split is
monotone: its parts only grow as the text grows (a tail that could still become a tag is held back until the
text decides it, or the output ends).

Reasoning (`<think>...</think>`): `deepseek_r1` reads the output as reasoning until `</think>` (its template
writes the opening tag; one in the output is dropped), all of it when `</think>` never comes; `qwen3` reads
reasoning only when the output opens with `<think>` (its thinking mode off, the output is all content).

Tool calls: `hermes` (alias `qwen`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any
number, the text outside them is content (a block that is not such JSON stays in the content, as written);
`llama3_json`: the whole output (after an optional `<|python_tag|>`) is one or more `{"name": ...,
"parameters": {...}}` objects separated by `;`, else it is all content (decided when the output ends).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")
TOOL_CALL_PARSERS = ("hermes", "qwen", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may still become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split_reasoning(parser: str, text: str, finished: bool) -> tuple[str, str | None]:
    """(reasoning shown so far, the rest of the text: the answer, or None while it is not decided yet)."""
    body = text
    if parser == "qwen3":
        start = text.lstrip()
        if not start.startswith(THINK_START):
            if not finished and THINK_START.startswith(start):
                return "", None  # may still open with <think>
            return "", text
        body = start[len(THINK_START):]
    elif text.lstrip().startswith(THINK_START):
        body = text.lstrip()[len(THINK_START):]
    elif not finished and THINK_START.startswith(text.lstrip()):
        return "", None  # may still open with <think> (dropped)
    end = body.find(THINK_END)
    if end >= 0:
        return body[:end], body[end + len(THINK_END):]
    if finished:
        return body, ""
    return body[:len(body) - _held(body, THINK_END)], None


@dataclass(frozen=True)
class ChatParsing:
    """How a server reads chat output: `--chat-template` (the template's text; None: the model's),
    `--reasoning-parser`, `--tool-call-parser` and `--enable-auto-tool-choice`."""

    chat_template: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False


@dataclass
class ParsedCall:
    """One tool call: its name and arguments (JSON text)."""

    name: str
    arguments: str


def _call_of(obj, arguments_key: str) -> ParsedCall | None:
    """A call from a parsed JSON object {"name": str, arguments_key: object}, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # already JSON text
        return ParsedCall(obj["name"], args)
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def split_hermes(text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
    """(content shown so far, the complete tool calls so far) of hermes-style output."""
    content, calls, at = [], [], 0
    while True:
        start = text.find(HERMES_START, at)
        if start < 0:
            tail = text[at:]
            content.append(tail if finished else tail[:len(tail) - _held(tail, HERMES_START)])
            break
        content.append(text[at:start])
        end = text.find(HERMES_END, start)
        if end < 0 and not finished:
            break  # an open block: held until it closes or the output ends
        stop = len(text) if end < 0 else end + len(HERMES_END)
        body = text[start + len(HERMES_START):end if end >= 0 else len(text)]
        try:
            call = _call_of(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            content.append(text[start:stop])  # not a tool call: stays as written
        else:
            calls.append(call)
        at = stop
    return "".join(content), calls


def split_llama3_json(text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
    """(content, tool calls) of Llama-3 JSON output: decided when the output ends if it may be tool calls."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    maybe_calls = body.startswith("{") or (not body or PYTHON_TAG.startswith(text.lstrip()))
    if not maybe_calls:
        return text, []
    if not finished:
        return "", []
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call_of(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        rest = body[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        at = len(body) - len(rest)
    return ("", calls) if calls else (text, [])


TOOL_SPLITTERS = {"hermes": split_hermes, "qwen": split_hermes, "llama3_json": split_llama3_json}


@dataclass
class ChatParse:
    """A choice's output as shown: reasoning, content and tool calls (each only grows while streaming)."""

    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass
class ChatOutputParser:
    """Splits one choice's output text with the server's parsers and the request's tool choice.

    `reasoning_parser`: a REASONING_PARSERS name or None; `tool_parser`: a TOOL_CALL_PARSERS name, or None (no
    tool calls read from free text); `named_tool`: the function tool_choice names (the output is its arguments,
    forced by a JSON schema); `required`: tool_choice "required" (the output is a JSON array of {name,
    parameters}, forced by a JSON schema); `parallel`: parallel_tool_calls (false: only the first call)."""

    reasoning_parser: str | None = None
    tool_parser: str | None = None
    named_tool: str | None = None
    required: bool = False
    parallel: bool = True
    include_reasoning: bool = True
    ids: list[str] = field(default_factory=list)  # call ids, stable across a stream's splits

    @property
    def plain(self) -> bool:
        """Whether the output is plain content (no parser, no tool choice read)."""
        return self.reasoning_parser is None and self.tool_parser is None and self.named_tool is None \
            and not self.required

    def parse(self, text: str, finished: bool) -> ChatParse:
        reasoning, rest = ("", text) if self.reasoning_parser is None else \
            split_reasoning(self.reasoning_parser, text, finished)
        out = ChatParse(reasoning if self.include_reasoning else "")
        if rest is None:
            return out
        if self.named_tool is not None:
            out.calls = [ParsedCall(self.named_tool, rest)]
        elif self.required:
            out.calls = self._required_calls(rest) if finished else []
        elif self.tool_parser is not None:
            out.content, out.calls = TOOL_SPLITTERS[self.tool_parser](rest, finished)
        else:
            out.content = rest
        if not self.parallel:
            out.calls = out.calls[:1]
        return out

    @staticmethod
    def _required_calls(text: str) -> list[ParsedCall]:
        try:
            items = json.loads(text)
        except ValueError:
            return []
        calls = [_call_of(item, "parameters") for item in items] if isinstance(items, list) else []
        return [c for c in calls if c is not None]

    def call_id(self, index: int) -> str:
        while len(self.ids) <= index:
            self.ids.append("call_" + uuid.uuid4().hex[:24])
        return self.ids[index]

    def message(self, text: str) -> dict:
        """The non-streamed assistant message of the whole output `text`."""
        parsed = self.parse(text, finished=True)
        message = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.calls else None}
        if self.reasoning_parser is not None:
            message["reasoning_content"] = message["reasoning"] = parsed.reasoning or None
        if parsed.calls or self.tool_parser is not None or self.named_tool or self.required:
            message["tool_calls"] = [self.tool_call(i, c) for i, c in enumerate(parsed.calls)]
        return message

    def tool_call(self, index: int, call: ParsedCall) -> dict:
        return {"id": self.call_id(index), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the output called tools (auto or required; a named tool choice: "stop")."""
        if reason == "stop" and self.named_tool is None and self.parse(text, finished=True).calls:
            return "tool_calls"
        return reason


class ChatStreamDeltas:
    """The stream deltas of one choice: each feed returns the delta dicts to send (reasoning, content, then tool
    calls: a call's id, name and arguments together once it is complete; a named tool's arguments as they
    come)."""

    def __init__(self, parser: ChatOutputParser):
        self.parser = parser
        self.sent = ChatParse()
        self.sent_args: list[int] = []  # characters of each call's arguments sent

    def feed(self, text: str, finished: bool) -> list[dict]:
        now = self.parser.parse(text, finished)
        deltas = []
        key = "reasoning_content"
        if len(now.reasoning) > len(self.sent.reasoning):
            piece = now.reasoning[len(self.sent.reasoning):]
            deltas.append({key: piece, "reasoning": piece})
        if len(now.content) > len(self.sent.content):
            deltas.append({"content": now.content[len(self.sent.content):]})
        named = self.parser.named_tool is not None
        for i, call in enumerate(now.calls):
            if i >= len(self.sent_args):
                self.sent_args.append(0)
                first = {"index": i, "id": self.parser.call_id(i), "type": "function",
                         "function": {"name": call.name, "arguments": "" if named else call.arguments}}
                self.sent_args[i] = 0 if named else len(call.arguments)
                deltas.append({"tool_calls": [first]})
            if len(call.arguments) > self.sent_args[i]:
                piece = call.arguments[self.sent_args[i]:]
                self.sent_args[i] = len(call.arguments)
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        self.sent = now
        return deltas
