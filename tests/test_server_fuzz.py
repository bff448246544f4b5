"""A hostile client against a live `spruce serve` (the bundled demo model, its defaults, on loopback): a few hundred
random and adversarial requests from a seeded generator on /v1/completions, /v1/chat/completions, /tokenize and
/detokenize, several at once. The server never answers 5xx (but 503 when overloaded), never dies, and leaks
nothing: afterwards /metrics shows no running or waiting request and no KV page in use beyond the prefix cache's,
and the RSS of its processes is back within 20% of what it was after a warm-up.

What the generator draws from: a valid base request with one to three fields replaced by odd values (lone
surrogates, NUL, huge and negative integers, 1e308, NaN, deep nesting, wrong types, unknown fields), odd prompts
(token ids out of range, lists of lists, empty), a grammar, regex or JSON schema from `PATHOLOGICAL` (known hard
cases for grammar engines), and raw bodies that are not JSON at all. The same reproductions of issue 76's
input-validation items are also replayed one by one (`test_reproductions_are_400s`), on the same server.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from server_util import ServeProcess, metric, wait_idle

SEED = 76
NUM_REQUESTS = 300
CONCURRENCY = 6
VOCAB = 4096  # the bundled demo model's
RSS_SLACK = 0.20

# Grammars, regexes and schemas known to be hard for a grammar engine: exponential or huge automata, recursion,
# empty languages, unsatisfiable or self-referencing schemas. name -> structured_outputs / response_format value.
PATHOLOGICAL = {
    "nested_counted_regex": {"regex": "(([a-z]{1,50}){1,50}){1,51}"},
    "schema_pattern_nested_counts": {"json_schema": {"type": "string", "pattern": "^(([a-z]{1,50}){1,50}){1,52}$"}},
    "schema_self_ref": {"json_schema": {"$ref": "#"}},
    "schema_defs_cycle": {"json_schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                          "$ref": "#/$defs/a"}},
    "regex_empty_language": {"regex": "[^\\s\\S]"},
    "regex_backrefs_and_lookahead": {"regex": "(a)\\1(?=b)"},
    "regex_huge_repeat": {"regex": "a{20000}"},
    "regex_alternation_blowup": {"regex": "(a|aa|aaa|aaaa)*(b|bb)*c{3,7}"},
    "regex_unbalanced": {"regex": "(((("},
    "regex_dot_star_counts": {"regex": "(.*){1,40}x"},
    "schema_unsatisfiable": {"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}},
    "schema_deep_nesting": {"json_schema": {"type": "object", "properties": {"a": json.loads(
        '{"type": "object", "properties": {"a": ' * 40 + '{"type": "string"}' + "}}" * 40)}}},
    "schema_huge_enum": {"json_schema": {"enum": [f"value{i}" for i in range(2000)]}},
    "schema_long_min_length": {"json_schema": {"type": "string", "minLength": 100000}},
    "schema_bad_type": {"json_schema": {"type": "no-such-type"}},
    "grammar_left_recursion": {"grammar": "start: start \"a\" | \"a\""},
    "grammar_garbage": {"grammar": "start: ((( \"a\" ||| ]]"},
    "grammar_undefined_rule": {"grammar": "start: missing_rule"},
    "choice_empty_list": {"choice": []},
    "choice_empty_string": {"choice": [""]},
    "choice_many": {"choice": [f"c{i}" * 20 for i in range(100)]},
}
# Cases a fix in another area has not landed yet: name -> what is pending. The generator leaves them out and
# test_pathological_grammar skips them, naming it; remove an entry once its fix is in.
PENDING: dict[str, str] = {}

ODD_TEXT = ["\ud800", "a\udfffb", "\udc00\ud800", "\x00", "\u202e\u200b\ufeff", "\U0001f600" * 50, "e\u0301" * 30,
            "\uffff\ufffe", "🂡\u0000\u0085\u2028", "x" * 3000, "", " ", "\\u0000", "'; DROP TABLE x; --",
            "{{ raise_exception('x') }}", "<|begin_of_text|><|end_of_text|>"]
ODD_NUMBERS = [0, -1, 1, 2, 7, 2**31, 2**31 - 1, 2**32, 2**63, 2**64, 2**70, -2**70, 10**30, -0.0, 0.5, 1e-300,
               1e308, -1e308, 3.5, float("nan"), float("inf"), -float("inf")]
FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream",
          "stream_options", "ignore_eos", "user", "presence_penalty", "frequency_penalty", "logprobs", "best_of",
          "logit_bias", "min_tokens", "min_p", "repetition_penalty", "include_stop_str_in_output",
          "skip_special_tokens", "response_format", "structured_outputs", "guided_json", "echo", "suffix",
          "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "no_such_field", "prompt", "messages"]


def deep(depth: int, leaf="x", kind: str = "list"):
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


class RequestGenerator:
    """Seeded random requests: (method, path, JSON-serialisable body or raw bytes, headers)."""

    def __init__(self, seed: int, pathological: dict):
        self.r = random.Random(seed)
        self.pathological = pathological

    def odd_value(self, depth: int = 0):
        r = self.r
        kind = r.randrange(10)
        if kind == 0:
            return r.choice(ODD_TEXT)
        if kind == 1:
            return r.choice(ODD_NUMBERS)
        if kind == 2:
            return r.choice([None, True, False, [], {}, "", [None], {"": None}])
        if kind == 3:
            return deep(r.choice([5, 50, 300]), r.choice([1, "a", None]), r.choice(["list", "dict"]))
        if kind == 4 and depth < 2:
            return [self.odd_value(depth + 1) for _ in range(r.randrange(4))]
        if kind == 5 and depth < 2:
            return {r.choice(ODD_TEXT + ["type", "json", "regex", "0", "-5", "٣"]): self.odd_value(depth + 1)
                    for _ in range(r.randrange(3))}
        if kind == 6:
            return self.token_ids()
        if kind == 7:
            return {"type": r.choice(["json_schema", "json_object", "text", "bogus"]),
                    "json_schema": {"name": r.choice(ODD_TEXT), "schema": self.schema()}}
        if kind == 8:
            return {r.choice(["-1", "--5", "²", "٣", "4096", "0", "1" * 30, "1e3", " 7", "0x10"]): r.choice(ODD_NUMBERS)}
        return r.randrange(-3, 20)

    def token_ids(self) -> list:
        r = self.r
        return [r.choice([r.randrange(VOCAB), -1, VOCAB, VOCAB - 1, 2**31, 2**63, 2**70, 0])
                for _ in range(r.randrange(0, 6))]

    def schema(self):
        name = self.r.choice(sorted(self.pathological) or [None])
        spec = self.pathological.get(name) or {}
        return spec.get("json_schema", {"type": "object"})

    def prompt(self):
        r = self.r
        return r.choice([
            lambda: "def f(" + r.choice(ODD_TEXT),
            lambda: r.choice(ODD_TEXT),
            lambda: self.token_ids(),
            lambda: [self.token_ids() for _ in range(r.randrange(1, 4))],
            lambda: ["import os", r.choice(ODD_TEXT)],
            lambda: [],
            lambda: [[]],
            lambda: deep(r.choice([3, 400])),
            lambda: "class A:\n",
        ])()

    def messages(self):
        r = self.r
        return r.choice([
            lambda: [{"role": "user", "content": r.choice(ODD_TEXT)}],
            lambda: [{"role": r.choice(ODD_TEXT), "content": "hi"}],
            lambda: [{"role": "user", "content": [{"type": "text", "text": r.choice(ODD_TEXT)}]}],
            lambda: [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            lambda: [{"role": "user", "content": "x", "name": r.choice(ODD_TEXT)}] * r.randrange(1, 40),
            lambda: [],
            lambda: "not a list",
            lambda: [{"role": "user"}],
            lambda: [{"role": "system", "content": None}, {"role": "user", "content": "def f"}],
        ])()

    def structured(self) -> dict:
        """A random pathological constraint, through either structured_outputs or response_format."""
        r = self.r
        name = r.choice(sorted(self.pathological))
        spec = self.pathological[name]
        if "json_schema" in spec and r.random() < 0.5:
            return {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "x", "schema": spec["json_schema"]}}}
        key, value = next(iter(spec.items()))
        return {"structured_outputs": {"json" if key == "json_schema" else key: value}}

    def valid_options(self, chat: bool) -> dict:
        """A random mix of options every one of which is valid (the engine runs these)."""
        r = self.r
        options = {
            "n": r.randrange(1, 4), "stop": [r.choice(["\n", ")", "def", "é"])], "stream": r.random() < 0.5,
            "presence_penalty": r.uniform(-2, 2), "frequency_penalty": r.uniform(-2, 2),
            "repetition_penalty": r.uniform(0.5, 2), "min_p": r.uniform(0, 0.5), "top_k": r.randrange(-1, 50),
            "top_p": r.uniform(0.1, 1), "logit_bias": {str(r.randrange(VOCAB)): r.uniform(-100, 100)},
            "stop_token_ids": [r.randrange(VOCAB)], "ignore_eos": r.random() < 0.5,
            "structured_outputs": {"regex": r.choice(["[a-z]+", "(ab|cd){2,5}", "[0-9]{1,3}"])},
        }
        options.update({"logprobs": True, "top_logprobs": r.randrange(0, 4)} if chat else
                       {"logprobs": r.randrange(0, 4), "echo": r.random() < 0.5})
        return dict(r.sample(sorted(options.items()), r.randrange(1, 5)))

    def generation(self, chat: bool) -> dict:
        r = self.r
        body = {"max_tokens": r.randrange(1, 5), "temperature": r.choice([0, 0.7, 1.0]), "seed": r.randrange(100)}
        body.update({"messages": [{"role": "user", "content": "def f"}]} if chat else {"prompt": "def f("})
        if r.random() < 0.4:
            return {**body, **self.valid_options(chat)}
        if r.random() < 0.3:
            body.update(self.structured())
        for _ in range(r.randrange(1, 4)):
            field = r.choice(FIELDS)
            if field == "prompt":
                body["prompt"] = self.prompt()
            elif field == "messages":
                body["messages"] = self.messages()
            else:
                body[field] = self.odd_value()
        if r.random() < 0.2:
            body["stream"] = True
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8 and body.get("ignore_eos") is True:
            body["max_tokens"] = 8  # keep the valid ones short: the test is about refusals, not throughput
        return body

    def tool_body(self, path: str) -> dict:
        r = self.r
        if path == "/detokenize":
            body = {"tokens": r.choice([self.token_ids(), [r.randrange(VOCAB) for _ in range(20)], "x", None])}
        elif r.random() < 0.5:
            body = {"prompt": r.choice([self.prompt(), r.choice(ODD_TEXT)])}
        else:
            body = {"messages": self.messages()}
        for _ in range(r.randrange(0, 3)):
            body[r.choice(["add_special_tokens", "return_token_strs", "add_generation_prompt", "model",
                           "chat_template", "tokens", "bogus"])] = self.odd_value()
        return body

    def raw_body(self) -> tuple[bytes, dict]:
        r = self.r
        body = r.choice([
            b"", b"{", b"[1, 2]", b"null", b'"text"', b"\xff\xfe\x00", b'{"prompt": "\\ud800", "max_tokens": 2}',
            b'{"prompt": [1e999], "max_tokens": 1}', b'{"prompt": "a", "max_tokens": NaN}',
            b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", b"[" * 100000 + b"]" * 100000,
            b'{"prompt": "a", "prompt": [1], "max_tokens": 1}', b"\xef\xbb\xbf{\"prompt\": \"a\"}",
            json.dumps({"prompt": "a" * 50, "max_tokens": 1}).encode()[:-3],
        ])
        headers = {"content-type": r.choice(["application/json", "text/plain", "application/json; charset=latin-1",
                                             "multipart/form-data", "application/json;charset=utf-8"])}
        return body, headers

    def request(self) -> tuple[str, object, dict]:
        """(path, body, headers): body a JSON value, or bytes sent as they are."""
        r = self.r
        path = r.choice(["/v1/completions"] * 4 + ["/v1/chat/completions"] * 3 + ["/tokenize", "/detokenize"])
        kind = r.random()
        if kind < 0.1:
            body, headers = self.raw_body()
            return path, body, headers
        if path.startswith("/v1/"):
            return path, self.generation(chat="chat" in path), {}
        return path, self.tool_body(path), {}


def encode_body(body) -> bytes:
    """JSON text as a hostile client may write it: NaN and Infinity as such, lone surrogates as \\ud800 escapes."""
    return body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServeProcess(tmp_path_factory.mktemp("fuzz") / "serve.log", "--context-length", "256",
                       "--max-running-requests", "4")
    try:
        yield srv.start()
    finally:
        srv.kill()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
def test_the_http_process_never_loads_torch(server):
    """The default server's HTTP process (the engine in a child process) serves without torch: it imports none
    and unpickles nothing that does (the engine's description, its outputs), so it starts in a second and holds
    tens of MB; only the engine process pays for torch."""
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libtorch" not in maps, "the HTTP process loaded torch"


async def send_all(base_url: str, requests: list[tuple[str, object, dict]]) -> list[tuple[int, str]]:
    """Send every request, CONCURRENCY at a time; (status, start of the body) each, in order."""
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)

    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        async def one(path, body, headers) -> tuple[int, str]:
            async with gate:
                headers = {"content-type": "application/json", **headers}
                hang_up = isinstance(body, dict) and body.get("stream") is True and len(str(body)) % 3 == 0
                try:
                    async with client.stream("POST", path, content=encode_body(body), headers=headers) as r:
                        if hang_up and r.status_code == 200:  # a client that leaves after the first chunk
                            async for _ in r.aiter_bytes():
                                break
                            return r.status_code, "(hung up)"
                        return r.status_code, (await r.aread()).decode(errors="replace")[:300]
                except httpx.HTTPError as e:  # no answer: as bad as a 5xx
                    return 599, f"{type(e).__name__}: {e}"

        return await asyncio.gather(*(one(*req) for req in requests))


def warm_up(base_url: str) -> None:
    """One of each kind of work, so that what is built once (the grammar backend, the chat template, logprobs) is
    in the RSS baseline."""
    with httpx.Client(base_url=base_url, timeout=60) as c:
        for path, body in [
            ("/v1/completions", {"prompt": "def f(", "max_tokens": 4, "logprobs": 2, "echo": True}),
            ("/v1/completions", {"prompt": "def f(", "max_tokens": 4, "stream": True, "n": 2, "seed": 1,
                                 "temperature": 1.0, "repetition_penalty": 1.2}),
            ("/v1/completions", {"prompt": "x = ", "max_tokens": 4, "structured_outputs": {"regex": "[0-9]+"}}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                      "response_format": {"type": "json_object"}}),
            ("/tokenize", {"prompt": "def f(x):"}),
            ("/detokenize", {"tokens": [1, 2, 3]}),
        ]:
            assert c.post(path, json=body).status_code == 200, (path, body)


def pathological_requests(cases: dict) -> list[tuple[str, object, dict]]:
    """Each constraint of `cases` on both endpoints, as issue 76 sent its regex (16 tokens, seeds 0 and 2)."""
    out = []
    for name in sorted(cases):
        structured = RequestGenerator(0, {name: cases[name]}).structured()
        out += [("/v1/completions", {"prompt": "def f():", "max_tokens": 16, "seed": 0, **structured}, {}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
                                          "seed": 2, **structured}, {})]
    return out


def test_fuzz_never_5xx_never_dies_leaks_nothing(server):
    base = server.base_url
    warm_up(base)
    wait_idle(base)
    before = rss_bytes(server.proc.pid)
    cases = {k: v for k, v in PATHOLOGICAL.items() if k not in PENDING}
    gen = RequestGenerator(SEED, cases)
    requests = pathological_requests(cases) + [gen.request() for _ in range(NUM_REQUESTS)]
    random.Random(SEED).shuffle(requests)
    t0 = time.monotonic()
    answers = asyncio.run(send_all(base, requests))
    elapsed = time.monotonic() - t0
    bad = [(status, path, encode_body(body)[:200], text) for (status, text), (path, body, _) in zip(answers, requests)
           if status >= 500 and status != 503]
    assert not bad, f"{len(bad)} 5xx answers (599: none), the first: {bad[:3]}"
    assert server.proc.poll() is None, server.log()[-3000:]
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    statuses = sorted({s for s, _ in answers})
    assert 200 in statuses and 400 in statuses, statuses  # both paths were exercised
    text = wait_idle(base)
    for name in ("spruce_requests_running", "spruce_requests_waiting"):
        assert metric(text, name) == 0, name
    cached = metric(text, "spruce_prefix_cache_pages") if "spruce_prefix_cache_pages " in text else 0
    assert metric(text, "spruce_kv_pages_used") == cached, "KV pages leaked"
    after = rss_bytes(server.proc.pid)
    assert after <= before * (1 + RSS_SLACK), f"RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB"
    print(f"{len(requests)} requests in {elapsed:.1f} s; statuses {Counter(s for s, _ in answers)}; RSS {before / 2**20:.0f} -> "
          f"{after / 2**20:.0f} MiB")


if PENDING:
    @pytest.mark.parametrize("name", sorted(PENDING))
    def test_pending_cases(name):
        """The PATHOLOGICAL cases the fuzz leaves out until a fix elsewhere lands (each names what is pending)."""
        pytest.skip(PENDING[name])


# --- issue 76's input-validation reproductions, one by one ---------------------------------------------------------
def raw_exchange(port: int, payloads: list[bytes]) -> list[bytes]:
    """Send HTTP/1.1 requests one after another on one keep-alive connection; each response's bytes (a closed
    connection ends the list early)."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for body in payloads:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return out
                data += chunk
            head, rest = data.split(b"\r\n\r\n", 1)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(rest) < length:
                rest += sock.recv(65536)
            out.append(head + b"\r\n\r\n" + rest)
    return out


