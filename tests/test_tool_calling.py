"""Tool calling and reasoning through the `openai` client, stream and not, on the bundled demo model served with
a tiny chat template that renders tools, tool calls and tool results (--chat-template), --reasoning-parser qwen3
and --tool-call-parser hermes. The demo model does not call tools by itself: SGLang's `regex` field forces its
output into `<think>...</think><tool_call>{json}</tool_call>`, so what is tested is the parsing and the
stream's deltas. The same runs with the bundled EAGLE-3 head must give the same parsed output."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import assert_no_leaks
from server_util import ServerThread, SPEC, one_torch_thread  # noqa: F401
from spruce import LLM
from spruce.config import builtin_draft_path
from spruce.server.chat_parsers import (
    ChatOutputParser, ChatParsing, ChatStreamDeltas, split_llama3_json, split_reasoning,
)
from spruce.server.protocol import ChatCompletionRequest, parse_request

pytest.importorskip("llguidance", reason="the fixture forces tool calls with a regex (spruce[grammar])")

TEMPLATE = (
    "{% if tools %}<|begin_of_text|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"  # (the template is compiled with trim_blocks: a newline after a tag is dropped)
    "{% for m in messages %}<|begin_of_text|>{{ m.role }}"
    "{% if m.role == 'tool' %} [{{ m.tool_call_id }}]{% endif %}{{ '\\n' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|begin_of_text|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
FORCED = (r'<think>[a-z]{2,6}</think>\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"'
          r'\}\}</tool_call>')
USER = [{"role": "user", "content": "weather?"}]
RESULTS: dict[str, object] = {}  # parsed outputs of the plain server, compared with EAGLE-3's


@pytest.fixture(scope="module", params=["plain", "eagle3"])
def server(request):
    spec = dict(draft_model=str(builtin_draft_path()), **SPEC) if request.param == "eagle3" else {}
    llm = LLM(page_size=4, max_running_requests=8, disable_radix_cache=True, **spec)
    srv = ServerThread(llm.engine, chat_parsing=ChatParsing(TEMPLATE, "qwen3", "hermes", True)).start()
    srv.kind = request.param
    yield srv
    srv.stop()
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def same_as_plain(server, name: str, value) -> None:
    """Record the plain server's result; the EAGLE-3 server's must equal it."""
    if server.kind == "plain":
        RESULTS[name] = value
    elif name in RESULTS:
        assert value == RESULTS[name]


def streamed(client, **kwargs) -> tuple[dict, str]:
    """A stream's deltas put together: {reasoning, content, calls: [(name, arguments)]} and the finish reason."""
    out = {"reasoning": "", "content": "", "calls": {}}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            out["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    out["calls"] = [(c["name"], c["arguments"]) for _, c in sorted(out["calls"].items())]
    return out, finish


def message_parts(message) -> dict:
    return {"reasoning": (message.model_extra or {}).get("reasoning_content") or "", "content": message.content or "",
            "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []]}


def test_auto_tool_call_with_reasoning_stream_and_not(server, client):
    kwargs = dict(model="pycode-6m", messages=USER, tools=[WEATHER], temperature=0, max_tokens=120)
    r = client.chat.completions.create(**kwargs, extra_body={"regex": FORCED})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    parts = message_parts(choice.message)
    assert parts["content"] == "\n" and 2 <= len(parts["reasoning"]) <= 6 and parts["reasoning"].isalpha()
    (name, arguments), = parts["calls"]
    assert name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Rome")
    assert choice.message.tool_calls[0].id.startswith("call_")
    stream, finish = streamed(client, **kwargs, extra_body={"regex": FORCED})
    assert stream == parts and finish == "tool_calls"
    same_as_plain(server, "auto", parts)
    hidden = client.chat.completions.create(**kwargs, extra_body={"regex": FORCED, "include_reasoning": False})
    assert message_parts(hidden.choices[0].message) == {**parts, "reasoning": ""}


def test_named_and_required_tool_choice(server, client):
    base = dict(model="pycode-6m", messages=USER, tools=[WEATHER], temperature=0, max_tokens=60)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(tool_choice=named, **base)
    parts = message_parts(r.choices[0].message)
    (name, arguments), = parts["calls"]
    assert name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Rome")
    assert r.choices[0].finish_reason == "stop" and parts["content"] == ""
    assert streamed(client, tool_choice=named, **base) == (parts, "stop")
    required = client.chat.completions.create(tool_choice="required", **base)
    req_parts = message_parts(required.choices[0].message)
    assert req_parts["calls"] and all(n == "get_weather" and json.loads(a)["city"] in ("Paris", "Rome")
                                      for n, a in req_parts["calls"])
    assert required.choices[0].finish_reason == "tool_calls"
    assert streamed(client, tool_choice="required", **base) == (req_parts, "tool_calls")
    same_as_plain(server, "named", (parts, req_parts))


def test_tool_choice_none_reads_no_calls(server, client):
    r = client.chat.completions.create(model="pycode-6m", messages=USER, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=120, extra_body={"regex": FORCED})
    message = r.choices[0].message
    assert not message.tool_calls and message.content.startswith("\n<tool_call>")
    assert r.choices[0].finish_reason == "stop"


def test_history_with_tool_calls_reaches_the_template(server, client):
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "ok", "reasoning_content": "fine"}]
    r = client.chat.completions.create(model="pycode-6m", messages=[*history, *USER], tools=[WEATHER],
                                       tool_choice="none", max_tokens=1, temperature=0,
                                       extra_body={"return_token_ids": True,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    ids = (r.model_extra or {})["prompt_token_ids"]
    prompt = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert prompt.startswith("<|begin_of_text|>system\nTools: get_weather\n")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in prompt
    assert "<|begin_of_text|>tool [call_1]\nsunny\n" in prompt
    assert prompt.endswith("<|begin_of_text|>assistant\n<think></think>")


REFUSED = [  # (request fields, the parameter the 400 names, words of its message)
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"stream": True, "extra_body": {"return_token_ids": True}}, "return_token_ids", "not available"),
    ({"extra_body": {"echo": True}}, "echo", "not available"),
]


