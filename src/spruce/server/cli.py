"""`spruce serve`: load the engine (with a progress bar) and serve the OpenAI-compatible API with uvicorn.

SIGTERM / SIGINT drain the server (see `spruce.server.graceful`) and the process exits 0; a second signal
stops it at once. If the engine fails (a step raised), every request in flight gets a 500 and the process exits
with code 70 so that a supervisor restarts it (`--keep-alive-on-engine-failure`: keep answering 503 instead).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
from pathlib import Path

from spruce.server.heap import freeze_startup_objects
from spruce.server.logs import LOG_FORMATS, configure_logging, uvicorn_log_config
from spruce.server.settings import (
    HTTP_TIMEOUT_S, KEEP_ALIVE_TIMEOUT_S, MAX_BODY_BYTES, MAX_CONNECTIONS, MAX_QUEUED_REQUESTS, REQUEST_TIMEOUT_S,
    SHUTDOWN_GRACE_PERIOD_S,
)

API_KEY_ENV = "SPRUCE_API_KEY"
UVICORN_SHUTDOWN_TIMEOUT_S = 5  # after the drain, for responses to finish writing


def _non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _name_list(text: str) -> tuple[str, ...]:
    """argparse type: a comma-separated list of names, at least one ("a,b" -> ("a", "b"))."""
    from spruce.server.security import parse_list

    names = parse_list(text)
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names, got {text!r}")
    return names


def _seconds(text: str) -> float:
    """argparse type: a duration in seconds, >= 0 (NaN refused)."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _generation_config(text: str) -> str:
    """argparse type: vLLM's --generation-config value as a --sampling-defaults one (auto -> model, vllm ->
    openai); vLLM's third form, a folder holding a generation_config.json, is not taken."""
    values = {"auto": "model", "vllm": "openai"}
    if text not in values:
        raise argparse.ArgumentTypeError(f"expected auto (the model's generation_config.json) or vllm (no model "
                                         f"defaults), got {text!r}")
    return values[text]


