"""OpenAI-compatible server: a real uvicorn server (bundled pycode-6m, EAGLE-3 speculation with an oracle draft
so rounds commit several tokens) driven by the official `openai` client, compared with offline LLM.generate."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from conftest import assert_no_leaks
from oracle_draft import install_oracle
from server_util import MODEL_NAME, ServerThread, engine_kwargs, metric, one_torch_thread, wait_idle  # noqa: F401
from spruce import LLM, SamplingParams
from spruce.server.engine_loop import EngineFailure, Mailbox
from spruce.server.protocol import TextDelta, choice_seed, stop_prefix_len

KEY = "sk-spruce-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 256
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Config:\n", "for i in range(10):\n"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    return LLM(**engine_kwargs(tmp_path_factory.mktemp("draft"), context_length=CONTEXT))


@pytest.fixture(scope="module")
def reference(offline):
    """Greedy offline outputs for PROMPTS and for the chat prompt."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    outs = {p: o for p, o in zip(PROMPTS, offline.generate(PROMPTS, greedy))}
    chat_ids = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    outs["chat"] = offline.generate([chat_ids], greedy)[0]
    return outs


CHAT = [{"role": "system", "content": "python"}, {"role": "user", "content": "write a parser"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, reference):
    llm = LLM(**engine_kwargs(tmp_path_factory.mktemp("draft"), context_length=CONTEXT))
    oracle = install_oracle(llm, 0.7)  # most drafts right: rounds commit up to S+1 tokens
    for out in reference.values():
        oracle.add_reference(out.prompt_token_ids, out.token_ids)
    srv = ServerThread(llm.engine, api_key=KEY, metrics_no_auth=True).start()  # scraped without the key
    yield srv
    srv.stop()
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_completions_match_offline(client, reference):
    for prompt in PROMPTS:
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        want = reference[prompt]
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_batched_and_token_id_prompts(client, reference):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in r.choices] == [reference[p].text for p in PROMPTS[:2]]
    assert r.usage.prompt_tokens == sum(len(reference[p].prompt_token_ids) for p in PROMPTS[:2])
    ids = reference[PROMPTS[2]].prompt_token_ids
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference[PROMPTS[2]].text and r.usage.prompt_tokens == len(ids)


def test_completions_stream_with_usage(client, reference):
    want = reference[PROMPTS[1]]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_offline(client, reference):
    want = reference["chat"]
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.total_tokens == len(want.prompt_token_ids) + len(want.token_ids)


def test_penalties_match_offline(client, offline):
    """presence_penalty and frequency_penalty (OpenAI's) and repetition_penalty (vLLM's extension, through
    extra_body) reach the engine: the speculative server gives offline plain-API output with the same values."""
    kw = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3)
    want = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, **kw))[0].text
    chat_ids = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    want_chat = offline.generate([chat_ids], SamplingParams(max_tokens=MAX_TOKENS, **kw))[0].text
    extra = dict(presence_penalty=0.5, frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3})
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, **extra)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                          **extra)
    assert r.choices[0].text == want and chat.choices[0].message.content == want_chat
    assert want != offline.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS))[0].text


def test_n2_greedy_and_seeded(client, reference):
    want = reference[PROMPTS[0]]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.text for c in r.choices] == [want.text, want.text] and [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 2 * len(want.token_ids)
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=123)
    a = client.completions.create(n=2, **kw)
    b = client.completions.create(n=2, **kw)
    one = client.completions.create(n=1, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # reproducible
    assert a.choices[0].text != a.choices[1].text  # distinct per-choice seeds
    assert one.choices[0].text == a.choices[0].text
    assert len({choice_seed(123, i) for i in range(8)}) == 8
    chunks = list(client.completions.create(n=2, stream=True, **kw))
    for i in range(2):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == a.choices[i].text


def test_stop_strings(client, reference):
    text = reference[PROMPTS[0]].text
    stop = text[10:13]
    cut = text[:text.find(stop)]
    for stops in (stop, ["\u00ff\u00ff", stop]):
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                      stop=stops)
        assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                temperature=0, stop=stops, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_text_delta_holds_back_stop_prefixes_and_partial_chars():
    assert stop_prefix_len("abc END", ("ENDX",)) == 3 and stop_prefix_len("abc", ("x",)) == 0
    d = TextDelta(("STOP",))
    assert d.feed("hello ST", False) == "hello "
    assert d.feed("hello STa\ufffd", False) == "STa"
    assert d.feed("hello STaé", False) == "é"
    assert d.feed("hello STaéS", True) == "S"


def test_mailbox_keeps_only_the_latest_output():
    async def main():
        box = Mailbox()
        poster = threading.Thread(target=lambda: [box.post(i % 2, i) for i in range(100)])
        poster.start()
        await asyncio.to_thread(poster.join)
        assert await box.take() == {0: 98, 1: 99}  # a slow reader gets the latest, not a backlog
        fail = EngineFailure("boom")
        box.post(0, fail)
        box.post(0, 100)
        assert await box.take() == {0: fail}  # a failure is final

    asyncio.run(main())


