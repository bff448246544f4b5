"""Hostile grammars: a grammar's failure is its request's, never the engine's. A constraint that cannot compile,
exceeds the grammar budget or matches nothing is refused at admission (InvalidRequestError offline, a 400 naming
the parameter served); one that fails mid-generation (llguidance's matcher in error at a mask, a tree node's
fork or a committed token) ends its request with finish_reason "error" and the reason (a 400 when not streamed),
while the batch's other requests and the engine go on. JSON is whitespace-free by default, so the bundled demo
model completes a README-style json_schema request."""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest
import torch

from conftest import assert_no_leaks
from server_util import MODEL_NAME, ServeProcess, metric, wait_idle
from spruce import LLM, SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.errors import InvalidRequestError, InvariantError

pytest.importorskip("llguidance", reason="structured output needs spruce[grammar] (llguidance)")
jsonschema = pytest.importorskip("jsonschema")

from spruce.runtime import grammar as grammar_mod  # noqa: E402  (needs llguidance's presence checked first)
from spruce.runtime.grammar import GrammarBackend, GrammarBatch, RequestGrammar, allowed_tokens  # noqa: E402
from spruce.structured_output import StructuredOutput  # noqa: E402

PROMPT = "def f():"
# exhausts llguidance's per-mask lexer fuel a few tokens in (nested counted repetition): a mid-generation failure
HOSTILE_REGEX = "(([a-z]{1,50}){1,50}){1,51}"
HOSTILE_PATTERN = {"type": "string", "pattern": "^(([a-z]{1,50}){1,50}){1,52}$"}
EMPTY_LANGUAGES = [  # (SamplingParams field, value): the matcher is in error at its first mask
    ("json_schema", {"$ref": "#"}),
    ("json_schema", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    ("regex", "a[^\\x00-\\U0010FFFF]"),
]
# the README's json_schema example
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# a chain of rules each nesting the next: compiling it overflows an 8 MiB stack (a segfault) from ~3,000 rules
DEEP_CHAIN = "start: r0\n" + "".join(f'r{i}: "a" r{i + 1} | "c"\n' for i in range(6000)) + 'r6000: "x"\n'


@pytest.fixture(scope="module")
def engines():
    plain = LLM(max_running_requests=4)
    spec = LLM(max_running_requests=4, draft_model=str(builtin_draft_path()))
    return {"plain": plain, "spec": spec}


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_budget_failure_mid_generation_ends_only_its_request(engines, kind):
    """The issue's reproductions: the hostile regex (seed 0) and, without speculation (the served test takes it
    with), the hostile pattern (seed 2) end with finish_reason "error" naming the budget, beside healthy requests
    in the same batches that finish normally."""
    llm = engines[kind]
    hostile = [SamplingParams(max_tokens=16, seed=0, temperature=1.0, regex=HOSTILE_REGEX)]
    if kind == "plain":
        hostile.append(SamplingParams(max_tokens=16, seed=2, temperature=1.0, json_schema=HOSTILE_PATTERN))
    healthy = [SamplingParams(max_tokens=24, temperature=0, json_schema=PERSON),
               SamplingParams(max_tokens=8, temperature=0)]
    outs = llm.generate([PROMPT] * (len(hostile) + 2), hostile + healthy)
    for o, p in zip(outs, hostile):
        field = "regex" if p.regex is not None else "json_schema"
        assert o.finish_reason == "error", (o.text, o.finish_reason)
        assert o.error.startswith(field) and "grammar budget" in o.error and "too many" in o.error, o.error
    person, free = outs[len(hostile):]
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PERSON)
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    assert_no_leaks(llm)


def test_a_failed_grammar_does_not_poison_the_next_request_with_it(engines):
    """Each request compiles a matcher of its own: the one that spent its lexer's fuel shares nothing with the
    next request of the same constraint (copies of one cached matcher would share one lexer: the next request
    would fail at its first mask)."""
    llm = engines["plain"]
    first = llm.generate([PROMPT], SamplingParams(max_tokens=16, seed=0, temperature=1.0, regex=HOSTILE_REGEX))[0]
    assert first.finish_reason == "error"
    again = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, regex=HOSTILE_REGEX))[0]
    assert again.finish_reason == "length" and re.fullmatch("[a-z]+", again.text), (again.text, again.error)


