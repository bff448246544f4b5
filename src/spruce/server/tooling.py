"""Endpoints for the tools users already run against vLLM and SGLang servers:

- vLLM's `POST /tokenize` (text or chat form) -> `{"count", "max_model_len", "tokens", "token_strs"}` and
  `POST /detokenize` -> `{"prompt"}`;
- `GET /version` -> `{"version"}`;
- SGLang's `GET /server_info` (alias `/get_server_info`): server arguments plus `internal_states`, whose first
  entry's `avg_spec_accept_length` is what `sglang.bench_serving` reports as the accept length;
- SGLang's `POST /flush_cache` (what `sglang.bench_serving --flush-cache` calls): drops every prefix-cache page
  no running request holds;
- SGLang's `GET /model_info` (alias `/get_model_info`): the model's path, tokenizer path, `model_type` and
  `architectures` (config.json), which SGLang's router reads when it registers a worker;
- SGLang's `GET /get_load`: `[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]`, which SGLang's router
  sums over `num_tokens` for its `/get_loads` view and its `power_of_two` policy.

Everything comes from public Engine attributes (`tokenizer`, `vocab_size`, `limits`, `config`, `info()`) and
from the metrics' snapshot of `Engine.stats()`, so no handler but /flush_cache waits on the engine lock.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import FastAPI, Request

from spruce.models.hf_config import read_json
from spruce.server.protocol import (
    DetokenizeRequest, OpenAIError, TokenizeChatRequest, TokenizeCompletionRequest, parse_tool_request,
)


def add_tooling_routes(app: FastAPI, api) -> None:
    """Register the routes on `app`; `api` is the app's request plumbing (authorize, read_json, check_model,
    chat_prompt, engine, metrics)."""
    tools = _Tools(api)
    app.post("/tokenize")(tools.tokenize)
    app.post("/detokenize")(tools.detokenize)
    app.get("/version")(tools.version)
    app.get("/server_info")(tools.server_info)
    app.get("/get_server_info")(tools.server_info)
    app.post("/flush_cache")(tools.flush_cache)
    app.get("/model_info")(tools.model_info)
    app.get("/get_model_info")(tools.model_info)
    app.get("/get_load")(tools.load)


class _Tools:
    def __init__(self, api):
        self.api = api
        self.engine = api.engine
        self._checkpoint_config: dict | None = None

    def tokenizer(self, param: str):
        tok = self.engine.tokenizer
        if tok is None:
            raise OpenAIError(400, "this model has no tokenizer.json: the server cannot tokenize text", param=param)
        return tok

    async def tokenize(self, request: Request):
        api = self.api
        api.authorize(request)
        body = await api.read_json(request)
        cls = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        req = parse_tool_request(cls, body)
        api.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            tok = self.tokenizer("messages")
            messages = [m.as_dict() for m in req.messages]
            ids = await asyncio.to_thread(api.chat_prompt, messages, req.add_generation_prompt,
                                          req.add_special_tokens)
        else:
            tok = self.tokenizer("prompt")
            api.check_prompt_chars(req.prompt, "prompt")
            ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": api.max_request_tokens, "tokens": ids, "token_strs": None}

    async def detokenize(self, request: Request):
        api = self.api
        api.authorize(request)
        req = parse_tool_request(DetokenizeRequest, await api.read_json(request))
        api.check_model(req.model)
        tok = self.tokenizer("tokens")
        vocab = min(self.engine.vocab_size, tok.vocab_size)
        outside = [t for t in req.tokens if not 0 <= t < vocab]
        if outside:
            raise OpenAIError(400, f"tokens must be token ids in [0, {vocab}), got {outside[:5]}", param="tokens",
                              code="invalid_value")
        text = await asyncio.to_thread(tok.decode, req.tokens, False)
        return {"prompt": text}

    async def flush_cache(self, request: Request):
        """Evict the unreferenced prefix-cache pages (the only handler that takes the engine lock, off the loop)."""
        self.api.authorize(request)
        freed = await asyncio.to_thread(self.engine.flush_cache)
        return {"flushed_pages": freed}

    async def model_info(self, request: Request):
        """SGLang's model info: paths as responses show them (see `shown_path`), and the checkpoint's
        `model_type` and `architectures` as its config.json gives them (a text generation model: is_generation)."""
        api = self.api
        api.authorize(request)
        cfg = self.engine.config
        hf = await asyncio.to_thread(self.checkpoint_config)
        return {"model_path": api.shown_path(cfg.model), "tokenizer_path": api.shown_path(cfg.tokenizer or cfg.model),
                "served_model_name": api.model_name, "is_generation": True,
                "model_type": hf.get("model_type"), "architectures": hf.get("architectures")}

    def checkpoint_config(self) -> dict:
        """The served checkpoint's config.json (read once: the engine loaded from it)."""
        if self._checkpoint_config is None:
            self._checkpoint_config = read_json(Path(self.engine.config.model) / "config.json", "model config")
        return self._checkpoint_config

    async def load(self, request: Request):
        """SGLang's load report, one entry (spruce has one data-parallel rank per server): requests running and
        waiting, and `num_tokens`, the work they hold: the running requests' tokens so far (prompt and output)
        plus the waiting prompts. From the latest engine stats (taken after a step: at most STATS_INTERVAL_S old
        while requests run)."""
        self.api.authorize(request)
        snap = self.api.loop.metrics.snapshot()
        running, waiting = snap.get("running", 0), snap.get("waiting", 0)
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                 "num_tokens": snap.get("request_tokens", 0)}]

    async def version(self):
        import spruce

        return {"version": spruce.__version__}

    async def server_info(self, request: Request):
        """SGLang's server info: its server-argument names (what spruce has of them) and `internal_states`.
        `avg_spec_accept_length` (tokens committed per verify round, bonus included, since the server started)
        is given both in internal_states[0] (where sglang.bench_serving reads it) and at the top level."""
        import spruce

        api = self.api
        api.authorize(request)
        cfg, lim = self.engine.config, self.engine.limits
        spec = cfg.speculative
        snap = api.loop.metrics.snapshot()
        spec_stats = snap.get("spec")
        accept = spec_stats.get("mean_accept_length") if spec_stats and spec_stats.get("rounds") else None
        state = {"avg_spec_accept_length": accept, "last_gen_throughput": snap.get("tokens_per_second", 0.0),
                 "num_running_reqs": snap.get("running", 0), "num_waiting_reqs": snap.get("waiting", 0)}
        return {
            "model_path": api.shown_path(cfg.model), "tokenizer_path": api.shown_path(cfg.tokenizer or cfg.model),
            "served_model_name": api.model_name, "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "device": cfg.device, "dtype": cfg.dtype,
            "attention_backend": api.loop.metrics.info.get("attention_backend"),
            "page_size": lim.page_size, "max_running_requests": lim.max_running_requests,
            "context_length": lim.context_length, "max_model_len": api.max_request_tokens,
            "max_total_num_tokens": snap.get("kv_pages_total", 0) * lim.page_size,
            "chunked_prefill_size": lim.chunked_prefill_size, "disable_overlap_schedule": not lim.overlap,
            "disable_radix_cache": cfg.disable_radix_cache,
            "mixed_steps": api.loop.metrics.info.get("mixed_steps") == "on",  # prompt chunks inside decode steps
            "scheduler_delay_factor": cfg.scheduler_delay_factor,
            "speculative_algorithm": spec.algorithm if spec else None,
            "speculative_draft_model_path": api.shown_path(spec.draft_model) if spec else None,
            "speculative_num_steps": spec.num_steps if spec else None,
            "speculative_eagle_topk": spec.eagle_topk if spec else None,
            "speculative_num_draft_tokens": spec.num_draft_tokens if spec else None,
            "speculative_adaptive": spec.adaptive if spec else False,
            "speculative_adaptive_widths": list(spec.adaptive_widths) if spec else [],
            # a benchmark setting: drafts accepted at these rates, not verified (speculative/synthetic.py)
            "speculative_synthetic_acceptance_rates": (list(spec.synthetic_acceptance_rates)
                                                       if spec and spec.synthetic_acceptance_rates else None),
            "speculative_synthetic_acceptance_length": spec.synthetic_acceptance_length if spec else None,
            "load_format": cfg.load_format,
            "avg_spec_accept_length": accept,
            "internal_states": [state],
            "version": spruce.__version__,
        }
