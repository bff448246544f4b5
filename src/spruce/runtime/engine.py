"""The engine: requests in, tokens out. One `step()` = one prefill chunk or one decode round for the batch.

Thread-safe: `add_request`, `abort` and `step` take one lock, so a server thread may call them while another
thread drives `step()` in a loop.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import uuid

import torch

from spruce.config import EngineConfig
from spruce.errors import InvalidRequestError
from spruce.models.tokenizer import Tokenizer
from spruce.runtime.model_runner import ModelRunner
from spruce.runtime.output import RequestOutput
from spruce.runtime.request import Request, SpecStats, Status
from spruce.runtime.sampler import SamplingTensors, select_tokens
from spruce.runtime.scheduler import Scheduler
from spruce.sampling_params import SamplingParams

DEBUG_ENV = "SPRUCE_DEBUG"


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
        self.worker = None
        if config.speculative is not None:
            from spruce.speculative.eagle_worker import EagleWorker

            self.worker = EagleWorker(self.runner, debug=self.debug)
        if self.runner.graphs.enabled:
            (self.worker or self.runner).capture_graphs(config.show_progress)
        self.requests: dict[str, Request] = {}
        self.spec_stats = SpecStats()
        self.tokens_generated = 0
        self._arrival = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._lock = threading.RLock()
        self._aborted: list[Request] = []

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
        """Stop a request and free its row and pages at once (unknown or finished ids are ignored)."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.finished:
                return
            self.scheduler.finish(req, "abort")
            self._aborted.append(req)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.scheduler.waiting or self.scheduler.running)

    # --- stepping ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self._lock:
            touched: list[Request] = self._aborted
            self._aborted = []
            self.scheduler.admit()
            prefill = self.scheduler.prefill_requests()
            if prefill:
                with self.runner.timer.phase("prefill"):
                    touched += self._prefill_step(prefill)
            else:
                decoding = self.scheduler.prepare_decode()
                if decoding:
                    touched += self._decode_step(decoding)
            if self.debug:
                self.scheduler.check_accounting()
            return [self._output(r) for r in touched]

    def _sampling(self, reqs: list[Request], repeat: int = 1) -> SamplingTensors:
        return SamplingTensors.build([r.params for r in reqs], [r.seed for r in reqs],
                                     self.runner.model_config.vocab_size, self.runner.device, repeat)

    def _prefill_step(self, reqs: list[Request]) -> list[Request]:
        r = self.runner
        budget = self.limits.chunked_prefill_size
        chunks: list[tuple[Request, int, int]] = []
        for q in sorted(reqs, key=lambda q: q.arrival):
            take = min(q.num_tokens - q.committed, budget)
            if take <= 0:
                break
            r.page_table.check_covers(q.row, q.committed + take, f"prefill of request {q.request_id}")
            chunks.append((q, q.committed, take))
            budget -= take
        rows = [q.row for q, _, _ in chunks]
        starts = [s for _, s, _ in chunks]
        batch = r.builder.extend(rows, starts, [q.token_ids[s:s + n] for q, s, n in chunks])
        hidden, aux = r.target_forward(batch)
        finals = [s + n == q.num_tokens for q, s, n in chunks]
        last_index = list(itertools.accumulate(n for _, _, n in chunks))
        final_reqs = [q for (q, _, _), f in zip(chunks, finals) if f]
        new_tokens: list[int] = []
        if final_reqs:
            idx = torch.tensor([i - 1 for i, f in zip(last_index, finals) if f], device=r.device)
            logits = r.target.compute_logits(hidden[idx])
            pos = torch.tensor([q.num_tokens for q in final_reqs], device=r.device)
            new_tokens = select_tokens(logits, self._sampling(final_reqs), pos).tolist()
        if self.worker is not None:
            new_of = dict(zip([q.request_id for q in final_reqs], new_tokens))
            nexts = [q.token_ids[s + 1:s + n + 1] + ([new_of[q.request_id]] if f else [])
                     for (q, s, n), f in zip(chunks, finals)]
            self.worker.prefill_extend(rows, starts, nexts, r.target_features(hidden, aux), finals)
        for q, s, n in chunks:
            q.committed = s + n
            q.draft_committed = q.committed
        for q, tok in zip(final_reqs, new_tokens):
            q.status = Status.DECODE
            self._append(q, [tok])
        return final_reqs

    def _decode_step(self, reqs: list[Request]) -> list[Request]:
        if self.worker is not None:
            return self._spec_step(reqs)
        r = self.runner
        for q in reqs:
            r.page_table.check_covers(q.row, q.committed + 1, f"decode of request {q.request_id}")
        pos = [q.committed for q in reqs]
        logits = r.decode_logits([q.row for q in reqs], pos, [q.token_ids[-1] for q in reqs])
        next_pos = torch.tensor(pos, device=r.device) + 1
        tokens = select_tokens(logits, self._sampling(reqs), next_pos).tolist()
        for q, t in zip(reqs, tokens):
            q.committed += 1
            self._append(q, [t])
        return reqs

    def _spec_step(self, reqs: list[Request]) -> list[Request]:
        res = self.worker.round(reqs, self._sampling(reqs, repeat=self.limits.num_draft_tokens))
        for q, a, toks in zip(reqs, res.accept_lens, res.new_tokens):
            q.committed += a + 1
            q.draft_committed = q.committed
            q.spec.add_round(a, self.limits.num_steps)
            self.spec_stats.add_round(a, self.limits.num_steps)
            self._append(q, toks)
        return reqs

    # --- stop conditions and outputs ------------------------------------------------------------------------------
    def _append(self, q: Request, tokens: list[int]) -> None:
        p = q.params
        eos = () if p.ignore_eos else self.eos_token_ids
        for t in tokens:
            q.output_ids.append(t)
            q.new_token_count += 1
            self.tokens_generated += 1
            reason = None
            if t in eos or t in p.stop_token_ids:
                reason = "stop"
            elif p.stop and self._hit_stop_string(q):
                reason = "stop"
            elif len(q.output_ids) >= p.max_tokens or q.num_tokens >= self.limits.context_length:
                reason = "length"
            if reason:
                self.scheduler.finish(q, reason)
                return

    def _hit_stop_string(self, q: Request) -> bool:
        text = self.decode(q.output_ids)
        cut = min((i for i in (text.find(s) for s in q.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        q.text = text[:cut]
        q.text_frozen = True
        return True

    def _output(self, q: Request) -> RequestOutput:
        n = q.new_token_count
        q.new_token_count = 0
        if not q.text_frozen:
            q.text = self.decode(q.output_ids)
        out = RequestOutput(
            request_id=q.request_id, prompt_token_ids=q.prompt_ids, token_ids=list(q.output_ids), text=q.text,
            new_token_ids=q.output_ids[len(q.output_ids) - n:] if n else [], finished=q.finished,
            finish_reason=q.finish_reason, spec_stats=q.spec.as_dict() if self.worker is not None else {},
        )
        if q.finished:
            self.requests.pop(q.request_id, None)
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    # --- introspection ----------------------------------------------------------------------------------------------
    def check_no_leaks(self) -> None:
        """Raise InvariantError unless every page is free or held by a running request (idle: all free)."""
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
                "spec": self.spec_stats.as_dict() if self.worker is not None else None,
            }
