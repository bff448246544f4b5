"""Hostile HTTP clients against a real `spruce serve` on loopback (the bundled demo model): DNS rebinding (Host
header), cross-origin browser requests, /metrics behind the API key, the model's path kept out of responses,
half-sent requests (slowloris), oversized headers, bodies and prompts, and the connection limit. Short timeouts
(--http-timeout 2, --keep-alive-timeout 1) keep the file fast; the time bounds leave room for a loaded CI machine."""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer

from server_util import MODEL_NAME, ServeProcess, ServerThread, engine_kwargs, one_torch_thread  # noqa: F401
from spruce.config import builtin_model_path

KEY = "sk-hostile-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVED = "demo"
ALLOWED_ORIGIN = "https://ok.example"
HTTP_TIMEOUT = 2.0
MAX_CONNECTIONS = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServeProcess(tmp_path_factory.mktemp("serve") / "serve.log", "--disable-engine-process",
                       "--api-key", KEY, "--served-model-name", SERVED, "--allowed-origins", ALLOWED_ORIGIN,
                       "--http-timeout", str(HTTP_TIMEOUT), "--keep-alive-timeout", "1",
                       "--max-connections", str(MAX_CONNECTIONS))
    try:
        yield srv.start()
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """An in-process server (create_app's options, not the flags') with /metrics open and its own host list."""
    from spruce import LLM

    llm = LLM(**engine_kwargs(tmp_path_factory.mktemp("draft")))
    with ServerThread(llm.engine, api_key=KEY, metrics_no_auth=True,
                      allowed_hosts=("spruce.internal", "*.lan.example")) as srv:
        yield srv