@pytest.mark.parametrize("fields,param,words", REFUSED)
def test_tool_requests_refused_by_name(server, client, fields, param, words):
    kwargs = {"model": "pycode-6m", "messages": USER, "tools": [WEATHER], "max_tokens": 4, **fields}
    if kwargs["tools"] is None:
        del kwargs["tools"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs)
    assert e.value.body["param"] == param and words in e.value.body["message"]


def test_cli_flags(tmp_path):
    from spruce.cli import build_parser
    from spruce.server.cli import chat_parsing

    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    args = build_parser().parse_args(["serve", "--chat-template", str(template), "--reasoning-parser",
                                      "deepseek_r1", "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"])
    assert chat_parsing(args) == ChatParsing(TEMPLATE, "deepseek_r1", "llama3_json", True)
    assert build_parser().parse_args(["serve", "--chat-template", "{{ 1 }}"]).chat_template == "{{ 1 }}"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template", str(tmp_path / "missing.jinja")])
    with pytest.raises(SystemExit, match="needs --tool-call-parser"):
        chat_parsing(build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))


def test_reasoning_and_tool_splitters():
    # deepseek_r1: reasoning until </think>, the opening tag optional; all reasoning without the closing one
    assert split_reasoning("deepseek_r1", "abc</think>x", True) == ("abc", "x")
    assert split_reasoning("deepseek_r1", "<think>abc</think>x", True) == ("abc", "x")
    assert split_reasoning("deepseek_r1", "abc</thi", False) == ("abc", None)
    assert split_reasoning("deepseek_r1", "abc", True) == ("abc", "")
    assert split_reasoning("deepseek_r1", " ", False) == ("", None)  # " <think>" may follow: nothing shown yet
    # qwen3: reasoning only when the output opens with <think>
    assert split_reasoning("qwen3", "hello", True) == ("", "hello")
    assert split_reasoning("qwen3", "<thi", False) == ("", None)
    # llama3_json: one or more calls separated by ';', else content
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    assert [(c.name, c.arguments) for c in split_llama3_json(text, True)[1]] == [("f", '{"a": 1}'), ("g", "{}")]
    assert split_llama3_json('{"name": "f", "parameters": ', True) == ('{"name": "f", "parameters": ', [])
    assert split_llama3_json("plain answer", False) == ("plain answer", [])
    # a stream's deltas, fed one character at a time, put together equal the whole message
    parser = ChatOutputParser(reasoning_parser="deepseek_r1", tool_parser="hermes")
    text = 'why</think>Sure <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> <tool_call>bad</tool_call>'
    stream = ChatStreamDeltas(parser)
    deltas = [d for i in range(len(text) + 1) for d in stream.feed(text[:i], i == len(text))]
    message = parser.message(text)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"] == "why"
    assert "".join(d.get("content") or "" for d in deltas) == message["content"] == "Sure  <tool_call>bad</tool_call>"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", '{"x": 1}')]
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    # output a schema forces from its first token holds no reasoning, even with deepseek_r1
    named = parse_request(ChatCompletionRequest, {"messages": USER, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    forced = named.output_parser("deepseek_r1", None, False).message('{"city": "Rome"}')
    assert forced["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    two = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert len(ChatOutputParser(tool_parser="hermes").message(two)["tool_calls"]) == 2
    assert len(ChatOutputParser(tool_parser="hermes", parallel=False).message(two)["tool_calls"]) == 1


STREAM_CASES = [  # (reasoning parser, tool parser, output)
    ("deepseek_r1", "hermes", ' <think>a</think>b<tool_call>{"name": "f", "arguments": {}}</tool_call>c'),
    ("deepseek_r1", None, "no end tag"),
    ("qwen3", "hermes", "<think>x</think><tool_call>{broken"),
    ("qwen3", "llama3_json", '<think>r</think>{"name": "f", "parameters": {"a": [1, 2]}}'),
    (None, "llama3_json", "<|python_tag|> not json"),
    (None, "hermes", "a <tool_ca"),
]


@pytest.mark.parametrize("reasoning,tools,text", STREAM_CASES)
def test_stream_deltas_put_together_equal_the_message(reasoning, tools, text):
    parser = ChatOutputParser(reasoning_parser=reasoning, tool_parser=tools)
    stream = ChatStreamDeltas(parser)
    deltas = [d for i in range(len(text) + 1) for d in stream.feed(text[:i], i == len(text))]
    message = parser.message(text)
    if reasoning is not None:
        assert "".join(d.get("reasoning_content", "") for d in deltas) == (message["reasoning_content"] or "")
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
    calls = [c["function"] for d in deltas for c in d.get("tool_calls", [])]
    assert calls == [c["function"] for c in message.get("tool_calls", [])]