def add_parser(sub, add_engine_args) -> None:
    """Register the `serve` subcommand (engine flags come from spruce.cli_args.add_engine_args)."""
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: the --model path as given, or the demo model's "
                        "name); when set, no response or metric shows the model's filesystem path")
    p.add_argument("--max-request-bytes", "--max-request-body-bytes", type=_positive_int, default=MAX_BODY_BYTES,
                   help="request bodies (JSON endpoints, /tokenize and /detokenize included) larger than this get "
                        f"413, judged by Content-Length and while reading (default {MAX_BODY_BYTES} = 4 MiB)")
    p.add_argument("--allowed-hosts", type=_name_list, default=None,
                   help="comma-separated host names the Host header may carry (any port; '*.example.com' for "
                        "subdomains; '*' for any); others get 400. Default: when bound to loopback, only "
                        "localhost, 127.0.0.1 and [::1] (so that a web page cannot reach the server through DNS "
                        "rebinding); when bound to another address, any host")
    p.add_argument("--allowed-origins", type=_name_list, default=(),
                   help="comma-separated browser origins (e.g. https://app.example.com; '*' for any) allowed to "
                        "call the API cross-origin: CORS headers for them, and their POSTs are served. Default: "
                        "none (CORS off; a POST carrying another Origin gets 403)")
    p.add_argument("--metrics-no-auth", action="store_true",
                   help="serve /metrics without the API key (for Prometheus scrapers); by default, with "
                        "--api-key, /metrics needs the key like /v1")
    p.add_argument("--http-timeout", type=_seconds, default=HTTP_TIMEOUT_S,
                   help="seconds a client has to send a whole request (request line, headers and body) once it "
                        "starts; slower ones get 408 and the connection is closed (default "
                        f"{HTTP_TIMEOUT_S:g}; 0: no limit)")
    p.add_argument("--keep-alive-timeout", type=_seconds, default=KEEP_ALIVE_TIMEOUT_S,
                   help="seconds an idle kept-alive connection stays open after a response (default "
                        f"{KEEP_ALIVE_TIMEOUT_S:g})")
    p.add_argument("--max-connections", type=_positive_int, default=MAX_CONNECTIONS,
                   help="open connections served at once; a request arriving on one more gets 503 (default "
                        f"{MAX_CONNECTIONS})")
    p.add_argument("--max-queued-requests", type=_non_negative_int, default=MAX_QUEUED_REQUESTS,
                   help="engine requests (each choice of n counts) that may wait beyond the running batch; more "
                        f"get 503 with Retry-After (default {MAX_QUEUED_REQUESTS})")
    p.add_argument("--request-timeout", type=_seconds, default=REQUEST_TIMEOUT_S,
                   help="seconds a request may take from admission to its last token; longer ones are aborted "
                        f"with 504 (streams: an error event) (default {REQUEST_TIMEOUT_S:g}; 0: no limit)")
    p.add_argument("--shutdown-grace-period", type=_seconds, default=SHUTDOWN_GRACE_PERIOD_S,
                   help="on SIGTERM/SIGINT, seconds running requests get to finish before they are ended with "
                        f"an error (default {SHUTDOWN_GRACE_PERIOD_S:g}); new requests get 503 meanwhile")
    p.add_argument("--keep-alive-on-engine-failure", action="store_true",
                   help="when the engine fails (a step raised), keep the process up answering 503 (and /health "
                        "503) instead of exiting with code 70 (default: exit, so that a supervisor restarts it)")
    p.add_argument("--disable-engine-process", action="store_true",
                   help="run the engine as a thread of the HTTP server's process instead of in a process of its "
                        "own (default: its own process, so that the engine and the event loop do not share one "
                        "GIL)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="json: one JSON object per log line (time, level, logger, message), from the server, "
                        "uvicorn and the engine process alike")
    p.add_argument("--generation-config", dest="sampling_defaults", type=_generation_config,
                   default=argparse.SUPPRESS, metavar="{auto,vllm}", help="vLLM's name for --sampling-defaults: auto = model, vllm = openai")
    p.add_argument("--sampling-defaults", default="model", choices=["model", "openai"],
                   help="model (default, as SGLang and vLLM): a request that leaves temperature, top_p, top_k, "
                        "min_p or repetition_penalty unset gets the model's generation_config.json value; openai: "
                        "the API's neutral defaults (temperature 1, no cuts)")
    add_chat_parsing_args(p)
    p.set_defaults(func=cmd_serve)


def add_chat_parsing_args(p: argparse.ArgumentParser) -> None:
    """vLLM's chat template and output parsing flags."""
    from spruce.server.chat_parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

    p.add_argument("--chat-template", type=_chat_template, default=None, metavar="FILE",
                   help="the chat template (a Jinja file, or the template itself) instead of the model's")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split <think>...</think> out of chat output into reasoning_content (deepseek_r1: the "
                        "output starts in reasoning; qwen3: only when it opens with <think>)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help='read tool calls from chat output for tool_choice "auto": hermes / qwen '
                        '(<tool_call>{json}</tool_call>), llama3_json ({"name": ..., "parameters": ...})')
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (needs --tool-call-parser)')


def chat_parsing(args: argparse.Namespace):
    """The ChatParsing of the flags; SystemExit for --enable-auto-tool-choice without a parser."""
    from spruce.server.chat_parsers import ChatParsing

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (hermes, qwen or llama3_json)")
    return ChatParsing(args.chat_template, args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice)


def _chat_template(text: str) -> str:
    """--chat-template: a file's text, or the argument itself when it looks like a template (vLLM's rule)."""
    path = Path(text)
    if path.is_file():
        return path.read_text()
    if any(c in text for c in "{}\n"):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a file nor a Jinja template")


