"""vLLM's request shapes against spruce's server (bundled demo model): every field of vLLM's completions and
chat-completions requests (vLLM 0.26: vllm/entrypoints/openai/completion/protocol.py and
chat_completion/protocol.py, CompletionRequest and ChatCompletionRequest) sent at its default value is accepted
and changes nothing; the honoured ones change the output as in vLLM; the unimplemented ones, set to another
value, are refused naming the field; unknown fields are ignored with a log line."""

from __future__ import annotations

import re

import httpx
import pytest

from conftest import assert_no_leaks
from server_util import LogRecorder, ServerThread, one_torch_thread  # noqa: F401
from spruce import LLM

PROMPT = "def add(a, b):\n"
CHAT = [{"role": "user", "content": "def add(a, b):"}]
GREEDY = {"temperature": 0, "max_tokens": 8}

# vLLM's fields shared by both endpoints, at their defaults
SHARED_DEFAULTS = {
    "model": None, "frequency_penalty": 0.0, "logit_bias": None, "n": 1, "presence_penalty": 0.0, "seed": None,
    "stop": [], "stream": False, "stream_options": None, "top_p": None, "user": None,
    "use_beam_search": False, "top_k": None, "min_p": None, "repetition_penalty": None, "length_penalty": 1.0,
    "stop_token_ids": [], "include_stop_str_in_output": False, "ignore_eos": False, "min_tokens": 0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "allowed_token_ids": None, "prompt_logprobs": None, "response_format": None, "structured_outputs": None,
    "priority": 0, "logits_processors": None, "return_tokens_as_token_ids": None, "return_token_ids": None,
    "cache_salt": None, "kv_transfer_params": None, "vllm_xargs": None, "max_repetition_pattern_size": 0,
    "min_repetition_pattern_size": 0, "repetition_min_count": 0,
}
COMPLETION_DEFAULTS = {**SHARED_DEFAULTS, "echo": False, "logprobs": None, "suffix": None, "prompt_embeds": None,
                       "add_special_tokens": True}
CHAT_DEFAULTS = {
    **SHARED_DEFAULTS, "logprobs": False, "top_logprobs": 0, "max_completion_tokens": None, "tools": None,
    "tool_choice": "none", "reasoning_effort": None, "include_reasoning": True, "parallel_tool_calls": True,
    "bad_words": [], "echo": False, "add_generation_prompt": True, "continue_final_message": False,
    "add_special_tokens": False, "documents": None, "chat_template": None, "chat_template_kwargs": None,
    "mm_processor_kwargs": None,
}
SGLANG_DEFAULTS = {"regex": None, "ebnf": None, "rid": None, "no_stop_trim": False}