@pytest.mark.parametrize("body,param,says", [
    ({"prompt": [-1], "echo": True, "max_tokens": 2}, "prompt", "[0, 4096), got [-1]"),
    ({"prompt": [2**40], "echo": True, "max_tokens": 2}, "prompt", f"got [{2**40}]"),
    ({"prompt": [2**70], "echo": True, "max_tokens": 2}, "prompt", f"got [{2**70}]"),
    ({"prompt": [[5, 6], [1, -3]], "echo": True, "max_tokens": 2}, "prompt", "prompt[1] must be token ids"),
    ({"prompt": "a", "logit_bias": {"--5": 1}, "max_tokens": 2}, "logit_bias", "ASCII decimal digits"),
    ({"prompt": "a", "logit_bias": {"²": 1}, "max_tokens": 2}, "logit_bias", "ASCII decimal digits"),
    ({"prompt": "a", "logit_bias": {"٣": 1}, "max_tokens": 2}, "logit_bias", "ASCII decimal digits"),
    ({"prompt": "a", "logit_bias": {"9" * 5000: 1}, "max_tokens": 2}, "logit_bias", "ASCII decimal digits"),
    ({"prompt": "a", "repetition_penalty": 1e-300, "max_tokens": 4}, "repetition_penalty", "[0.01, 2.0]"),
])
def test_reproductions_are_400s(server, body, param, says):
    """Each answers 400 naming the parameter and the allowed values, and the keep-alive connection serves the next
    request."""
    port = int(server.base_url.rsplit(":", 1)[1])
    good = json.dumps({"prompt": "def f(", "max_tokens": 2}).encode()
    answers = raw_exchange(port, [json.dumps(body).encode(), good])
    assert len(answers) == 2, f"the connection was closed after {answers}"
    assert answers[0].startswith(b"HTTP/1.1 400"), answers[0][:500]
    error = json.loads(answers[0].split(b"\r\n\r\n", 1)[1])["error"]
    assert error["param"] == param and says in error["message"], error
    assert answers[1].startswith(b"HTTP/1.1 200"), answers[1][:500]


def test_echo_logprobs_text_offsets_index_the_returned_text(server):
    """With echo, the prompt's <|begin_of_text|> is among the tokens (as vLLM names it) but not in the text: it
    takes no characters, so every text_offset is where its token's text starts in the returned text; streamed
    chunks agree."""
    body = {"prompt": "def héllo(x):", "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert lp["tokens"][0] == "<|begin_of_text|>" and lp["text_offset"][:2] == [0, 0]
    assert text.startswith("def héllo(x):")
    ascii_tokens = [(t, o) for t, o in zip(lp["tokens"][1:], lp["text_offset"][1:]) if "\ufffd" not in t]
    assert ascii_tokens and all(text[o:o + len(t)] == t for t, o in ascii_tokens), (text, lp)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(text)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]
