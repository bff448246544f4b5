"""What the HTTP server refuses before a request reaches an endpoint, and how long a client may take to send one.

- `HostCheck` (ASGI): the Host header must name this server. A server bound to loopback answers only to
  loopback names by default (`localhost`, `127.0.0.1`, `[::1]`, any port), so a web page cannot reach it
  through DNS rebinding (a name the attacker controls that resolves to 127.0.0.1 arrives as `Host: evil.example`).
  A missing, empty, repeated or unlisted Host gets 400.
- `OriginCheck` (ASGI): a request that can change state (any method but GET, HEAD, OPTIONS) carrying an
  `Origin` header not allowed by `--allowed-origins` gets 403 before its endpoint runs. Browsers send Origin
  on every cross-origin POST, including the "simple" ones (text/plain, form posts) they send without a CORS
  preflight; non-browser clients send none.
- `bounded_http_protocol`: uvicorn's HTTP protocol with a deadline on receiving each request: its headers and
  body must arrive within `http_timeout` seconds of the connection opening (or of the first byte of a later
  request on a kept-alive connection), else the server answers 408 and closes the connection. uvicorn alone
  waits forever for a half-sent request (slowloris: each holds a socket). The request line and headers
  together may take MAX_HEADER_BYTES; more gets 431 (httptools buffers a header of any size).
"""

from __future__ import annotations

import ipaddress
import json
import logging
from typing import Callable, Iterable

log = logging.getLogger("spruce.server")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY = "*"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MAX_HEADER_BYTES = 64 << 10  # request line + headers (h11's own limit is 16 KiB, nginx's 4 x 8 KiB buffers)


def is_loopback(bind_host: str) -> bool:
    """Whether a bind address serves loopback only (`localhost`, 127.0.0.0/8, ::1)."""
    if bind_host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """Host names a server bound to `bind_host` answers to without --allowed-hosts: loopback names when bound to
    loopback, any name otherwise (the operator's network decides who reaches it)."""
    return LOOPBACK_HOSTS if is_loopback(bind_host) else (ANY,)


def parse_list(text: str) -> tuple[str, ...]:
    """A comma-separated flag value as its non-empty, stripped items ("a, b," -> ("a", "b"))."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def host_name(host: str) -> str:
    """A Host header's (or an allow-list entry's) name without port, lower-cased, without a trailing dot:
    "LocalHost:8000" -> "localhost", "[::1]:30000" -> "::1", "example.com." -> "example.com"."""
    host = host.strip().lower()
    if host.startswith("["):  # [IPv6]:port
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether a Host header value matches an entry: `*` (any), an exact name (any port), or `*.domain`
    (its subdomains)."""
    name = host_name(host)
    if not name:
        return False
    for entry in allowed:
        if entry == ANY:
            return True
        pattern = host_name(entry)
        if pattern.startswith("*.") and name.endswith(pattern[1:]) or name == pattern:
            return True
    return False