@pytest.mark.parametrize("field,value", EMPTY_LANGUAGES)
def test_a_grammar_that_matches_nothing_is_refused_at_admission(engines, field, value):
    for llm in engines.values():
        with pytest.raises(InvalidRequestError, match="matches nothing") as e:
            llm.generate([PROMPT], SamplingParams(max_tokens=8, **{field: value}))
        assert e.value.field == field and e.value.status == 400
        assert_no_leaks(llm)


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return (builtin_model_path() / "tokenizer.json").read_text()


def test_a_token_refused_because_a_fork_spent_the_lexer_fails_the_grammar(tokenizer_json):
    """A tree node's fork shares its lexer with the request's matcher: once a fork has spent the lexer's fuel, the
    request's matcher refuses a token its earlier mask allowed, with its own error flag clear. That is the
    grammar's failure, not an InvariantError that ends the engine, while a token the mask refuses from a healthy
    grammar is still an engine bug."""
    backend = GrammarBackend(tokenizer_json, 4096, (1,), "regex")
    g = backend.request_grammar(StructuredOutput("regex", HOSTILE_REGEX))
    first = allowed_tokens(GrammarBatch(backend, [g]).row_masks("cpu"), 4096)[0].nonzero().flatten().tolist()
    fork, rng = g.matcher.deep_copy(), random.Random(0)
    while not fork.is_error():  # a few tokens in, its mask spends the shared lexer's fuel
        fork_grammar = RequestGrammar(fork, g.spec)
        allowed = allowed_tokens(GrammarBatch(backend, [fork_grammar]).row_masks("cpu"), 4096)[0]
        if not fork.is_error():
            fork.try_consume_tokens([rng.choice(allowed.nonzero().flatten().tolist())])
    assert not g.matcher.is_error()
    assert g.advance([first[0]]) == 0 and "grammar budget" in g.error, g.error
    digits = backend.request_grammar(StructuredOutput("regex", "[0-9]+"))
    letter = backend.tokenizer.tokenize_str("abc")[0]
    with pytest.raises(InvariantError, match="the mask was not applied"):
        digits.advance([letter])


def test_a_fork_over_its_parser_budget_fails_the_grammar(tokenizer_json, monkeypatch):
    """A tree node's forked matcher whose mask exceeds the parser budget (Earley items: its own, not shared with
    the request's matcher) fails the request's grammar, though the request's own matcher is healthy: its mask row
    allows eos alone, which the request's grammar would refuse once the node is accepted."""
    monkeypatch.setitem(grammar_mod.GRAMMAR_BUDGET, "step_max_items", 20)
    backend = GrammarBackend(tokenizer_json, 4096, (1,), "grammar")
    expressions = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/\n'
    g = backend.request_grammar(StructuredOutput("grammar", expressions))
    path = backend.tokenizer.tokenize_str("((((1+2)-(3+4))+5)-")  # one chain: node i + 1 holds path[i]
    tokens, parents = torch.tensor([[0] + path]), torch.tensor([[-1] + list(range(len(path)))])
    GrammarBatch(backend, [g]).tree_masks(tokens, parents, "cpu")
    assert not g.matcher.is_error() and "grammar budget" in g.error and "Too many items" in g.error, g.error


def test_a_failed_grammar_consumes_nothing_more(tokenizer_json):
    """A grammar failed at this step's masks (a tree node's fork over its parser budget, say) takes none of the
    step's tokens, though its own matcher is healthy: they were chosen under masks of matchers in error (eos
    alone), which its own grammar may refuse."""
    backend = GrammarBackend(tokenizer_json, 4096, (1,), "regex")
    digits = backend.request_grammar(StructuredOutput("regex", "[0-9]+"))
    digits.error = "regex failed computing a next-token mask: ..."
    assert digits.advance([1]) == 0 and not digits.matcher.is_error()


class _Inconsistent:
    """A matcher that refuses every token its mask allows, its error flag clear (a library inconsistency)."""

    def try_consume_tokens(self, tokens):
        return 0

    def is_stopped(self):
        return False

    def is_error(self):
        return False

    def deep_copy(self):
        return self

    def compute_bitmask(self):
        return b"\xff" * 512


def test_a_token_refused_against_its_own_mask_fails_the_grammar_not_the_engine():
    g = RequestGrammar(_Inconsistent(), StructuredOutput("regex", "[a-z]+"))
    assert g.advance([7, 8]) == 0 and "refused a token its own mask allows" in g.error, g.error