def test_multi_token_rounds_in_metrics(server, client):
    for prompt in PROMPTS:  # greedy requests the oracle draft knows: rounds commit several tokens
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    text = httpx.get(f"{server.base_url}/metrics").text
    assert metric(text, "spruce_spec_mean_accept_length") > 1.5
    assert metric(text, "spruce_spec_accept_length_count") > 0
    assert metric(text, "spruce_time_to_first_token_seconds_count") > 0
    assert metric(text, "spruce_inter_token_latency_seconds_count") > 0
    assert metric(text, "spruce_generation_tokens_total") > 0
    for name in ("spruce_requests_running", "spruce_requests_waiting", "spruce_kv_pages_free",
                 "spruce_generation_tokens_per_second", "spruce_spec_accept_rate",
                 "spruce_e2e_request_latency_seconds_sum"):
        metric(text, name)


def test_models_health_metrics(server):
    r = httpx.get(f"{server.base_url}/v1/models", headers=AUTH)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL_NAME
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/metrics").headers["content-type"].startswith("text/plain")


def test_server_info_names_device_and_speculation(server):
    """The serving benchmark names its results after the server's device, read from spruce_server_info."""
    from spruce.bench.serving import server_info

    info = server_info(server.base_url, {})
    assert info["device"].startswith("cpu (") and info["speculative"].startswith("EAGLE3 S=")
    assert info["attention_backend"] == "torch" and info["cuda_graph_buckets"] == "off"
    assert info["cuda_graphs_captured"] == "0"


