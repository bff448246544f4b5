"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health, /ready,
/metrics, and the vLLM/SGLang tooling endpoints of `spruce.server.tooling` (/tokenize, /detokenize, /version,
/server_info). Every error is answered as `{"error": {"message", "type", "param", "code"}}`.

Generation requests must be `application/json` (415 otherwise: a web page cannot send that cross-origin
without a CORS preflight). Before any endpoint, `spruce.server.security` refuses a Host header the server does not
answer to (400) and a state-changing request from a browser origin not allowed (403); CORS is off unless origins
are allowed. With an API key, /metrics needs it too unless opened for scrapers. `app.state.drain()` is the
graceful shutdown (see `spruce.server.graceful`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from spruce.errors import InvalidRequestError
from spruce.server.chat_parsers import ChatOutputParser, ChatParsing, ChatStreamDeltas
from spruce.server.engine_loop import EngineFailure, EngineLoop, Generation, failure_error
from spruce.server.protocol import (
    LOGPROB_FLOOR, MAX_CHOICES, ChatCompletionRequest, CompletionRequest, OpenAIError, TextDelta, chat_choice,
    chat_delta, chat_logprobs, completion_choice, completion_logprobs, envelope, parse_request, token_id_name, usage,
)
from spruce.server.security import LOOPBACK_HOSTS, HostCheck, OriginCheck
from spruce.server.settings import (
    MAX_BODY_BYTES, MAX_QUEUED_REQUESTS, REQUEST_TIMEOUT_S, SHUTDOWN_GRACE_PERIOD_S, ServingLimits,
)
from spruce.server.sglang_native import add_sglang_routes
from spruce.server.tooling import add_tooling_routes

log = logging.getLogger("spruce.server")
COMPLETION_MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions; chat defaults to all the room left


def create_app(engine_loop: EngineLoop, *, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, max_queued_requests: int = MAX_QUEUED_REQUESTS,
               request_timeout: float | None = REQUEST_TIMEOUT_S,
               shutdown_grace_period: float = SHUTDOWN_GRACE_PERIOD_S,
               allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS, allowed_origins: tuple[str, ...] = (),
               metrics_no_auth: bool = False, hide_model_path: bool = False,
               sampling_defaults: dict | None = None, chat_parsing: ChatParsing | None = None) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine thread and stops it on shutdown; `app.state.drain` is the
    graceful shutdown to run before that (refuse new requests, let running ones finish, end the rest).

    `allowed_hosts`: Host header names answered (`*`: any; see security.HostCheck); `allowed_origins`: browser
    origins allowed cross-origin (CORS headers and state-changing requests; `*`: any); `metrics_no_auth`: /metrics
    answers without the API key; `hide_model_path`: no response or metric names the model's files (the served
    name stands for the model's path, a draft model's directory name for its path); `sampling_defaults`: values for
    the sampling fields a request leaves unset (spruce.sampling_defaults: the model's generation_config.json);
    `chat_parsing`: the chat template and the reasoning / tool-call parsers chat output is read with.

    /health answers 200 while the engine runs (503 once it failed or while the server shuts down); /ready 200 while
    a request would be admitted now: the engine runs, the server is not shutting down and its queue has room
    (503 naming why not). The port opens only once the engine is loaded and warmed up (CUDA graphs captured)."""
    limits = ServingLimits(max_body_bytes, max_queued_requests, request_timeout, shutdown_grace_period)
    metrics = engine_loop.metrics
    if hide_model_path:
        metrics.info["model"] = model_name  # the spruce_server_info label

    @asynccontextmanager
    async def lifespan(_app):
        engine_loop.start()
        yield
        await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="spruce", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    chat_parsing = chat_parsing or ChatParsing()
    if chat_parsing.chat_template is not None and engine_loop.engine.tokenizer is not None:
        engine_loop.engine.tokenizer.chat_template = chat_parsing.chat_template  # --chat-template
    api = _Api(engine_loop, model_name, api_key, limits, hide_model_path, sampling_defaults, chat_parsing)
    app.state.drain = api.drain
    app.state.engine_failure = lambda: engine_loop.failure  # why the engine failed, or None (server exits on it)
    metrics.model_name = model_name  # the model_name label of the vllm:* metric aliases

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request, e: OpenAIError):
        metrics.on_error(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientDisconnect)
    async def _client_disconnect(request, _e: ClientDisconnect):
        log.info("%s %s: client disconnected before sending the whole request body", request.method,
                 request.url.path)
        return Response(status_code=499)  # nobody is listening: neither answered nor counted as an error

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        metrics.on_error(e.status_code)
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(OpenAIError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=e)
        metrics.on_error(500)
        return JSONResponse(OpenAIError(500, "internal server error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if engine_loop.failure is not None:
            return JSONResponse({"status": "engine failed", "error": engine_loop.failure}, status_code=503)
        if not engine_loop.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        if not engine_loop.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        reason = unready_reason(engine_loop, limits.max_queued_requests)
        if reason is not None:
            return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)
        return {"status": "ready"}

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        if not metrics_no_auth:
            api.authorize(request)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        api.authorize(request)
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        api.authorize(request)
        api.check_model(name)
        return api.model_card()

    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    add_tooling_routes(app, api)
    add_sglang_routes(app, api)  # SGLang's /generate, /health_generate
    add_request_checks(app, allowed_hosts, allowed_origins, metrics.on_error)
    return app


def add_request_checks(app: FastAPI, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...],
                       on_refused) -> None:
    """The middleware, outermost first: the Host check, the Origin check of state-changing requests, then CORS
    (only with allowed origins)."""
    if allowed_origins:
        origins = [o.rstrip("/") for o in allowed_origins]  # an Origin header never ends with "/"
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(OriginCheck, allowed_origins=allowed_origins, on_refused=on_refused)
    app.add_middleware(HostCheck, allowed=allowed_hosts, on_refused=on_refused)


class _Api:
    """The generation endpoints and their request plumbing."""

    def __init__(self, engine_loop: EngineLoop, model_name: str, api_key: str | None, limits: ServingLimits,
                 hide_model_path: bool = False, sampling_defaults: dict | None = None,
                 chat_parsing: ChatParsing | None = None):
        self.sampling_defaults = dict(sampling_defaults or {})
        self.chat_parsing = chat_parsing or ChatParsing()
        self.loop = engine_loop
        self.engine = engine_loop.engine
        self.model_name = model_name
        self.api_key = api_key
        self.limits = limits
        self.max_request_tokens = self.engine.max_request_tokens
        self.created = int(time.time())
        self.hide_model_path = hide_model_path
        self.model_root = engine_loop.metrics.info.get("model", model_name)  # what the served name is

    # --- request plumbing ----------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")

    def shown_path(self, path) -> str | None:
        """A model file path as responses show it: as given, or with `hide_model_path` the served name for the
        model's own path and the last component of any other (a draft model's directory)."""
        if path is None or not self.hide_model_path:
            return None if path is None else str(path)
        return self.model_name if str(path) == str(self.engine.config.model) else Path(str(path)).name

    def check_prompt_chars(self, text: str, param: str) -> None:
        """413 before encoding a text too long for any request: more characters than `max_request_tokens` tokens
        of the tokenizer's longest entry can stand for (encoding megabytes costs seconds and gigabytes)."""
        limit = self.max_request_tokens * self.engine.tokenizer.max_token_chars
        if len(text) > limit:
            raise OpenAIError(413, f"the {param} has {len(text)} characters, more than any request on this server "
                              f"can hold: at most {self.max_request_tokens} tokens of at most "
                              f"{self.engine.tokenizer.max_token_chars} characters each ({limit} characters)",
                              param=param, code="context_length_exceeded")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "spruce",
                "root": self.model_root, "parent": None, "max_model_len": self.max_request_tokens}

    async def read_json(self, request: Request) -> dict:
        """The JSON object body: 415 unless sent as JSON, 413 as soon as it is known to exceed the limit
        (header or bytes read)."""
        check_content_type(request.headers.get("content-type"))
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise OpenAIError(413 if declared.isdigit() else 400,
                              f"request body of {declared} bytes exceeds the limit of {limit} bytes"
                              if declared.isdigit() else "invalid Content-Length header", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise OpenAIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object", code="invalid_json")
        return body

    async def prepare(self, request: Request, cls):
        self.authorize(request)
        req = parse_request(cls, await self.read_json(request))
        self.check_model(req.model)
        return req

    def sampling_params(self, req, max_tokens: int):
        unset = {k: v for k, v in self.sampling_defaults.items() if getattr(req, k, None) is None}
        if unset:  # the model's defaults for what the request left unset (--sampling-defaults model)
            req = req.model_copy(update=unset)
        try:
            return req.sampling_params(max_tokens, self.engine.vocab_size)
        except InvalidRequestError as e:
            raise OpenAIError.from_invalid_request(e, req.param_names) from None

    def max_tokens(self, req, prompt_tokens: int, default: int, prompt_param: str) -> int:
        """The request's max_tokens, refused (not cut) when prompt + max_tokens exceeds what one request can
        hold; unset, `default` cut to the room left."""
        limit = self.max_request_tokens
        room = limit - prompt_tokens
        if room < 1:
            raise OpenAIError(413, f"the prompt has {prompt_tokens} tokens; a request holds at most {limit} tokens "
                              f"(prompt + output) on this server, so the prompt must be under {limit} tokens",
                              param=prompt_param, code="context_length_exceeded")
        if req.max_tokens is None:
            return min(default, room)
        if req.max_tokens > room:
            raise OpenAIError(400, f"max_tokens={req.max_tokens} is too large: the prompt has {prompt_tokens} "
                              f"tokens and a request holds at most {limit} (prompt + output), so max_tokens must "
                              f"be <= {room}", param="max_tokens", code="context_length_exceeded")
        return req.max_tokens

    def prompt_ids(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, encoded as the engine encodes text (token ids pass through: the engine checks
        them)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if not prompt:
            raise OpenAIError(400, "prompt is empty; expected at least one token", param="prompt")
        if self.engine.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer.json: send token ids", param="prompt")
        self.check_prompt_chars(prompt, "prompt")
        return self.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    # --- endpoints -------------------------------------------------------------------------------------------
    async def completions(self, request: Request):
        req = await self.prepare(request, CompletionRequest)
        prompts = req.prompts()
        if len(prompts) * req.n > MAX_CHOICES:
            raise OpenAIError(400, f"{len(prompts)} prompts x n={req.n} exceeds {MAX_CHOICES} choices", param="n")
        prompt_ids = await asyncio.to_thread(lambda: [req.truncated_prompt(self.prompt_ids(p, req.special_tokens),
                                                                           self.max_request_tokens)
                                                      for p in prompts])
        jobs = []
        for ids in prompt_ids:
            max_tokens = self.max_tokens(req, len(ids), COMPLETION_MAX_TOKENS_DEFAULT, "prompt")
            jobs += [(ids, sp) for sp in self.sampling_params(req, max_tokens)]
        echo = None
        if req.echo:  # each choice's text starts with its prompt's (token-id prompts: decoded)
            texts = await asyncio.to_thread(lambda: [p if isinstance(p, str) else self.decode(ids)
                                                     for p, ids in zip(prompts, prompt_ids)])
            echo = [t for t in texts for _ in range(req.n)]
        return await self.generate(request, req, jobs, chat=False, echo=echo)

    def decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""

    async def chat_completions(self, request: Request):
        req = await self.prepare(request, ChatCompletionRequest)
        ids = await asyncio.to_thread(self.chat_prompt, [m.as_dict() for m in req.messages],
                                      add_special_tokens=req.special_tokens, template_kwargs=req.template_kwargs(),
                                      continue_final_message=bool(req.continue_final_message))
        ids = req.truncated_prompt(ids, self.max_request_tokens)
        max_tokens = self.max_tokens(req, len(ids), self.max_request_tokens, "messages")
        parsing = self.chat_parsing
        parser = req.output_parser(parsing.reasoning_parser, parsing.tool_call_parser, parsing.enable_auto_tool_choice)
        if req.stream and req.return_token_ids and not parser.plain:
            raise OpenAIError(400, "return_token_ids with stream: true is not available when reasoning or tool "
                              "calls are read from the output", param="return_token_ids")
        if req.echo and not parser.plain:
            raise OpenAIError(400, "echo is not available when reasoning or tool calls are read from the output",
                              param="echo")
        echo = [req.echo_text()] * req.n if req.echo else None
        return await self.generate(request, req, [(ids, sp) for sp in self.sampling_params(req, max_tokens)],
                                   chat=True, echo=echo, chat_parser=None if parser.plain else parser)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """Token ids of the rendered chat template (which writes its own special tokens). `template_kwargs`: the
        template's variables beyond messages (their add_generation_prompt wins); `continue_final_message`: the
        text ends where the last message's content does (vLLM's: the model continues that message)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise OpenAIError(400, "this model has no tokenizer: use /v1/completions with token ids",
                              param="messages")
        kwargs = dict(template_kwargs or {})
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
            if continue_final_message:
                text = continued_final_message(text, messages[-1]["content"])
        except InvalidRequestError as e:
            raise OpenAIError.from_invalid_request(e) from None
        except Exception as e:  # a template may raise on messages it does not accept
            raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        self.check_prompt_chars(text, "messages")
        return tok.encode(text, add_special_tokens=add_special_tokens)

    async def generate(self, request: Request, req, jobs, chat: bool, echo: list[str] | None = None,
                       chat_parser: ChatOutputParser | None = None):
        prefix = "chatcmpl-" if chat else "cmpl-"
        base_id = prefix + uuid.uuid4().hex[:24]  # the engine's (unique); the response's may be the client's
        response_id = req.response_id(prefix, base_id)
        try:
            gen = await Generation.start(self.loop, base_id, jobs, self.limits.max_queued_requests,
                                         self.limits.request_timeout)
        except InvalidRequestError as e:
            raise OpenAIError.from_invalid_request(e, {**req.param_names, **({"prompt": "messages"} if chat else {})}
                                                   ) from None
        except EngineFailure as e:
            raise failure_error(e) from None
        log.info("%s: %d choice(s), stream=%s", base_id, len(jobs), req.stream)
        tok = self.engine.tokenizer
        stream = _Stream(response_id, self.model_name, chat, req.n, [sp.stop for _, sp in jobs], req.num_logprobs,
                         echo, token_id_name if req.return_tokens_as_token_ids else
                         tok.token_text if tok is not None else _no_text,
                         tok.text_widths if tok is not None else None, bool(req.return_token_ids),
                         req.prompt_logprobs is not None, chat_parser)
        if req.keep_stop_string and tok is not None:
            stream.decode = tok.decode
        if req.stream:
            return StreamingResponse(stream.sse(gen, req.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            outs = await gen.collect_while_connected(request.receive)
        except EngineFailure as e:
            raise failure_error(e, base_id) from None
        if outs is None:
            log.info("%s: client disconnected, aborted", base_id)
            return Response(status_code=499)
        failed = grammar_failure(outs, jobs, req.param_names)
        if failed is not None:
            raise failed
        body = stream.response(outs)
        log.info("%s: done, usage %s", base_id, body["usage"])
        return body

    async def drain(self) -> None:
        """Graceful shutdown: refuse new requests (503), give the running ones the grace period to finish, then
        stop the engine, which ends each request still open with a 503 error (an error event then [DONE] for
        streams)."""
        self.loop.stop_accepting()
        grace = self.limits.shutdown_grace_period
        log.info("shutting down: refusing new requests; %d engine request(s) in flight get up to %g s to finish",
                 self.loop.in_flight, grace)
        deadline = time.monotonic() + grace
        while self.loop.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.loop.in_flight:
            log.warning("shutdown grace period (%g s) is over: ending %d engine request(s) with an error", grace,
                        self.loop.in_flight)
        await asyncio.to_thread(self.loop.stop)


def unready_reason(engine_loop: EngineLoop, max_queued: int) -> str | None:
    """Why a one-choice request would not be admitted now (EngineLoop's admission), or None: it would."""
    if engine_loop.failure is not None:
        return f"the engine failed: {engine_loop.failure}"
    if not engine_loop.alive:
        return "the engine is not running"
    if not engine_loop.accepting:
        return "the server is shutting down"
    in_flight, running = engine_loop.in_flight, engine_loop.engine.limits.max_running_requests
    if in_flight and in_flight + 1 - running > max_queued:
        return f"the queue is full: {in_flight} requests in flight, {running} run at once, at most {max_queued} wait"
    return None


def check_content_type(content_type: str | None) -> None:
    """415 unless the body is declared as JSON (`application/json`, optionally with charset=utf-8)."""
    media, *params = (content_type or "").split(";")
    if media.strip().lower() != "application/json":
        raise OpenAIError(415, f"Content-Type must be application/json, got {content_type!r}",
                          code="unsupported_media_type")
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise OpenAIError(415, f"the JSON body must be UTF-8, got Content-Type {content_type!r}",
                              code="unsupported_media_type")


def continued_final_message(text: str, content: str) -> str:
    """The rendered chat `text` cut right after the last message's (stripped) content, so that the model
    continues that message (transformers' and vLLM's continue_final_message); 400 when the template does not
    write the content verbatim."""
    final = content.strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise OpenAIError(400, "continue_final_message: the chat template does not write the last message's "
                          "content as given, so it cannot be continued", param="continue_final_message")
    return text[:at + len(final)]


def grammar_failure(outs, jobs, param_names: dict[str, str]) -> OpenAIError | None:
    """The 400 answering a non-streamed request one of whose choices ended with finish_reason "error" (its
    grammar failed mid-generation: runtime/grammar.py), naming the constraint's request parameter; else None."""
    for o, (_, sp) in zip(outs, jobs):
        if o.finish_reason == "error":
            field = sp.structured_output.field if sp.structured_output is not None else None
            return OpenAIError(400, o.error or "the request failed", param=param_names.get(field, field))
    return None


def _no_text(_token_id: int) -> None:
    return None


def prompt_logprobs(entries: list | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": max(lp.logprob, LOGPROB_FLOOR), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


class _Stream:
    """Formats one API call's outputs as a response object or as SSE chunks.

    `logprobs`: the number of top alternatives per token (None: no logprobs); `echo`: completions with echo,
    each choice's prompt text (its prompt's tokens and, with logprobs, their logprobs come first)."""

    def __init__(self, base_id: str, model: str, chat: bool, n: int, stops: list[tuple[str, ...]],
                 logprobs: int | None = None, echo: list[str] | None = None, token_text=_no_text, text_widths=None,
                 token_ids: bool = False, prompt_logprobs: bool = False,
                 chat_parser: ChatOutputParser | None = None):
        self.id, self.model, self.chat, self.n, self.stops = base_id, model, chat, n, stops
        self.logprobs, self.echo, self.token_text, self.text_widths = logprobs, echo, token_text, text_widths
        self.token_ids, self.prompt_logprobs = token_ids, prompt_logprobs  # vLLM's return_token_ids, prompt_logprobs
        # reasoning / tool calls read from each chat choice's output (None: plain content); one per choice
        self.parsers = None if chat_parser is None else [replace(chat_parser, ids=[]) for _ in stops]
        self.decode = None  # set: the stop string that ended a choice stays at the end of its text (decodes ids)
        self.created = int(time.time())
        self.include_usage = False
        self.obj = "chat.completion" if chat else "text_completion"

    def usage(self, outs: dict) -> dict:
        prompt = sum(len(o.prompt_token_ids) for i, o in outs.items() if i % self.n == 0)
        cached = sum(o.num_cached_tokens for i, o in outs.items() if i % self.n == 0)
        return usage(prompt, sum(len(o.token_ids) for o in outs.values()), cached)

    def text_of(self, index: int, out) -> str:
        """A choice's text: the engine's, which ends before the stop string that ended it; with `decode` set
        (vLLM's include_stop_str_in_output, SGLang's no_stop_trim), that stop string follows it."""
        if self.decode is None or not out.finished or out.finish_reason != "stop" or not self.stops[index]:
            return out.text
        full = self.decode(list(out.token_ids))  # the text uncut: the stop string, maybe more of its last token
        rest = full[len(out.text):] if full.startswith(out.text) else ""
        stop = next((s for s in self.stops[index] if rest.startswith(s)), "")
        return out.text + stop

    def response(self, outs) -> dict:
        choices = []
        for i, o in enumerate(outs):
            o = replace(o, text=self.text_of(i, o))
            if self.chat and self.parsers is not None:
                parser = self.parsers[i]
                choice = {"index": i, "message": parser.message(o.text), "logprobs": None,
                          "finish_reason": parser.finish_reason(o.text, o.finish_reason)}
            elif self.chat:
                choice = chat_choice(i, (self.echo[i] if self.echo else "") + o.text, o.finish_reason)
            else:
                choice = completion_choice(i, (self.echo[i] if self.echo else "") + o.text, o.finish_reason)
            choice["logprobs"] = self.logprobs_of(i, o, 0, first=True)
            if self.token_ids:  # vLLM's shape: chat's prompt ids once per response, completions' per choice
                choice["token_ids"] = list(o.token_ids)
                if not self.chat:
                    choice["prompt_token_ids"] = list(o.prompt_token_ids)
            if self.prompt_logprobs and not self.chat:
                choice["prompt_logprobs"] = prompt_logprobs(o.prompt_logprobs)
            choices.append(choice)
        extra = {}
        if self.chat and self.token_ids and outs:
            extra["prompt_token_ids"] = list(outs[0].prompt_token_ids)
        if self.chat and self.prompt_logprobs and outs:
            extra["prompt_logprobs"] = prompt_logprobs(outs[0].prompt_logprobs)
        return envelope(self.id, self.obj, self.model, choices, self.created, usage=self.usage(dict(enumerate(outs))),
                        **extra)

    def logprobs_of(self, index: int, out, sent_tokens: int, first: bool, text_offset: int = 0) -> dict | None:
        """The choice's logprobs for its tokens from `sent_tokens` on (with echo, the first time, its prompt's
        before them); None without logprobs."""
        if self.logprobs is None:
            return None
        ids, entries = out.token_ids[sent_tokens:], out.logprobs[sent_tokens:]
        if self.chat:
            return chat_logprobs(ids, entries, self.logprobs, self.token_text)
        context = [*out.prompt_token_ids[-8:], *out.token_ids[max(sent_tokens - 8, 0):sent_tokens]]
        if first and self.echo:
            ids, entries, context = out.prompt_token_ids + ids, out.prompt_logprobs + entries, []
        widths = self.text_widths(list(ids), context) if self.text_widths is not None else None
        return completion_logprobs(ids, entries, self.token_text, text_offset, widths)

    def chunk(self, choices: list, **extra) -> str:
        """One SSE chunk; with include_usage set, every chunk but the final usage one carries "usage": null
        (as OpenAI's stream does)."""
        if self.include_usage:
            extra.setdefault("usage", None)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return f"data: {json.dumps(envelope(self.id, obj, self.model, choices, self.created, **extra))}\n\n"

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        if self.chat:
            return chat_delta(index, {"content": text} if text or not finish_reason else {}, finish_reason)
        return completion_choice(index, text, finish_reason)

    def parsed_chunks(self, i: int, out, stream_deltas: ChatStreamDeltas, text: str, sent_tokens: int):
        """The chunks of a chat choice read by its parsers: one per delta (reasoning, content, a tool call), the
        finish reason on the last; logprobs on the first."""
        pieces = stream_deltas.feed(text, out.finished)
        if out.finished and not pieces:
            pieces = [{}]
        finish = self.parsers[i].finish_reason(text, out.finish_reason) if out.finished else None
        for k, piece in enumerate(pieces):
            choice = chat_delta(i, piece, finish if k == len(pieces) - 1 else None)
            if k == 0:
                choice["logprobs"] = self.logprobs_of(i, out, sent_tokens, False)
            yield self.chunk([choice])

    async def sse(self, gen: Generation, include_usage: bool):
        """SSE events: text deltas (safe to show: see TextDelta), the finish, usage if asked, then [DONE]; a
        failure (engine error, timeout, shutdown) is an error event before [DONE]. Leaving early (a client
        disconnect cancels this generator) aborts the unfinished requests."""
        self.include_usage = include_usage
        deltas = [TextDelta(s) for s in self.stops]
        sent_tokens = [0] * len(deltas)  # tokens whose logprobs were sent
        sent_chars = [0] * len(deltas)  # characters of text sent (the next logprobs' text_offset)
        sent_ids = [0] * len(deltas)  # tokens whose ids were sent (return_token_ids)
        chat_deltas = None if self.parsers is None else [ChatStreamDeltas(p) for p in self.parsers]
        chat_prompt_ids_sent = False
        started: set[int] = set()
        finals: dict = {}
        try:
            if self.chat:
                yield self.chunk([chat_delta(i, {"role": "assistant", "content": ""}, None)
                                  for i in range(len(deltas))])
            async for i, out in gen.events():
                text = deltas[i].feed(self.text_of(i, out), out.finished)
                first = i not in started
                if first and self.echo:
                    text = self.echo[i] + text
                if out.finished:
                    finals[i] = out
                if chat_deltas is not None:
                    for chunk in self.parsed_chunks(i, out, chat_deltas[i], deltas[i].sent, sent_tokens[i]):
                        yield chunk
                    sent_tokens[i] = len(out.token_ids)
                    if out.finished and out.finish_reason == "error":
                        yield f"data: {json.dumps(OpenAIError(400, out.error or 'the request failed').body())}\n\n"
                    continue
                new_tokens = self.logprobs is not None and len(out.token_ids) > sent_tokens[i]
                if text or out.finished or new_tokens or (first and self.echo):
                    choice = self.choice(i, text, out.finish_reason if out.finished else None)
                    choice["logprobs"] = self.logprobs_of(i, out, sent_tokens[i], first, sent_chars[i])
                    extra = {}
                    if self.token_ids:  # each chunk: its new tokens; the prompt's once (vLLM's stream shape)
                        choice["token_ids"] = list(out.token_ids[sent_ids[i]:])
                        sent_ids[i] = len(out.token_ids)
                        if self.chat and not chat_prompt_ids_sent:
                            extra["prompt_token_ids"], chat_prompt_ids_sent = list(out.prompt_token_ids), True
                        elif not self.chat and first:
                            choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    started.add(i)
                    sent_tokens[i], sent_chars[i] = len(out.token_ids), sent_chars[i] + len(text)
                    yield self.chunk([choice], **extra)
                if out.finished and out.finish_reason == "error":  # its grammar failed: say why
                    yield f"data: {json.dumps(OpenAIError(400, out.error or 'the request failed').body())}\n\n"
            if include_usage:
                yield self.chunk([], usage=self.usage(finals))
            log.info("%s: done", self.id)
        except EngineFailure as e:
            log.info("%s: ended with error %d: %s", self.id, e.status, e)
            gen.engine_loop.metrics.on_error(e.status)
            yield f"data: {json.dumps(failure_error(e, self.id).body())}\n\n"
        finally:
            gen.abort()
        yield "data: [DONE]\n\n"