def test_compile_size_budget_is_named(tokenizer_json, monkeypatch):
    """A grammar over the budget's grammar size is refused, naming the budget (a budget small enough for a
    choice of 200 strings to exceed it)."""
    monkeypatch.setitem(grammar_mod.GRAMMAR_BUDGET, "max_grammar_size", 20)
    small = GrammarBackend(tokenizer_json, 4096, (1,), "choice")
    spec = StructuredOutput("choice", json.dumps([f"word{i}" for i in range(200)]))
    with pytest.raises(InvalidRequestError, match="grammar budget") as e:
        small.request_grammar(spec)
    assert e.value.field == "choice" and "max_grammar_size=20" in str(e.value) and len(str(e.value)) < 1000


def test_compile_time_budget_refuses_then_says_busy(tokenizer_json, monkeypatch):
    """A grammar that takes longer than COMPILE_SECONDS to compile is refused naming the time budget; one that
    arrives while the compile thread is still on it is answered 503 (retry), not blamed on its own grammar."""
    import threading

    monkeypatch.setattr(grammar_mod, "COMPILE_SECONDS", 0.05)
    backend = GrammarBackend(tokenizer_json, 4096, (1,), "json_schema")  # its compile thread is this test's
    released, compile_once = threading.Event(), backend._compile

    def slow_compile(text):  # the first grammar compiles until the test releases it: as slow as any budget
        released.wait(30)
        return compile_once(text)

    monkeypatch.setattr(backend, "_compile", slow_compile)
    try:
        with pytest.raises(InvalidRequestError, match="did not compile within 0.05 s") as e:
            backend.request_grammar(StructuredOutput("regex", "[0-9]+"))
        assert e.value.status == 400
        with pytest.raises(InvalidRequestError, match="busy") as e:
            backend.request_grammar(StructuredOutput("regex", "[a-z]+"))
        assert e.value.status == 503
    finally:
        released.set()


# --- served: `spruce serve` (speculation on, the engine in its own process) ---------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServeProcess(tmp_path_factory.mktemp("grammar") / "serve.log", "--context-length", "256",
                       "--max-running-requests", "4")
    try:
        yield srv.start()
    finally:
        srv.kill()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{path}", json={"model": MODEL_NAME, **body}, timeout=60)


def test_served_reproductions_are_400s_and_the_server_stays_healthy(server):
    hostile = post(server, "completions", {"prompt": PROMPT, "max_tokens": 16, "seed": 0,
                                           "structured_outputs": {"regex": HOSTILE_REGEX}})
    assert hostile.status_code == 400, hostile.text
    err = hostile.json()["error"]
    assert err["param"] == "structured_outputs.regex" and "grammar budget" in err["message"], err
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": HOSTILE_PATTERN}}
    chat = post(server, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
                                             "seed": 2, "response_format": fmt})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == "response_format.json_schema.schema", chat.text
    for field, value in EMPTY_LANGUAGES:
        key = "json" if field == "json_schema" else field
        r = post(server, "completions", {"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {key: value}})
        assert r.status_code == 400 and "matches nothing" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == f"structured_outputs.{key}"
    deep = post(server, "completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                        "structured_outputs": {"grammar": DEEP_CHAIN}})
    assert deep.status_code == 200 and re.fullmatch("a*[cx]?", deep.json()["choices"][0]["text"]), deep.text
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    scrape = wait_idle(server.base_url)
    assert metric(scrape, "spruce_requests_running") == 0 and metric(scrape, "spruce_kv_pages_used") == 0
    fine = post(server, "completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert fine.status_code == 200 and fine.json()["choices"][0]["finish_reason"] == "length"


def test_streamed_grammar_failure_is_an_error_finish_then_an_error_event(server):
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "seed": 0, "stream": True,
                            "structured_outputs": {"regex": HOSTILE_REGEX}}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
    assert finishes == ["error"], events
    assert "grammar budget" in events[-1]["error"]["message"], events[-1]


def test_readme_json_schema_example_gives_valid_json(server):
    """Whitespace-free JSON by default: the demo model completes the README's schema at each seed (free
    whitespace lets it write whitespace until max_tokens)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        r = post(server, "chat/completions", {"messages": [{"role": "user", "content": "Give me a person as JSON."}],
                                              "max_tokens": 64, "seed": seed, "response_format": fmt})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