GOOD = {"model": MODEL_NAME, "prompt": "def f():\n", "max_tokens": 4}
USER = [{"role": "user", "content": "hi"}]
NOT_SUPPORTED = [  # (endpoint, field, a value that would change the output)
    ("completions", "best_of", 2),
    ("completions", "skip_special_tokens", False),
    ("completions", "guided_json", {"type": "object"}), ("completions", "suffix", "x"),
    ("chat/completions", "chat_template", "{{ 1 }}"),
]
NEUTRAL = {  # values of the not-supported-yet fields that change nothing: accepted
    "completions": dict(best_of=1,
                        include_stop_str_in_output=False, skip_special_tokens=True, guided_json=None,
                        response_format={"type": "text"}, echo=False, logprobs=None),
    "chat/completions": dict(tools=[], tool_choice="none", top_logprobs=0, continue_final_message=False,
                             chat_template=None, n=2, best_of=2),
}
BAD = [
    ("completions", "{not json", 400, None),
    ("completions", "[1, 2]", 400, None),
    ("completions", {"model": MODEL_NAME, "max_tokens": 4}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": 7}, 400, "prompt"),
    ("completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {**GOOD, "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("completions", {**GOOD, "top_k": -2}, 400, "top_k"),
    ("completions", {**GOOD, "n": 0}, 400, "n"),
    ("completions", {**GOOD, "n": True}, 400, "n"),
    ("completions", {**GOOD, "seed": -5}, 400, "seed"),
    ("completions", {**GOOD, "stop": [1]}, 400, "stop"),
    ("completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),  # more than vLLM's 20 (tests/test_logprobs.py)
    ("completions", {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("chat/completions", {"messages": USER, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL_NAME, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("chat/completions", {"model": MODEL_NAME, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    # lone surrogates (json.dumps writes them as "\ud800" escapes) in every text field that reaches the tokenizer
    ("completions", {**GOOD, "prompt": "a\ud800b"}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": ["ok", "a\udfffb"]}, 400, "prompt[1]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, 400,
     "messages[0].content[0].text"),
    ("chat/completions", {"messages": [{"role": "\udc00", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, 400,
     "messages[0].name"),
    ("completions", {**GOOD, "stop": "\ud800"}, 400, "stop"),
    # unchecked values
    ("completions", {**GOOD, "stop": ""}, 400, "stop"),
    ("completions", {**GOOD, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("completions", {**GOOD, "stop_token_ids": [4096]}, 400, "stop_token_ids"),
    ("completions", {**GOOD, "stop_token_ids": [1] * 10_000}, 400, "stop_token_ids"),
    ("completions", {**GOOD, "max_tokens": 10**9}, 400, "max_tokens"),
    ("completions", {**GOOD, "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 10**9}, 400, "max_tokens"),
    # fields that would be dropped
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "no_such_key": []}]}, 400,
     "messages[0].no_such_key"),
    ("completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    *[(path, {**({"messages": USER} if path.startswith("chat") else GOOD), field: value}, 400, field)
      for path, field, value in NOT_SUPPORTED],
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_requests(server, path, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.base_url}/v1/{path}", content=content,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if any(field == param for _, field, _ in NOT_SUPPORTED):
        assert "not supported yet" in err["message"]


def test_lone_surrogates_arrive_as_such():
    """What test_bad_requests sends: JSON escapes of lone surrogates, which json.loads turns into lone
    surrogates (and which tokenizers refuse with TypeError)."""
    raw = json.dumps({"prompt": "a\ud800b"})
    assert raw == '{"prompt": "a\\ud800b"}'
    assert json.loads(raw)["prompt"] == "a\ud800b"
    with pytest.raises(UnicodeEncodeError):
        json.loads(raw)["prompt"].encode()


@pytest.mark.parametrize("path", sorted(NEUTRAL))
def test_neutral_values_of_unsupported_fields_are_accepted(server, path):
    body = {"messages": USER} if path.startswith("chat") else dict(GOOD)
    r = httpx.post(f"{server.base_url}/v1/{path}", json={**body, "max_tokens": 2, **NEUTRAL[path]}, headers=AUTH)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/json; charset=latin-1", "application/jsonx"])
def test_non_json_content_type_is_refused(server, content_type):
    """A web page may POST text/plain (or no Content-Type) cross-origin without a CORS preflight."""
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    r = httpx.post(f"{server.base_url}/v1/completions", content=json.dumps(GOOD), headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"


def test_json_content_type_with_charset_is_accepted(server):
    for content_type in ("application/json; charset=utf-8", "Application/JSON;charset=\"UTF-8\""):
        r = httpx.post(f"{server.base_url}/v1/completions", content=json.dumps(GOOD),
                       headers={**AUTH, "Content-Type": content_type})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("temperature", [1e-39, 9.9e-6])
def test_tiny_temperature_is_greedy(client, reference, temperature):
    """Below 1e-5 a temperature is greedy; 1e-39 used to overflow the logits and pick token 0 every step."""
    want = reference[PROMPTS[0]]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=temperature, seed=3)
    assert r.choices[0].text == want.text


def test_advertised_limit_and_default_max_tokens(server):
    """/v1/models names the true per-request limit; a chat request without max_tokens gets the room left."""
    card = httpx.get(f"{server.base_url}/v1/models", headers=AUTH).json()["data"][0]
    assert card["max_model_len"] == CONTEXT
    ids = server.engine.tokenizer.encode(GOOD["prompt"])
    r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH,
                   json={**GOOD, "max_tokens": CONTEXT - len(ids), "stop": "\n"})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH,
                   json={**GOOD, "max_tokens": CONTEXT - len(ids) + 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens" and f"<= {CONTEXT - len(ids)}" in err["message"]


def test_api_key_required(server):
    url = f"{server.base_url}/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url, json=GOOD, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_route_is_json_404(server):
    r = httpx.get(f"{server.base_url}/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_oversized_body_and_prompt(server):
    url = f"{server.base_url}/v1/completions"
    big = json.dumps({**GOOD, "prompt": "x" * (5 << 20)}).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(url, content=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(url, content=(big[i:i + 65536] for i in range(0, len(big), 65536)), headers=headers)  # chunked
    assert r.status_code == 413
    r = httpx.post(url, json={**GOOD, "prompt": "x = 1\n" * CONTEXT}, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "x = 1\n" * CONTEXT}]})
    assert r.status_code == 413 and r.json()["error"]["param"] == "messages"


def test_disconnect_mid_stream_frees_pages(server):
    body = {**GOOD, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    text = wait_idle(server.base_url)
    assert metric(text, "spruce_kv_pages_used") == 0
    server.engine.check_no_leaks()


def test_serve_cli_flags():
    from spruce.cli import build_parser
    from spruce.server.cli import served_name

    args = build_parser().parse_args(["serve", "--port", "1234", "--api-key", "k", "--speculative-num-steps", "3"])
    assert (args.host, args.port, args.api_key, args.speculative_num_steps) == ("127.0.0.1", 1234, "k", 3)
    assert served_name(args) == MODEL_NAME
    args = build_parser().parse_args(["serve", "--model", "/m/llama", "--served-model-name", "llama"])
    assert served_name(args) == "llama"
    assert (args.max_queued_requests, args.request_timeout, args.shutdown_grace_period) == (256, 600.0, 30.0)
    assert not args.keep_alive_on_engine_failure  # a failed engine ends the process (exit code 70)
    assert build_parser().parse_args(["serve", "--keep-alive-on-engine-failure"]).keep_alive_on_engine_failure
    args = build_parser().parse_args(["serve", "--max-queued-requests", "0", "--request-timeout", "2.5",
                                      "--shutdown-grace-period", "0"])
    assert (args.max_queued_requests, args.request_timeout, args.shutdown_grace_period) == (0, 2.5, 0.0)
    for bad in (["--max-queued-requests", "-1"], ["--request-timeout", "-1"], ["--shutdown-grace-period", "nan"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