# fields spruce does not implement, at a value that would change the output
REFUSED = [
    ("completions", "use_beam_search", True), ("completions", "length_penalty", 0.5),
    ("completions", "spaces_between_special_tokens", False), ("completions", "priority", 1),
    ("completions", "logits_processors", ["m.P"]),
    ("completions", "cache_salt", "s"), ("completions", "kv_transfer_params", {"a": 1}),
    ("completions", "vllm_xargs", {"a": 1}), ("completions", "max_repetition_pattern_size", 4),
    ("completions", "min_repetition_pattern_size", 2), ("completions", "repetition_min_count", 3),
    ("completions", "prompt_embeds", "AAAA"),
    ("chat/completions", "mm_processor_kwargs", {"a": 1}),
    ("chat/completions", "chat_template", "{{ 1 }}"),
    # tools default to tool_choice "auto", which needs a server started with a tool-call parser
    ("chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
]


@pytest.fixture(scope="module")
def server():
    llm = LLM(page_size=4, max_running_requests=8, disable_radix_cache=True)
    srv = ServerThread(llm.engine).start()
    yield srv
    srv.stop()
    assert_no_leaks(llm)


def ok(server, path: str, body: dict) -> dict:
    r = server.post_v1(path, body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(server, body: dict) -> list[int]:
    r = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_every_vllm_field_at_its_default_is_accepted_and_changes_nothing(server):
    plain = ok(server, "completions", {"prompt": PROMPT, **GREEDY})
    full = ok(server, "completions", {**COMPLETION_DEFAULTS, **SGLANG_DEFAULTS, "prompt": PROMPT, **GREEDY})
    assert full["choices"][0]["text"] == plain["choices"][0]["text"]
    assert full["usage"] == plain["usage"]
    plain = ok(server, "chat/completions", {"messages": CHAT, **GREEDY})
    full = ok(server, "chat/completions", {**CHAT_DEFAULTS, **SGLANG_DEFAULTS, "messages": CHAT, **GREEDY})
    assert full["choices"][0]["message"] == plain["choices"][0]["message"]
    assert full["usage"] == plain["usage"]


def test_unknown_fields_are_ignored_with_a_log_line(server):
    with LogRecorder() as logs:
        body = ok(server, "completions", {"prompt": PROMPT, **GREEDY, "no_such_field": 1})
        logs.wait_for("ignored: ['no_such_field']")
    assert body["choices"][0]["text"] == ok(server, "completions", {"prompt": PROMPT, **GREEDY})["choices"][0]["text"]


@pytest.mark.parametrize("path,field,value", REFUSED)
def test_unimplemented_fields_are_refused_by_name(server, path, field, value):
    body = {"messages": CHAT} if path.startswith("chat") else {"prompt": PROMPT}
    r = server.post_v1(path, {**body, **GREEDY, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    param = "tool_choice" if field == "tools" else field
    assert err["param"] == param and param in err["message"]


def test_tool_choice_none_with_tools_changes_nothing(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plain = ok(server, "chat/completions", {"messages": CHAT, **GREEDY})
    body = ok(server, "chat/completions", {"messages": CHAT, **GREEDY, "tools": tools, "tool_choice": "none"})
    assert body["choices"][0]["message"] == plain["choices"][0]["message"]


def test_prompt_logprobs(server):
    ids = tokenize(server, {"prompt": PROMPT})
    body = ok(server, "completions", {"prompt": PROMPT, **GREEDY, "prompt_logprobs": 2})
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:]):  # the prompt's token, plus up to 2 alternatives
        assert str(token_id) in entry and 1 <= len(entry) <= 3
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
    chat = ok(server, "chat/completions", {"messages": CHAT, **GREEDY, "prompt_logprobs": 0})
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    r = server.post_v1("completions", {"prompt": PROMPT, **GREEDY, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = tokenize(server, {"prompt": PROMPT})
    body = ok(server, "completions", {"prompt": PROMPT, **GREEDY, "truncate_prompt_tokens": 3})
    assert body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["text"] == ok(server, "completions", {"prompt": ids[-3:], **GREEDY})["choices"][0]["text"]
    whole = ok(server, "completions", {"prompt": PROMPT, **GREEDY, "truncate_prompt_tokens": -1})
    assert whole["usage"]["prompt_tokens"] == len(ids)
    for value in (0, 10**9):
        r = server.post_v1("completions", {"prompt": PROMPT, **GREEDY, "truncate_prompt_tokens": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_return_token_ids_stream_and_not(server):
    ids = tokenize(server, {"prompt": PROMPT})
    body = ok(server, "completions", {"prompt": PROMPT, **GREEDY, "return_token_ids": True})
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    detok = httpx.post(f"{server.base_url}/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert detok == choice["text"]
    streamed, prompt_ids = [], []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"messages": CHAT, **GREEDY, "return_token_ids": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                prompt_ids += chunk.get("prompt_token_ids") or []
                streamed += [t for c in chunk["choices"] for t in c.get("token_ids", [])]
    chat = ok(server, "chat/completions", {"messages": CHAT, **GREEDY, "return_token_ids": True})
    assert streamed == chat["choices"][0]["token_ids"] and prompt_ids == chat["prompt_token_ids"]
    assert prompt_ids == tokenize(server, {"messages": CHAT})


def test_add_generation_prompt_and_continue_final_message(server):
    no_prompt = ok(server, "chat/completions", {"messages": CHAT, **GREEDY, "add_generation_prompt": False})
    assert no_prompt["usage"]["prompt_tokens"] == len(tokenize(server, {"messages": CHAT,
                                                                        "add_generation_prompt": False}))
    assert no_prompt["usage"]["prompt_tokens"] < len(tokenize(server, {"messages": CHAT}))
    via_kwargs = ok(server, "chat/completions", {"messages": CHAT, **GREEDY,
                                                 "chat_template_kwargs": {"add_generation_prompt": False}})
    assert via_kwargs["usage"] == no_prompt["usage"]
    r = server.post_v1("chat/completions", {"messages": CHAT, **GREEDY, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    history = [*CHAT, {"role": "assistant", "content": "    return"}]
    body = ok(server, "chat/completions", {"messages": history, **GREEDY, "continue_final_message": True,
                                           "add_generation_prompt": False, "return_token_ids": True})
    # the bundled template writes "<|begin_of_text|>{role}\n{content}\n" per message: the text ends at "return"
    rendered = "<|begin_of_text|>user\ndef add(a, b):\n<|begin_of_text|>assistant\n    return"
    assert body["prompt_token_ids"] == tokenize(server, {"prompt": rendered, "add_special_tokens": False})
    r = server.post_v1("chat/completions", {"messages": history, **GREEDY, "continue_final_message": True,
                                          "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_add_special_tokens(server):
    with_bos = ok(server, "completions", {"prompt": PROMPT, **GREEDY, "return_token_ids": True})
    without = ok(server, "completions", {"prompt": PROMPT, **GREEDY, "return_token_ids": True,
                                         "add_special_tokens": False})
    assert without["choices"][0]["prompt_token_ids"] == tokenize(server, {"prompt": PROMPT,
                                                                          "add_special_tokens": False})
    assert without["choices"][0]["prompt_token_ids"] != with_bos["choices"][0]["prompt_token_ids"]


def test_rid_and_request_id_name_the_response(server):
    assert ok(server, "completions", {"prompt": PROMPT, **GREEDY, "rid": "my-rid"})["id"] == "my-rid"
    assert ok(server, "chat/completions", {"messages": CHAT, **GREEDY, "request_id": "abc"})["id"] == "chatcmpl-abc"
    # the same id twice: the engine keeps its own (unique) ids
    bodies = [{"prompt": PROMPT, **GREEDY, "rid": "same", "n": 2}] * 2
    with httpx.Client(timeout=60) as c:
        outs = [c.post(f"{server.base_url}/v1/completions", json=b).json() for b in bodies]
    assert [o["id"] for o in outs] == ["same", "same"]


def test_sglang_regex_and_ebnf(server):
    pytest.importorskip("llguidance", reason="structured output needs spruce[grammar] (llguidance)")
    text = ok(server, "completions", {"prompt": PROMPT, **GREEDY, "regex": "[0-9]{3}"})["choices"][0]["text"]
    assert re.fullmatch("[0-9]{3}", text)
    text = ok(server, "completions", {"prompt": PROMPT, **GREEDY, "ebnf": 'start: "yes" | "no"'})["choices"][0]["text"]
    assert text in ("yes", "no")
    r = server.post_v1("completions", {"prompt": PROMPT, **GREEDY, "regex": "a", "ebnf": 'start: "b"'})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("regex", "ebnf")


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "no_stop_trim"])
def test_stop_string_kept_stream_and_not(server, field):
    text = ok(server, "completions", {"prompt": PROMPT, **GREEDY})["choices"][0]["text"]
    stop = text[3:5]
    body = {"prompt": PROMPT, **GREEDY, "stop": [stop], field: True}
    kept = ok(server, "completions", body)["choices"][0]
    assert kept["text"] == text[:text.find(stop)] + stop and kept["finish_reason"] == "stop"
    cut = ok(server, "completions", {**body, field: False})["choices"][0]["text"]
    assert cut == text[:text.find(stop)]
    streamed = ""
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += "".join(c["text"] for c in httpx.Response(200, content=line[6:]).json()["choices"])
    assert streamed == kept["text"]


def test_return_tokens_as_token_ids(server):
    body = {"prompt": PROMPT, **GREEDY, "logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = ok(server, "completions", body)["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    chat = ok(server, "chat/completions", {"messages": CHAT, **GREEDY, "logprobs": True, "top_logprobs": 1,
                                           "return_tokens_as_token_ids": True})
    assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])


def test_chat_echo_starts_with_the_final_assistant_message(server):
    history = [*CHAT, {"role": "assistant", "content": "    return"}]
    body = {"messages": history, **GREEDY, "continue_final_message": True, "add_generation_prompt": False}
    plain = ok(server, "chat/completions", body)["choices"][0]["message"]["content"]
    echoed = ok(server, "chat/completions", {**body, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == "    return" + plain
    streamed = ""
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={**body, "echo": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += "".join(c["delta"].get("content") or ""
                                    for c in httpx.Response(200, content=line[6:]).json()["choices"])
    assert streamed == echoed
    user_last = ok(server, "chat/completions", {"messages": CHAT, **GREEDY, "echo": True})
    assert user_last["choices"][0]["message"] == ok(server, "chat/completions",
                                                    {"messages": CHAT, **GREEDY})["choices"][0]["message"]
