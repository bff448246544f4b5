"""The engine: requests in, tokens out, as a loop of plan -> launch -> resolve steps.

One step is one prefill chunk batch or one decode step (a speculative round with a draft). `plan` picks the
step's requests and reserves their pages (host only), `launch` queues the step's device work through the
decode strategy without reading anything back, and `resolve` waits for a launched step's event and turns its
result rows into tokens, stop checks and outputs. With overlap (the default), step i+1 is planned and
launched before step i is resolved, so the host's bookkeeping runs while the device computes. The device
carries each row's positions and last token from step to step (runtime/row_state.py); the host learns
accept lengths one step late and reserves pages for the worst case ahead (`Limits.lookahead`). A request
finished at resolve may still sit in the step in flight: its extra tokens are dropped and its pages are
released only once that step has completed. `disable_overlap_schedule` resolves each step right after
launching it; both orders produce the same tokens.

Thread-safe: `add_request`, `abort` and `step` take one lock, so a server thread may call them while another
thread drives `step()` in a loop.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import uuid
from dataclasses import dataclass

import torch

from spruce.config import EngineConfig
from spruce.errors import InvalidRequestError
from spruce.models.tokenizer import IncrementalDetokenizer, Tokenizer
from spruce.runtime.model_runner import ModelRunner
from spruce.runtime.output import RequestOutput
from spruce.runtime.request import Request, SpecStats, Status
from spruce.runtime.sampler import SamplingTensors
from spruce.runtime.scheduler import Scheduler
from spruce.sampling_params import SamplingParams
from spruce.speculative.strategy import PrefillChunk, make_strategy

DEBUG_ENV = "SPRUCE_DEBUG"


@dataclass
class LaunchedStep:
    """A step queued on the device whose results the host has not read yet."""

    reqs: list[Request]  # every request the step touches (each holds one `inflight` count for it)
    result_reqs: list[Request]  # the request of each result row
    result: torch.Tensor  # [len(result_reqs), step_result_width]; valid on the host once `done` has completed
    done: torch.cuda.Event | None  # None on the cpu (the result is already there)
    decode: bool  # a decode step (its accept lengths count toward speculation statistics)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        self.runner = ModelRunner(config)
        self.limits = self.runner.limits
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or config.model, self.runner.model_config)
        self.eos_token_ids = (self.tokenizer.eos_token_ids if self.tokenizer is not None
                              else self.runner.model_config.eos_token_ids)
        self.scheduler = Scheduler(self.limits, self.runner.page_table, self.runner.allocator)
        self.strategy = make_strategy(self.runner, debug=self.debug)
        if self.runner.graphs.enabled:
            self.strategy.capture_graphs(config.show_progress)
        self.requests: dict[str, Request] = {}
        self.spec_stats = SpecStats()
        self.tokens_generated = 0
        self._arrival = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._lock = threading.RLock()
        self._aborted: list[Request] = []
        self._inflight: LaunchedStep | None = None
        self._result_buffers = self._make_result_buffers()
        self._next_buffer = 0

    @property
    def speculative(self) -> bool:
        """Whether decode steps are speculative rounds (a draft model is loaded)."""
        return self.strategy.speculative

    def _make_result_buffers(self) -> list[torch.Tensor]:
        """Two page-locked host buffers for step results (at most two launched steps are unread at once)."""
        if self.runner.device.type != "cuda":
            return []
        shape = (self.limits.max_running_requests, self.limits.step_result_width)
        return [torch.zeros(shape, dtype=torch.int64, pin_memory=True) for _ in range(2)]

    # --- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises InvalidRequestError (engine state untouched) when malformed."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        lim = self.limits
        if len(ids) >= lim.context_length:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context length is {lim.context_length}, which leaves no room "
                f"for output (prompt must be < {lim.context_length} tokens)", field="prompt", status=413)
        total = min(len(ids) + params.max_tokens, lim.context_length)
        pages = lim.pages_for(total + lim.lookahead)
        if pages > self.runner.allocator.capacity:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {pages} KV pages of "
                f"{lim.page_size} tokens; the cache holds only {self.runner.allocator.capacity}",
                field="max_tokens", status=413)
        with self._lock:
            rid = request_id or uuid.uuid4().hex
            if rid in self.requests:
                raise InvalidRequestError(f"request_id {rid!r} is already in use", field="request_id")
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            req = Request(rid, ids, params, seed, next(self._arrival))
            if self.tokenizer is not None:
                req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
            self.requests[rid] = req
            self.scheduler.add(req)
        return rid

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty; expected at least one token", field="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer.json: give token ids", field="prompt")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.runner.model_config.vocab_size
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}",
                                          field="prompt")
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                      field="prompt")
        if not ids:
            raise InvalidRequestError("prompt is empty; expected at least one token", field="prompt")
        return ids

    def abort(self, request_id: str) -> None:
        """Stop a request: it leaves the queues at once and its row and pages are freed as soon as no launched
        step uses them (unknown or finished ids are ignored)."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.finished:
                return
            self.scheduler.finish(req, "abort")
            self._aborted.append(req)

    def has_unfinished(self) -> bool:
        """Requests queued or running, or a launched step not yet resolved."""
        with self._lock:
            return self.scheduler.has_work or self._inflight is not None

    # --- stepping ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan and launch the next step, resolve the one before it (overlap) or this one; return the outputs
        of every request whose state changed."""
        with self._lock:
            touched: dict[str, Request] = {q.request_id: q for q in self._aborted}
            self._aborted = []
            previous, self._inflight = self._inflight, None
            launched, previous = self._plan_and_launch(previous, touched)
            if previous is not None:
                self._resolve(previous, touched)
            if launched is not None:
                if self.limits.overlap:
                    self._inflight = launched
                else:
                    self._resolve(launched, touched)
            self.scheduler.release_settled()
            if self.debug:
                self.scheduler.check_accounting()
            return [self._output(q) for q in touched.values()]

    def drain(self) -> list[RequestOutput]:
        """Resolve the step in flight (if any) and flush aborts without launching anything; outputs as from
        `step`. Afterwards no launched step holds a row, so every finished request's pages are free."""
        with self._lock:
            touched: dict[str, Request] = {q.request_id: q for q in self._aborted}
            self._aborted = []
            if self._inflight is not None:
                self._resolve(self._inflight, touched)
                self._inflight = None
            self.scheduler.release_settled()
            return [self._output(q) for q in touched.values()]

    def _plan_and_launch(self, previous: LaunchedStep | None, touched: dict[str, Request]):
        """Plan the next step and launch it. Preemption needs the step in flight resolved first (its requests'
        pages must settle): then `previous` is resolved here and None is handed back in its place."""
        sched = self.scheduler
        sched.admit()
        kind = sched.next_kind()
        if kind == "prefill":
            return self._launch_prefill(sched.prefill_requests()), previous
        if kind is None:
            return None, previous
        while True:
            reqs = sched.decode_requests()
            if not reqs:
                return None, previous
            if sched.reserve_decode(reqs) is None:
                return self._launch_decode(reqs), previous
            if previous is not None:  # pages may come back with the step in flight: resolve it first
                self._resolve(previous, touched)
                previous = None
                sched.release_settled()
            else:
                sched.preempt_youngest()

    def _sampling(self, reqs: list[Request], repeat: int = 1) -> SamplingTensors:
        return SamplingTensors.build([q.params for q in reqs], [q.seed for q in reqs],
                                     self.runner.model_config.vocab_size, self.runner.device, repeat)

    def _launch_prefill(self, reqs: list[Request]) -> LaunchedStep:
        """One batch of prompt chunks (oldest first, up to chunked_prefill_size tokens)."""
        budget = self.limits.chunked_prefill_size
        chunks: list[PrefillChunk] = []
        stepped: list[Request] = []
        for q in reqs:
            start = q.committed
            take = min(q.num_tokens - start, budget)
            if take <= 0:
                break
            self.runner.page_table.check_covers(q.row, start + take, f"prefill of request {q.request_id}")
            ids = q.token_ids
            final = start + take == q.num_tokens
            chunks.append(PrefillChunk(q.row, start, ids[start:start + take], ids[start + 1:start + take + 1], final))
            stepped.append(q)
            budget -= take
        finals = [q for q, c in zip(stepped, chunks) if c.final]
        with self.runner.timer.phase("prefill"):
            result = self.strategy.prefill(chunks, self._sampling(finals))
        for q, c in zip(stepped, chunks):
            q.committed = c.start + len(c.tokens)
            if c.final:
                q.status = Status.DECODE
        return self._launched(stepped, finals, result, decode=False)

    def _launch_decode(self, reqs: list[Request]) -> LaunchedStep:
        """One decode step (speculative round) for `reqs`, whose pages cover `lookahead` positions ahead."""
        advance = self.limits.step_advance
        ends = []
        for q in reqs:  # always-on: the pages cover every position the step, after those in flight, may write
            end = q.committed + (q.inflight + 1) * advance
            self.runner.page_table.check_covers(q.row, end, f"decode step of request {q.request_id}")
            ends.append(end)
        repeat = self.limits.num_draft_tokens if self.speculative else 1
        result = self.strategy.decode([q.row for q in reqs], max(ends), self._sampling(reqs, repeat))
        return self._launched(reqs, reqs, result, decode=True)

    def _launched(self, reqs: list[Request], result_reqs: list[Request], result: torch.Tensor,
                  decode: bool) -> LaunchedStep:
        """Record a queued step: start the copy of its result to the host and mark its requests in flight."""
        for q in reqs:
            q.inflight += 1
        done = None
        if self._result_buffers:
            host = self._result_buffers[self._next_buffer][: result.shape[0]]
            self._next_buffer = 1 - self._next_buffer
            host.copy_(result, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            result = host
        return LaunchedStep(reqs, result_reqs, result, done, decode)

    def _resolve(self, step: LaunchedStep, touched: dict[str, Request]) -> None:
        """Wait for a launched step and apply its tokens (dropped for requests finished meanwhile)."""
        with self.runner.timer.phase("sync"):
            if step.done is not None:
                step.done.synchronize()
            rows = step.result.tolist()
        for q in step.reqs:
            q.inflight -= 1
        for q, row in zip(step.result_reqs, rows):
            if q.finished:
                continue
            accepted = row[0]
            if step.decode:
                q.committed += accepted + 1
                if self.speculative:
                    q.spec.add_round(accepted, self.limits.num_steps)
                    self.spec_stats.add_round(accepted, self.limits.num_steps)
            self._append(q, row[1:accepted + 2])
            touched[q.request_id] = q

    # --- stop conditions and outputs ------------------------------------------------------------------------------
    def _append(self, q: Request, tokens: list[int]) -> None:
        """Append tokens one by one until a stop condition; the rest are dropped."""
        p = q.params
        eos = () if p.ignore_eos else self.eos_token_ids
        for t in tokens:
            q.output_ids.append(t)
            q.new_token_count += 1
            self.tokens_generated += 1
            added = q.detokenizer.add([t]) if q.detokenizer is not None else ""
            q.text += added
            if p.stop and added and self._cut_at_stop_string(q, len(added)):
                self.scheduler.finish(q, "stop")  # the text ends before the stop string: nothing to flush
                return
            reason = None
            if t in eos or t in p.stop_token_ids:
                reason = "stop"
            elif len(q.output_ids) >= p.max_tokens or q.num_tokens >= self.limits.context_length:
                reason = "length"
            if reason:
                self._flush_text(q)
                self.scheduler.finish(q, reason)
                return

    def _flush_text(self, q: Request) -> None:
        if q.detokenizer is not None:
            q.text += q.detokenizer.flush()

    def _cut_at_stop_string(self, q: Request, added: int) -> bool:
        """Search the text that `added` new characters could complete a stop string in; cut before the first."""
        longest = max(len(s) for s in q.params.stop)
        start = max(0, len(q.text) - added - longest + 1)
        cut = min((i for i in (q.text.find(s, start) for s in q.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        q.text = q.text[:cut]
        return True

    def _output(self, q: Request) -> RequestOutput:
        n = q.new_token_count
        q.new_token_count = 0
        if q.finished and q.finish_reason == "abort":
            self._flush_text(q)
        out = RequestOutput(
            request_id=q.request_id, prompt_token_ids=q.prompt_ids, token_ids=list(q.output_ids), text=q.text,
            new_token_ids=q.output_ids[len(q.output_ids) - n:] if n else [], finished=q.finished,
            finish_reason=q.finish_reason, spec_stats=q.spec.as_dict() if self.speculative else {},
        )
        if q.finished:
            self.requests.pop(q.request_id, None)
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    # --- introspection ----------------------------------------------------------------------------------------------
    def check_no_leaks(self) -> None:
        """Raise InvariantError unless every page is free or held by a running or retiring request."""
        with self._lock:
            self.scheduler.check_accounting()

    def info(self) -> dict[str, str]:
        """What this engine serves and how: device, model, dtype, attention backend, speculation, graphs."""
        from spruce.bench.common import device_name

        cfg, lim, spec = self.config, self.limits, self.config.speculative
        return {
            "device": device_name(str(self.runner.device)), "model": str(cfg.model), "dtype": cfg.dtype,
            "attention_backend": self.runner.backend.name, "page_size": str(lim.page_size),
            "speculative": (f"{spec.algorithm} S={spec.num_steps} K={spec.eagle_topk} N={spec.num_draft_tokens}"
                            if spec is not None else "off"),
            "overlap_schedule": "on" if lim.overlap else "off",
            "cuda_graph_buckets": ",".join(map(str, lim.graph_buckets)) if self.runner.graphs.enabled else "off",
        }

    def stats(self) -> dict:
        with self._lock:
            alloc = self.runner.allocator
            return {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_pages_used": alloc.num_used,
                "kv_pages_free": alloc.num_free,
                "kv_pages_total": alloc.capacity,
                "tokens_generated": self.tokens_generated,
                "preemptions": self.scheduler.num_preemptions,
                "spec": self.spec_stats.as_dict() if self.speculative else None,
            }
