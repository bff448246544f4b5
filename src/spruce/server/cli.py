"""`spruce serve`: load the engine (with a progress bar) and serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os

API_KEY_ENV = "SPRUCE_API_KEY"


def add_parser(sub, add_engine_args) -> None:
    """Register the `serve` subcommand (engine flags come from spruce.cli.add_engine_args)."""
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: the --model path, or the demo model's name)")
    p.add_argument("--max-request-bytes", type=int, default=None, help="larger bodies get 413 (default 4 MiB)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)


def served_name(args: argparse.Namespace) -> str:
    from spruce.config import builtin_model_path

    return args.served_model_name or args.model or builtin_model_path().name


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from spruce.cli import engine_kwargs
    from spruce.llm import LLM
    from spruce.server.app import create_app
    from spruce.server.engine_loop import EngineLoop

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLM(**engine_kwargs(args)).engine
    limits = {} if args.max_request_bytes is None else {"max_body_bytes": args.max_request_bytes}
    app = create_app(EngineLoop(engine), model_name=served_name(args), api_key=args.api_key, **limits)
    logging.getLogger("spruce.server").info("serving %r on http://%s:%d (speculation %s)", served_name(args),
                                            args.host, args.port, "on" if engine.worker is not None else "off")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
