"""Structured output through the OpenAI server: response_format (json_object, json_schema) and vLLM's
structured_outputs reach the engine as the offline SamplingParams do, and bad values are refused naming the
request parameter."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import assert_no_leaks
from grammar_schemas import SCHEMAS
from server_util import MODEL_NAME, ServerThread, engine_kwargs, one_torch_thread  # noqa: F401
from spruce import LLM, SamplingParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="structured output needs spruce[grammar] (llguidance)")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
PROMPT = "def f():\n"


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("draft")


@pytest.fixture(scope="module")
def server(draft_dir):
    llm = LLM(**engine_kwargs(draft_dir))
    srv = ServerThread(llm.engine).start()
    yield srv
    srv.stop()
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def test_response_format_json_schema_and_json_object(client):
    person = SCHEMAS[11]  # {name, age}: the demo model completes it here (JSON whitespace is free, as in vLLM)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "answer"}],
                                          max_tokens=40, temperature=0, response_format=fmt)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), person)
    done = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}})
    text = done.choices[0].text
    assert text.lstrip().startswith("{") and (done.choices[0].finish_reason != "stop" or
                                              isinstance(json.loads(text), dict))


def test_structured_outputs_match_offline(client, draft_dir):
    """vLLM's structured_outputs: each constraint gives the offline engine's greedy output for it."""
    offline = LLM(**engine_kwargs(draft_dir))
    cases = [({"regex": "[a-z]+( [a-z]+)*"}, dict(regex="[a-z]+( [a-z]+)*")),
             ({"choice": ["yes", "no"]}, dict(choice=["yes", "no"])),
             ({"json": SCHEMA}, dict(json_schema=SCHEMA)),
             ({"grammar": 'start: "x=" /[0-9]{1,2}/'}, dict(grammar='start: "x=" /[0-9]{1,2}/'))]
    for body, kw in cases:
        got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"structured_outputs": body}).choices[0].text
        want = offline.generate([PROMPT], SamplingParams(max_tokens=12, **kw))[0].text
        assert got == want, body
    assert_no_leaks(offline)


USER = [{"role": "user", "content": "hi"}]
BAD = [  # (body, param, words in the message)
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "foo"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}, "structured_outputs.grammar", "at most one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "unknown field"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "send one"),
    ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
]


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("extra,param,words", BAD)
def test_bad_structured_output_is_refused_by_name(server, path, extra, param, words):
    body = {"messages": USER} if path.startswith("chat") else {"prompt": PROMPT}
    r = httpx.post(f"{server.base_url}/v1/{path}", json={"model": MODEL_NAME, "max_tokens": 4, **body, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