def port_of(server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def raw_request(port: int, request: bytes, timeout: float = 10.0) -> bytes:
    """Send `request` on a new connection and read until the server closes it or a whole response arrived."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:")]
            if sep and length and len(body) >= length[0]:
                return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def get(port: int, host_lines: bytes, path: bytes = b"/health", version: bytes = b"1.1") -> bytes:
    return raw_request(port, b"GET " + path + b" HTTP/" + version + b"\r\n" + host_lines + b"Connection: close\r\n\r\n")


# --- Host header (DNS rebinding) ---------------------------------------------------------------------------
def test_host_header_must_name_a_loopback_server(server):
    port = port_of(server)
    for host in (b"localhost", b"localhost:%d" % port, b"127.0.0.1:%d" % port, b"[::1]:%d" % port, b"LocalHost."):
        assert status_of(get(port, b"Host: " + host + b"\r\n")) == 200, host
    refused = {"evil.example": b"Host: evil.example\r\n", "with port": b"Host: evil.example:%d\r\n" % port,
               "empty": b"Host: \r\n", "missing": b"", "missing (HTTP/1.0)": b"",
               "twice": b"Host: localhost\r\nHost: evil.example\r\n", "a loopback suffix": b"Host: localhost.evil\r\n"}
    for case, lines in refused.items():
        response = get(port, lines, version=b"1.0" if "1.0" in case else b"1.1")
        assert status_of(response) == 400, (case, response)
        assert b"invalid_host" in response and b"--allowed-hosts" in response, response
    body = json.dumps({"prompt": "def f():", "max_tokens": 2}).encode()
    response = raw_request(port, b"POST /v1/completions HTTP/1.1\r\nHost: evil.example\r\nAuthorization: Bearer "
                           + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                           b"Connection: close\r\n\r\n" % len(body) + body)
    assert status_of(response) == 400, response


def test_allowed_hosts_replace_the_loopback_names(open_server):
    port = port_of(open_server)
    for host in (b"spruce.internal", b"spruce.internal:8000", b"a.lan.example"):
        assert status_of(get(port, b"Host: " + host + b"\r\n")) == 200, host
    for host in (b"localhost", b"127.0.0.1", b"lan.example.evil"):
        assert status_of(get(port, b"Host: " + host + b"\r\n")) == 400, host


def test_host_flags():
    from spruce.cli import build_parser
    from spruce.server.cli import app_options

    def options(*flags):
        return app_options(build_parser().parse_args(["serve", *flags]))

    assert options()["allowed_hosts"] == ("localhost", "127.0.0.1", "::1")
    assert options("--host", "::1")["allowed_hosts"] == ("localhost", "127.0.0.1", "::1")
    assert options("--host", "0.0.0.0")["allowed_hosts"] == ("*",)  # bound beyond loopback: any host
    assert options("--allowed-hosts", "a.example, b.example")["allowed_hosts"] == ("a.example", "b.example")
    assert options("--host", "0.0.0.0", "--allowed-hosts", "a.example")["allowed_hosts"] == ("a.example",)
    assert options("--metrics-no-auth")["metrics_no_auth"] and not options()["metrics_no_auth"]
    assert options("--model", "/m/llama")["model_name"] == "/m/llama"  # the path as given, as vLLM and SGLang
    assert not options("--model", "/m/llama")["hide_model_path"]
    assert options("--model", "/m/llama", "--served-model-name", "llama")["hide_model_path"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-hosts", ","])


# --- cross-origin browser requests -------------------------------------------------------------------------
def test_cross_origin_post_is_refused_before_it_runs(server):
    url = f"{server.base_url}/flush_cache"
    simple = {**AUTH, "Content-Type": "text/plain"}  # a "simple" request: the browser sends it without preflight
    r = httpx.post(url, headers={**simple, "Origin": "http://evil.example"}, content="x")
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
    assert "access-control-allow-origin" not in r.headers
    r = httpx.post(url, headers={**simple, "Origin": ALLOWED_ORIGIN}, content="x")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN, r.text
    assert httpx.post(url, headers=AUTH).status_code == 200  # no Origin: not a browser
    r = httpx.post(f"{server.base_url}/v1/completions", headers={**simple, "Origin": ALLOWED_ORIGIN},
                   content=json.dumps({"prompt": "x", "max_tokens": 1}))
    assert r.status_code == 415, r.text  # JSON endpoints take JSON only (a preflighted content type)


def test_cors_only_for_allowed_origins(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    url = f"{server.base_url}/v1/completions"
    r = httpx.options(url, headers={**preflight, "Origin": ALLOWED_ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    r = httpx.options(url, headers={**preflight, "Origin": "http://evil.example"})
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.base_url}/v1/models", headers={**AUTH, "Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# --- /metrics and the model's path -------------------------------------------------------------------------
def test_metrics_need_the_api_key(server, open_server):
    r = httpx.get(f"{server.base_url}/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/metrics", headers=AUTH).status_code == 200
    r = httpx.get(f"{open_server.base_url}/metrics", headers={"Host": "spruce.internal"})
    assert r.status_code == 200 and "spruce_requests_running" in r.text  # metrics_no_auth (--metrics-no-auth)


def test_served_model_name_hides_the_model_path(server):
    path = str(builtin_model_path())
    card = httpx.get(f"{server.base_url}/v1/models", headers=AUTH).json()["data"][0]
    assert card["id"] == SERVED and card["root"] == SERVED
    info = httpx.get(f"{server.base_url}/server_info", headers=AUTH).json()
    assert info["model_path"] == info["tokenizer_path"] == SERVED
    assert info["speculative_draft_model_path"] and "/" not in info["speculative_draft_model_path"]
    for endpoint in ("/v1/models", "/server_info", "/metrics"):
        text = httpx.get(f"{server.base_url}{endpoint}", headers=AUTH).text
        assert path not in text and str(builtin_model_path().parent) not in text, endpoint


# --- how long and how large a request may be ---------------------------------------------------------------
def open_fds(server) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def test_half_sent_requests_are_dropped_and_the_server_answers(server):
    """Slowloris: connections that send nothing, part of the headers, or the headers and part of the body get
    408 and are closed after --http-timeout; beyond --max-connections requests get 503 meanwhile."""
    port = port_of(server)
    before = open_fds(server)
    start = time.monotonic()
    body_part = (b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": \"de")
    headers_part = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Ty"
    # the headers and part of the body first, while under --max-connections (beyond, a request gets 503 at once)
    partial = [body_part] * (MAX_CONNECTIONS // 4) + [headers_part, b""] * MAX_CONNECTIONS
    socks = []
    for sent in partial:
        sock = socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT + 5)
        sock.sendall(sent)
        socks.append(sock)
    while open_fds(server) < before + MAX_CONNECTIONS + 4:  # accepted (each holds a descriptor)
        assert time.monotonic() - start < HTTP_TIMEOUT * 0.75, "the server did not accept the connections"
        time.sleep(0.01)
    assert httpx.get(f"{server.base_url}/health").status_code == 503  # over --max-connections
    for i, sock in enumerate(socks):
        data = b""
        while chunk := sock.recv(4096):  # a socket.timeout here: the server kept the half-sent request open
            data += chunk
        sock.close()
        assert data.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in data, (partial[i], data)
    assert time.monotonic() - start < HTTP_TIMEOUT + 4
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    deadline = time.monotonic() + 5
    while open_fds(server) > before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_fds(server) <= before + 2


def test_idle_keep_alive_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        response = b""
        while b'{"status":"ok"}' not in response:  # headers and body may come in separate reads
            chunk = sock.recv(4096)
            assert chunk, response
            response += chunk
        assert response.startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        assert sock.recv(4096) == b""  # closed by --keep-alive-timeout 1
        assert time.monotonic() - start < 4  # uvicorn's default: 5 s


def test_oversized_headers_get_431(server):
    response = raw_request(port_of(server), b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (100 << 10))
    assert status_of(response) == 431 and b"headers_too_large" in response, response[:200]


def test_tokenizer_endpoints_cap_the_body(server):
    limit = 4 << 20  # --max-request-bytes' default
    big = json.dumps({"prompt": "x" * limit}).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(f"{server.base_url}{path}", content=big, headers=headers)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        chunked = (big[i:i + 65536] for i in range(0, len(big), 65536))  # no Content-Length: counted as read
        r = httpx.post(f"{server.base_url}{path}", content=chunked, headers=headers)
        assert r.status_code == 413, r.text


def test_prompts_longer_than_any_request_are_refused_before_encoding(server):
    max_model_len = httpx.get(f"{server.base_url}/v1/models", headers=AUTH).json()["data"][0]["max_model_len"]
    tok = HFTokenizer.from_file(str(builtin_model_path() / "tokenizer.json"))
    limit = max_model_len * max(map(len, tok.get_vocab()))  # characters max_model_len tokens can stand for
    text = "x" * (limit + 1)
    cases = {"/tokenize": ({"prompt": text}, "prompt"),
             "/v1/completions": ({"prompt": text, "max_tokens": 1}, "prompt"),
             "/v1/chat/completions": ({"messages": [{"role": "user", "content": text}], "max_tokens": 1}, "messages")}
    for path, (body, param) in cases.items():
        start = time.monotonic()
        r = httpx.post(f"{server.base_url}{path}", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["param"] == param, (path, r.text)
        assert str(limit) in r.json()["error"]["message"]
        assert time.monotonic() - start < 1, path
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "def f():\n" * 100}, headers=AUTH)
    assert r.status_code == 200 and r.json()["count"] > 100
