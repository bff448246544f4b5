"""SGLang's native endpoints, so that SGLang users' scripts, `sglang.bench_serving --backend sglang` and SGLang's
router work against spruce:

- `POST /generate`: SGLang's GenerateReqInput. `text` (a string or a list) or `input_ids` (a list or a list of
  lists); `sampling_params` with SGLang's names (max_new_tokens, min_new_tokens, sampling_seed, json_schema, ...);
  `stream`, `return_logprob`, `top_logprobs_num`, `logprob_start_len`, `return_text_in_logprobs`, `rid`.
  The answer is `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "e2e_latency", logprobs when asked}}`, a list of them for batched input
  (prompt-major: prompt i's n outputs at i*n ... i*n+n-1). Streamed, each `data: {...}` chunk holds one output's
  cumulative text and ids (with "index" for batched input), `finish_reason` null until it ends; `data: [DONE]`
  closes the stream.
- `GET /health_generate`: generates one token; 200 when it came, 503 (naming why) otherwise.

A /generate body is translated into a /v1/completions request and served by the same path (validation, sampling
defaults, limits, abort on disconnect); errors name SGLang's field. Fields SGLang has that would change the
output and spruce does not implement are refused at any value but their neutral one; top-level fields neither
knows are ignored with a log line; an unknown sampling_params key is refused (as SGLang's SamplingParams does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from spruce.errors import InvalidRequestError
from spruce.sampling_params import SamplingParams
from spruce.server.engine_loop import EngineFailure, Generation, failure_error
from spruce.server.protocol import LOGPROB_FLOOR, CompletionRequest, OpenAIError, TextDelta, parse_request

log = logging.getLogger("spruce.server")
MAX_NEW_TOKENS_DEFAULT = 128  # SGLang's default max_new_tokens
HEALTH_TIMEOUT_S = 20.0  # how long /health_generate waits for its token

# SGLang sampling_params key -> the /v1/completions field it maps onto (same meaning)
SAMPLING_FIELDS = {
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop", "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens", "n": "n",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "regex": "regex", "ebnf": "ebnf", "no_stop_trim": "no_stop_trim",
    "logit_bias": "logit_bias", "sampling_seed": "seed", "json_schema": "structured_outputs",
}
# the values of a field spruce does not implement that change nothing: (in words, test)
ONLY_NULL = ("null", lambda v: v is None)
ONLY_FALSE = ("false", lambda v: v in (None, False))
# SGLang sampling_params keys spruce does not implement
SAMPLING_NEUTRAL = {
    "stop_regex": ONLY_NULL,
    "structural_tag": ONLY_NULL,
    "custom_params": ONLY_NULL,
    "stream_interval": ONLY_NULL,
    "logit_bias_type": ONLY_NULL,
}
# SGLang top-level GenerateReqInput fields spruce does not implement
TOP_LEVEL_NEUTRAL = {
    "input_embeds": ONLY_NULL,
    "image_data": ONLY_NULL,
    "video_data": ONLY_NULL,
    "audio_data": ONLY_NULL,
    "lora_path": ONLY_NULL,
    "lora_id": ONLY_NULL,
    "custom_logit_processor": ONLY_NULL,
    "token_ids_logprob": ONLY_NULL,
    "session_params": ONLY_NULL,
    "return_hidden_states": ONLY_FALSE,
    "return_routed_experts": ONLY_FALSE,
}
# top-level fields read here (the rest of SGLang's are routing / bookkeeping: ignored with a log line)
TOP_LEVEL_FIELDS = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "top_logprobs_num",
                    "logprob_start_len", "return_text_in_logprobs", "rid", "model"}


def add_sglang_routes(app: FastAPI, api) -> None:
    """Register /generate and /health_generate on `app`; `api` is the app's request plumbing (authorize,
    read_json, prompt_ids, max_tokens, sampling_params, loop, limits, engine)."""
    native = _Native(api)
    app.post("/generate")(native.generate)
    app.get("/health_generate")(native.health_generate)


def _refuse(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


class GenerateRequest:
    """A /generate body read into the /v1/completions request it stands for, plus SGLang's own output options.

    `req`: the CompletionRequest; `batched`: the input was a list of prompts; `logprob` / `top_logprobs_num` /
    `logprob_start_len` / `text_in_logprobs`: SGLang's logprob options; `rids`: the ids the outputs carry."""

    def __init__(self, body: dict):
        unknown = sorted(k for k in body if k not in TOP_LEVEL_FIELDS and k not in TOP_LEVEL_NEUTRAL)
        if unknown:
            log.warning("/generate: the following fields were present in the request but ignored: %s",
                        [name[:64] for name in unknown[:20]])
        for name, (allowed, neutral) in TOP_LEVEL_NEUTRAL.items():
            if name in body and not neutral(body[name]):
                raise OpenAIError(400, f"{name}={_show(body[name])} is not supported; send {allowed}, or leave it "
                                  f"out", param=name, code="unsupported")
        prompt, self.batched = self.read_prompt(body)
        self.prompt_param = "text" if body.get("text") is not None else "input_ids"
        self.logprob = self.read_flag(body, "return_logprob")
        self.text_in_logprobs = self.read_flag(body, "return_text_in_logprobs")
        self.top_logprobs_num = self.read_int(body, "top_logprobs_num", 0)
        self.logprob_start_len = self.read_int(body, "logprob_start_len", -1)
        if self.logprob_start_len < -1:
            raise _refuse("logprob_start_len", f"must be -1 (no prompt logprobs) or a prompt position >= 0, got "
                          f"{self.logprob_start_len}")
        fields = {"prompt": prompt, "stream": body.get("stream", False), "model": body.get("model")}
        fields.update(self.read_sampling(body.get("sampling_params")))
        if self.logprob:
            fields["logprobs"] = self.top_logprobs_num
            if self.logprob_start_len >= 0:
                fields["prompt_logprobs"] = self.top_logprobs_num
        elif self.top_logprobs_num:
            raise _refuse("top_logprobs_num", f"{self.top_logprobs_num} needs return_logprob: true")
        try:
            self.req: CompletionRequest = parse_request(CompletionRequest, fields)
        except OpenAIError as e:
            raise self.renamed(e) from None
        self.rids = self.read_rids(body.get("rid"))

    @staticmethod
    def read_prompt(body: dict) -> tuple:
        """(the completions prompt, whether it is a batch): exactly one of text and input_ids."""
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            given = "both" if text is not None else "neither"
            raise OpenAIError(400, f"send exactly one of text and input_ids (got {given})",
                              param="input_ids" if text is not None else "text", code="invalid_value")
        if text is not None:
            if isinstance(text, str):
                return text, False
            if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                return text, True
            raise _refuse("text", f"must be a string or a non-empty list of strings, got {_show(text)}")
        if isinstance(ids, list) and ids and all(type(t) is int for t in ids):
            return ids, False
        if (isinstance(ids, list) and ids and all(isinstance(p, list) and p and all(type(t) is int for t in p)
                                                  for p in ids)):
            return ids, True
        raise _refuse("input_ids", f"must be a non-empty list of token ids or of token-id lists, got {_show(ids)}")

    @staticmethod
    def read_flag(body: dict, name: str) -> bool:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise _refuse(name, f"must be true or false, got {_show(value)}")
        return bool(value)

    @staticmethod
    def read_int(body: dict, name: str, default: int) -> int:
        value = body.get(name)
        if value is None:
            return default
        if type(value) is not int:
            raise _refuse(name, f"must be an integer, got {_show(value)}")
        return value

    @staticmethod
    def read_sampling(params) -> dict:
        """The completions fields of SGLang's sampling_params (a dict, or a list of equal dicts, one per prompt)."""
        if isinstance(params, list):
            if not params or any(p != params[0] for p in params):
                raise _refuse("sampling_params", "a list of different sampling_params per prompt is not supported; "
                              "send one object for all prompts")
            params = params[0]
        if params is None:
            return {}
        if not isinstance(params, dict):
            raise _refuse("sampling_params", f"must be an object, got {_show(params)}")
        fields = {}
        for key, value in params.items():
            if key in SAMPLING_NEUTRAL:
                allowed, neutral = SAMPLING_NEUTRAL[key]
                if not neutral(value):
                    raise OpenAIError(400, f"sampling_params.{key}={_show(value)} is not supported; send {allowed}, "
                                      f"or leave it out", param=f"sampling_params.{key}", code="unsupported")
            elif key not in SAMPLING_FIELDS:
                raise OpenAIError(400, f"sampling_params.{key}: unknown sampling parameter; SGLang's known to "
                                  f"spruce: {sorted(SAMPLING_FIELDS)}", param=f"sampling_params.{key}",
                                  code="unknown_parameter")
            elif value is not None and key == "json_schema":
                fields["structured_outputs"] = {"json": value}
            elif value is not None:
                fields[SAMPLING_FIELDS[key]] = value
        return fields

    def read_rids(self, rid) -> list[str] | None:
        """The id of each prompt's outputs (SGLang's rid: a string for one prompt, a list for a batch)."""
        if rid is None:
            return None
        count = len(self.req.prompts())
        if isinstance(rid, str) and not self.batched:
            return [rid]
        if isinstance(rid, list) and self.batched and len(rid) == count and all(isinstance(r, str) for r in rid):
            return rid
        raise _refuse("rid", f"must be a string for one prompt or a list of {count} strings for {count} prompts, got "
                      f"{_show(rid)}")

    def renamed(self, e: OpenAIError) -> OpenAIError:
        """A completions error re-worded with SGLang's field names (max_tokens -> sampling_params.max_new_tokens,
        prompt -> text / input_ids)."""
        names = {v: k for k, v in SAMPLING_FIELDS.items()}
        param = e.param or ""
        head = param.partition(".")[0]
        if head == "prompt":
            e.message, e.param = e.message.replace("prompt", self.prompt_param, 1), self.prompt_param
        elif head in names:
            new = f"sampling_params.{names[head]}"
            e.message, e.param = e.message.replace(head, new, 1), new
        elif head == "logprobs":
            e.message, e.param = e.message.replace("logprobs", "top_logprobs_num", 1), "top_logprobs_num"
        return e