def served_name(args: argparse.Namespace) -> str:
    from spruce.config import builtin_model_path

    return args.served_model_name or args.model or builtin_model_path().name


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from spruce.cli_args import engine_kwargs
    from spruce.server.app import create_app
    from spruce.server.graceful import GracefulServer

    configure_logging(args.log_level, args.log_format)
    chat_parsing(args)  # refuse bad flags before loading the engine
    if args.disable_engine_process:
        engine_loop = _engine_thread(args, engine_kwargs(args))
    else:
        from spruce.server.engine_process import EngineProcess, ProcessEngineLoop

        engine_loop = ProcessEngineLoop(EngineProcess(engine_kwargs(args), args.log_level, args.log_format))
    engine = engine_loop.engine
    app = create_app(engine_loop, **app_options(args, engine.config.model))
    logging.getLogger("spruce.server").info("serving %r (speculation: %s)", served_name(args),
                                            engine.info()["speculative"])
    synthetic = engine.info().get("synthetic_acceptance", "off")
    if synthetic != "off":  # a benchmark setting: say so where the server's log starts
        logging.getLogger("spruce.server").warning("speculative rounds use %s", synthetic)
    freeze_startup_objects()  # the server process's heap (the engine process freezes its own)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            log_config=uvicorn_log_config(args.log_format),
                            timeout_graceful_shutdown=UVICORN_SHUTDOWN_TIMEOUT_S, **connection_options(args))
    failure = None if args.keep_alive_on_engine_failure else app.state.engine_failure
    server = GracefulServer(config, app.state.drain, failure)
    server.run()
    gc.unfreeze()  # the start-up objects are freed at exit as usual (frozen, native extensions report leaks)
    engine.shutdown()  # the engine process, or a tensor-parallel engine's workers, stop with the server
    return server.exit_code if server.started else 1


def app_options(args: argparse.Namespace, model_dir: str | None = None) -> dict:
    """create_app's keyword arguments from the flags (`model_dir`: the served model's directory, whose
    generation_config.json gives the sampling defaults with --sampling-defaults model)."""
    from spruce.sampling_defaults import model_sampling_defaults
    from spruce.server.security import default_allowed_hosts

    defaults = model_sampling_defaults(model_dir) if args.sampling_defaults == "model" and model_dir else {}
    return dict(sampling_defaults=defaults, chat_parsing=chat_parsing(args),
                model_name=served_name(args), api_key=args.api_key, max_body_bytes=args.max_request_bytes,
                max_queued_requests=args.max_queued_requests, request_timeout=args.request_timeout or None,
                shutdown_grace_period=args.shutdown_grace_period,
                allowed_hosts=args.allowed_hosts or default_allowed_hosts(args.host),
                allowed_origins=args.allowed_origins, metrics_no_auth=args.metrics_no_auth,
                hide_model_path=args.served_model_name is not None)


def connection_options(args: argparse.Namespace) -> dict:
    """uvicorn.Config options for the connection limits: how a request may arrive (its HTTP protocol: the header
    size and the --http-timeout deadline), the idle keep-alive timeout and the number of connections served."""
    from spruce.server.security import bounded_http_protocol

    return {"http": bounded_http_protocol(args.http_timeout or None), "timeout_keep_alive": args.keep_alive_timeout,
            # uvicorn answers 503 once len(connections) >= limit_concurrency, counting the new one itself
            "limit_concurrency": args.max_connections + 1}


def _engine_thread(args: argparse.Namespace, kwargs: dict):
    """--disable-engine-process: the engine in this process, stepped by the EngineLoop's thread."""
    from spruce.llm import LLM
    from spruce.ops import compile_watch
    from spruce.server.engine_loop import EngineLoop

    engine = LLM(**kwargs).engine
    if args.tp_size > 1:  # the server cannot serve without every rank: a dead worker ends it with its error
        from spruce.runtime.launch import exit_on_worker_failure

        exit_on_worker_failure(engine)
    compile_watch.serving()  # from here on a Triton compilation is a mid-serving stall (ops/compile_watch.py)
    return EngineLoop(engine)