async def send_error(send, status: int, message: str, code: str) -> None:
    """An OpenAI-style JSON error response (the shape every spruce endpoint answers errors in)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> list[bytes]:
    return [value for key, value in scope["headers"] if key == name]


class HostCheck:
    """ASGI middleware: 400 unless the request's single Host header matches `allowed` (see `host_allowed`).
    `on_refused(status)` counts the refusal (the server's error metric)."""

    def __init__(self, app, allowed: Iterable[str], on_refused: Callable[[int], None] = lambda status: None):
        self.app = app
        self.allowed = tuple(allowed)
        self.any_host = ANY in self.allowed
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.any_host:
            return await self.app(scope, receive, send)
        hosts = _header(scope, b"host")
        host = hosts[0].decode("latin-1") if len(hosts) == 1 else ""
        if len(hosts) == 1 and host_allowed(host, self.allowed):
            return await self.app(scope, receive, send)
        shown = "no Host header" if not hosts else f"{len(hosts)} Host headers" if len(hosts) > 1 else \
            f"Host {host!r}"
        self.on_refused(400)
        await send_error(send, 400, f"{shown} is not allowed: this server answers to {', '.join(self.allowed)} "
                         "(start it with --allowed-hosts NAME[,NAME...] to add names, or '*' for any)",
                         "invalid_host")


class OriginCheck:
    """ASGI middleware: 403 for a state-changing request (method not in SAFE_METHODS) whose Origin header is
    not in `allowed_origins` (`*`: any). Requests without Origin (non-browser clients) pass."""

    def __init__(self, app, allowed_origins: Iterable[str] = (),
                 on_refused: Callable[[int], None] = lambda status: None):
        self.app = app
        self.allowed = frozenset(o.rstrip("/").lower() for o in allowed_origins)
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS or ANY in self.allowed:
            return await self.app(scope, receive, send)
        origins = _header(scope, b"origin")
        if not origins or all(o.decode("latin-1").rstrip("/").lower() in self.allowed for o in origins):
            return await self.app(scope, receive, send)
        origin = origins[0].decode("latin-1")
        self.on_refused(403)
        allowed = ", ".join(sorted(self.allowed)) or "none"
        await send_error(send, 403, f"cross-origin {scope['method']} from Origin {origin!r} refused (allowed "
                         f"origins: {allowed}; start the server with --allowed-origins to allow one)",
                         "origin_not_allowed")


def http_protocol_base():
    """The uvicorn HTTP protocol class uvicorn's "auto" picks: httptools' when installed, else h11's."""
    try:
        import httptools  # noqa: F401

        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


def error_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response closing the connection (written by the protocol, outside any endpoint)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def bounded_http_protocol(http_timeout: float | None, base=None):
    """A uvicorn HTTP protocol class (uvicorn.Config(http=...)) that bounds how a request arrives: its request
    line and headers may take MAX_HEADER_BYTES (more: 431), and with `http_timeout` the whole request (headers
    and body) must arrive within that many seconds, counted from the connection's opening or, on a kept-alive
    connection, from the first byte after the previous response (else 408, unless a response has started).
    Either closes the connection. Idle kept-alive connections are uvicorn's `timeout_keep_alive`'s."""
    base = base or http_protocol_base()
    timeout_response = error_response(408, "Request Timeout", "the request did not arrive whole within "
                                      f"{http_timeout:g} s (--http-timeout)", "request_timeout") if http_timeout else b""
    too_large = error_response(431, "Request Header Fields Too Large", "the request line and headers exceed "
                               f"{MAX_HEADER_BYTES} bytes", "headers_too_large")

    class BoundedHttpProtocol(base):
        _receiving = False  # a request is arriving (from its first byte, or the connection's opening, to its end)
        _started_cycle = None  # the request cycle current when it began arriving (None: the connection's first)
        _head_bytes = 0  # bytes received since then while the request's headers are incomplete
        _deadline = None  # the armed TimerHandle, or None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._request_begins()

        def data_received(self, data: bytes) -> None:
            if not self._receiving and (self.cycle is None or self.cycle.response_complete):
                self._request_begins()  # a later request on a kept-alive connection
            super().data_received(data)
            if not self._receiving:
                return
            cycle = self.cycle
            if cycle is self._started_cycle:  # its headers are not complete yet
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEADER_BYTES:
                    self._refuse(too_large, f"request headers over {MAX_HEADER_BYTES} bytes")
            elif not cycle.more_body:
                self._request_arrived()

        def connection_lost(self, exc):
            self._request_arrived()
            super().connection_lost(exc)

        def _request_begins(self) -> None:
            self._receiving, self._started_cycle, self._head_bytes = True, self.cycle, 0
            if http_timeout:
                self._deadline = self.loop.call_later(http_timeout, self._timed_out)

        def _request_arrived(self) -> None:
            self._receiving = False
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _timed_out(self) -> None:
            self._deadline = None
            cycle = self.cycle
            headers_done = cycle is not None and cycle is not self._started_cycle
            if headers_done:
                cycle.keep_alive = False
            self._refuse(None if headers_done and cycle.response_started else timeout_response,
                         f"request not received whole within {http_timeout:g} s")

        def _refuse(self, response: bytes | None, why: str) -> None:
            """Answer `response` (None: a response has started, send nothing more) and close the connection."""
            self._request_arrived()
            if self.transport.is_closing():
                return
            log.info("%s: %s: closing the connection", "%s:%d" % tuple(self.client[:2]) if self.client else "client",
                     why)
            if response is not None:
                self.transport.write(response)
            self.transport.close()

    return BoundedHttpProtocol