class _Native:
    def __init__(self, api):
        self.api = api

    async def generate(self, request: Request):
        api = self.api
        api.authorize(request)
        greq = GenerateRequest(await api.read_json(request))
        req = greq.req
        api.check_model(req.model)
        prompts = req.prompts()
        try:
            prompt_ids = await asyncio.to_thread(lambda: [api.prompt_ids(p) for p in prompts])
            jobs = []
            for ids in prompt_ids:
                max_tokens = api.max_tokens(req, len(ids), MAX_NEW_TOKENS_DEFAULT, "prompt")
                jobs += [(ids, sp) for sp in api.sampling_params(req, max_tokens)]
        except OpenAIError as e:
            raise greq.renamed(e) from None
        if greq.logprob and greq.logprob_start_len >= 0:
            short = [len(ids) for ids in prompt_ids if greq.logprob_start_len >= len(ids)]
            if short:
                raise _refuse("logprob_start_len", f"{greq.logprob_start_len} is not a position of the prompt (it "
                              f"has {short[0]} tokens)")
        base_id = uuid.uuid4().hex
        try:
            gen = await Generation.start(api.loop, base_id, jobs, api.limits.max_queued_requests,
                                         api.limits.request_timeout)
        except InvalidRequestError as e:
            raise greq.renamed(OpenAIError.from_invalid_request(e, req.param_names)) from None
        except EngineFailure as e:
            raise failure_error(e) from None
        log.info("%s: /generate, %d output(s), stream=%s", base_id, len(jobs), req.stream)
        ids = [greq.rids[i // req.n] if greq.rids else f"{base_id}-{i}" for i in range(len(jobs))]
        out = _Outputs(greq, ids, [sp.stop for _, sp in jobs], [set(sp.stop_token_ids) for _, sp in jobs],
                       api.engine.tokenizer)
        if req.stream:
            return StreamingResponse(out.sse(gen), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            outs = await gen.collect_while_connected(request.receive)
        except EngineFailure as e:
            raise failure_error(e) from None
        if outs is None:
            log.info("%s: client disconnected, aborted", base_id)
            return Response(status_code=499)
        for o in outs:
            if o.finish_reason == "error":
                raise OpenAIError(400, o.error or "the request failed", param="sampling_params")
        items = [out.item(i, o, o.text) for i, o in enumerate(outs)]
        return items if greq.batched else items[0]

    async def health_generate(self, request: Request):
        """SGLang's deep health check: one token generated from a one-token prompt (the tokenizer's BOS, else
        token 0), within HEALTH_TIMEOUT_S."""
        api = self.api
        api.authorize(request)
        tok = api.engine.tokenizer
        bos = getattr(tok, "bos_token_id", None) if tok is not None else None
        job = ([bos if isinstance(bos, int) else 0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        gen = None
        try:
            gen = await Generation.start(api.loop, "health-" + uuid.uuid4().hex[:12], [job], None, HEALTH_TIMEOUT_S)
            outs = await gen.collect()
        except EngineFailure as e:
            return JSONResponse({"status": "unhealthy", "error": str(e)}, status_code=503)
        finally:
            if gen is not None:
                gen.abort()
        if len(outs[0].token_ids) != 1:
            return JSONResponse({"status": "unhealthy", "error": f"finished with {outs[0].finish_reason!r} before "
                                 "generating a token"}, status_code=503)
        return {"status": "ok"}


class _Outputs:
    """Formats /generate outputs in SGLang's shape (whole response items and cumulative SSE chunks)."""

    def __init__(self, greq: GenerateRequest, ids: list[str], stops: list[tuple[str, ...]],
                 stop_token_ids: list[set[int]], tokenizer):
        self.greq, self.ids, self.stops, self.stop_token_ids, self.tok = greq, ids, stops, stop_token_ids, tokenizer
        self.start = time.perf_counter()

    def full_text(self, out) -> str:
        return self.tok.decode(list(out.token_ids)) if self.tok is not None else out.text

    def finish_reason(self, i: int, out) -> dict | None:
        """SGLang's finish reason: {"type": "length", "length": n}, {"type": "stop", "matched": the stop string or
        the token id that ended it}, {"type": "abort", "message"}; None while running."""
        if not out.finished:
            return None
        if out.finish_reason == "length":
            return {"type": "length", "length": len(out.token_ids)}
        if out.finish_reason != "stop":
            return {"type": "abort", "message": out.error or out.finish_reason}
        last = out.token_ids[-1] if out.token_ids else None
        if self.stops[i] and last not in self.stop_token_ids[i]:
            rest = self.full_text(out)[len(out.text):]
            matched = next((s for s in self.stops[i] if rest.startswith(s)), None)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        return {"type": "stop", "matched": last}

    def text_of(self, i: int, out) -> str:
        """The output text; with no_stop_trim, the stop string that ended it stays at its end."""
        reason = self.finish_reason(i, out)
        if self.greq.req.no_stop_trim and reason and isinstance(reason.get("matched"), str):
            return out.text + reason["matched"]
        return out.text

    def item(self, i: int, out, text: str) -> dict:
        meta = {"id": self.ids[i], "finish_reason": self.finish_reason(i, out),
                "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                "cached_tokens": out.num_cached_tokens, "e2e_latency": time.perf_counter() - self.start}
        if self.greq.logprob:
            meta.update(self.logprobs(out))
        return {"text": self.text_of(i, out) if out.finished else text, "output_ids": list(out.token_ids),
                "meta_info": meta}

    def entry(self, token_id: int, logprob) -> list:
        """SGLang's [logprob, token id, token text or null]."""
        text = None
        if self.greq.text_in_logprobs:
            text = logprob.decoded_token if logprob is not None and logprob.decoded_token is not None else (
                self.tok.token_text(token_id) if self.tok is not None else None)
        return [None if logprob is None else max(logprob.logprob, LOGPROB_FLOOR), token_id, text]

    def top(self, entry: dict | None) -> list | None:
        """The top_logprobs_num most likely tokens of one position, by rank."""
        if entry is None:
            return None
        best = sorted(entry.items(), key=lambda kv: kv[1].rank)[:self.greq.top_logprobs_num]
        return [self.entry(t, lp) for t, lp in best]

    def logprobs(self, out) -> dict:
        """input_token_logprobs (from logprob_start_len; none with -1), output_token_logprobs and, with
        top_logprobs_num, input/output_top_logprobs."""
        start = self.greq.logprob_start_len
        prompt = list(zip(out.prompt_token_ids, out.prompt_logprobs or []))[start:] if start >= 0 else []
        output = list(zip(out.token_ids, out.logprobs or []))
        meta = {"input_token_logprobs": [self.entry(t, None if e is None else e[t]) for t, e in prompt],
                "output_token_logprobs": [self.entry(t, e[t]) for t, e in output]}
        if self.greq.top_logprobs_num:
            meta["input_top_logprobs"] = [self.top(e) for _, e in prompt]
            meta["output_top_logprobs"] = [self.top(e) for _, e in output]
        return meta

    async def sse(self, gen: Generation):
        """One `data:` chunk per output update (cumulative text held back where it could start a stop string),
        an error chunk on failure, then `data: [DONE]`; a client disconnect aborts the unfinished requests."""
        deltas = [TextDelta(s) for s in self.stops]
        try:
            async for i, out in gen.events():
                deltas[i].feed(out.text, out.finished)
                item = self.item(i, out, deltas[i].sent)
                if self.greq.batched:
                    item["index"] = i
                yield f"data: {json.dumps(item)}\n\n"
                if out.finished and out.finish_reason == "error":
                    yield f"data: {json.dumps(OpenAIError(400, out.error or 'the request failed').body())}\n\n"
        except EngineFailure as e:
            gen.engine_loop.metrics.on_error(e.status)
            yield f"data: {json.dumps(failure_error(e).body())}\n\n"
        finally:
            gen.abort()
        yield "data: [DONE]\n\n"
