"""The engine: requests in, tokens out, as a loop of plan -> launch -> resolve steps.

One step is one prefill chunk batch, one decode step (a speculative round with a draft) or, for plain decoding,
one mixed step: prompt chunks and every decoding request's next token in one forward (runtime/mixed_step.py).
`plan` picks the step's requests and reserves their pages (host only), `launch` queues the step's device work
through the decode strategy without reading anything back, and `resolve` waits for a launched step's event and
turns its result rows into tokens, stop checks and outputs. With overlap (the default), step i+1 is planned and
launched before step i is resolved, so the host's bookkeeping runs while the device computes. The device
carries each row's positions and last token from step to step (runtime/row_state.py); the host learns
accept lengths one step late and reserves pages for the worst case ahead (`Limits.lookahead`). A request
finished at resolve may still sit in the step in flight: its extra tokens are dropped and its pages are
released only once that step has completed. `disable_overlap_schedule` resolves each step right after
launching it; both orders produce the same tokens. A step that includes a request with structured output is
resolved right after its launch: the request's grammar state must know the step's tokens before the next step's
masks are built (runtime/grammar.py).

Thread-safe: `add_request`, `abort` and `step` take one lock, so a server thread may call them while another
thread drives `step()` in a loop.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import torch

from spruce.config import EngineConfig, describe_synthetic
from spruce.errors import InvalidRequestError
from spruce.memory.kv_pool import target_pool_bytes_per_token
from spruce.memory.prefix_cache import PrefixCache
from spruce.models.tokenizer import IncrementalDetokenizer, Tokenizer
from spruce.ops import compile_watch
from spruce.runtime.device import device_name
from spruce.runtime.grammar import GrammarBackend, GrammarBatch
from spruce.runtime.logprobs import LogprobPlan, PackReadback, decode_plan, make_entry, prefill_plan
from spruce.runtime.mixed_step import check_decode_positions, decode_positions, mixed_forward
from spruce.runtime.model_runner import ModelRunner
from spruce.runtime.output import RequestOutput
from spruce.runtime.request import Request, SpecStats, Status, prompt_token_ids
from spruce.runtime.sampler import SamplingTensors
from spruce.runtime.prefill_batching import PrefillBatching
from spruce.runtime.scheduler import Scheduler
from spruce.runtime.step_counters import StepCounters
from spruce.runtime.strategy import PrefillChunk, StrategyFactory
from spruce.sampling_params import SamplingParams

DEBUG_ENV = "SPRUCE_DEBUG"


@dataclass
class LaunchedStep:
    """A step queued on the device whose results the host has not read yet."""

    reqs: list[Request]  # every request the step touches (each holds one `inflight` count for it)
    result_reqs: list[Request]  # the request of each result row
    result: torch.Tensor  # [len(result_reqs), W]: W = Limits.plain_result_width for a plain step, at most
    # Limits.step_result_width; valid on the host once `done` has completed
    done: torch.cuda.Event | None  # None on the cpu (the result is already there)
    decode: bool  # a decode step
    speculated: bool = False  # a speculative round (its accept lengths count toward speculation statistics)
    logprobs: LogprobPlan | None = None  # what it scored (its pack is read back with `result`); None: nothing
    grammar: bool = False  # it includes a request with structured output (resolved at once, never left in flight)
    chosen: object | None = None  # a decode step: what `strategy.choose` returned for it (None: a prefill)
    prefill_results: int = 0  # a mixed step (`decode` True): its first result rows are final prompt chunks' (their
    # committed length was set at launch); the decode rows follow


def _shared(items: list) -> list:
    """The list itself (Engine.step(shared=True): valid until the next step)."""
    return items


class Engine:
    """One engine. With a tensor-parallel group `tp` this is one rank's replica: every rank runs the same
    deterministic engine on the same inputs (runtime/replicated_engine.py feeds them; DESIGN §18).

    `make_strategy` builds the decode strategy from what the runner loaded: the caller passes it in
    (speculative/registry.py's `make_strategy`: plain decoding, EAGLE rounds or adaptive speculation)."""

    def __init__(self, config: EngineConfig, tp=None, *, make_strategy: StrategyFactory):
        self.config = config
        self.debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        compile_watch.install()  # counts Triton's compilations (a server names those made while serving)
        self.runner = ModelRunner(config, tp)
        self.limits = self.runner.limits
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or config.model, self.runner.model_config)
        self.eos_token_ids = (self.tokenizer.eos_token_ids if self.tokenizer is not None
                              else self.runner.model_config.eos_token_ids)
        cache = None if config.disable_radix_cache else PrefixCache(self.limits.page_size, self.runner.allocator)
        self.scheduler = Scheduler(self.limits, self.runner.page_table, self.runner.allocator, cache,
                                   PrefillBatching(config.scheduler_delay_factor), self.runner.window_reach)
        spec = config.speculative
        self.strategy = make_strategy(self.runner, debug=self.debug, adaptive=spec is not None and spec.adaptive)
        self.speculative = self.strategy.speculative  # decode steps may be speculative rounds (a draft is loaded)
        self.scheduler.mixed_steps = config.mixed_steps and not self.speculative  # rounds alternate with prefills
        if self.runner.graphs.enabled:
            self.strategy.capture_graphs(config.show_progress)
        if self.runner.device.type == "cuda":  # compile the eager paths' kernels now, not while serving
            self.strategy.warm_eager()
        self.runner.capture_prefill_graphs(config.show_progress)  # after the warm-up: it runs the eager prefill
        self.strategy.measure_costs()
        self.requests: dict[str, Request] = {}
        self.spec_stats = SpecStats()
        self.tokens_generated = 0
        self.counters = StepCounters()
        self._arrival = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._lock = threading.RLock()
        self._aborted: list[Request] = []
        self._final_text: list[Request] = []  # finished this step; their whole text is built before the outputs
        self._inflight: LaunchedStep | None = None
        self._decode_read: float | None = None  # when the last resolved step's results were read, if a decode step
        self._result_buffers, self._result_events = self._make_result_buffers()
        self._next_buffer = 0
        self._result_views: dict[tuple[int, torch.Size], torch.Tensor] = {}  # (slot, shape) -> its view
        lim = self.limits  # a logprob pack holds a decode step's committed tokens or a prefill's prompt rows
        self._pack_readback = PackReadback(max(lim.max_running_requests * lim.step_advance,
                                               lim.max_running_requests + lim.chunked_prefill_size))
        self._greedy = SamplingTensors.greedy()
        self._stream = torch.cuda.current_stream(self.runner.device) if self._result_buffers else None
        self._sampling_cache: tuple = (None, None)
        self._grammar: GrammarBackend | None = None  # built by the first request with structured output

    @property
    def max_request_tokens(self) -> int:
        """Most tokens (prompt + output) one request can hold: the context length, or less where the KV cache
        is smaller (pages must also cover `Limits.lookahead` positions past the last token)."""
        lim = self.limits
        return min(lim.context_length, self.runner.allocator.capacity * lim.page_size - lim.lookahead)


    def _make_result_buffers(self) -> tuple[list[torch.Tensor], list[torch.cuda.Event]]:
        """Two page-locked host buffers for step results and their completion events (at most two launched
        steps are unread at once); none on the cpu, where results are on the host already."""
        if self.runner.device.type != "cuda":
            return [], []
        shape = (self.limits.max_running_requests, self.limits.step_result_width)
        return ([torch.zeros(shape, dtype=torch.int64, pin_memory=True) for _ in range(2)],
                [torch.cuda.Event() for _ in range(2)])

    def _result_view(self, slot: int, shape: torch.Size) -> torch.Tensor:
        """The head of result buffer `slot` as a tensor of `shape` (a plain step's result is narrower than a round's:
        Limits.step_result_width is the widest), made once per slot and shape: made at every launch, its four
        tensor calls would cost a measurable share of a short step's launch."""
        key = (slot, shape)
        view = self._result_views.get(key)
        if view is None:
            view = self._result_views[key] = self._result_buffers[slot].view(-1)[: shape.numel()].view(shape)
        return view

    # --- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises InvalidRequestError (engine state untouched) when malformed."""
        params = params or SamplingParams()
        ids = prompt_token_ids(prompt, self.tokenizer, self.runner.model_config.vocab_size)
        lim = self.limits
        if len(ids) >= lim.context_length:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context length is {lim.context_length}, which leaves no room "
                f"for output (prompt must be < {lim.context_length} tokens)", field="prompt", status=413)
        total = min(len(ids) + params.max_tokens, lim.context_length)
        vocab = self.runner.model_config.vocab_size
        outside = [t for t, _ in params.logit_bias if t >= vocab]
        if outside:
            raise InvalidRequestError(f"logit_bias names token ids {outside[:5]} outside the vocabulary [0, {vocab})",
                                      field="logit_bias")
        params.check_vocab(vocab)
        if total > self.max_request_tokens:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{lim.pages_for(total + lim.lookahead)} KV pages of {lim.page_size} tokens; the cache holds only "
                f"{self.runner.allocator.capacity} (at most {self.max_request_tokens} tokens per request)",
                field="max_tokens", status=413)
        grammar = self._request_grammar(params)  # compiled outside the lock: the engine steps on meanwhile
        with self._lock:
            rid = request_id or uuid.uuid4().hex
            if rid in self.requests:
                raise InvalidRequestError(f"request_id {rid!r} is already in use", field="request_id")
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            self._enqueue(rid, ids, params, seed, grammar)
        return rid

    def _enqueue(self, rid: str, ids: list[int], params: SamplingParams, seed: int, grammar=None) -> None:
        """Queue a validated request (the caller holds the lock). A tensor-parallel driver also records it for
        its workers, which queue it through here too (runtime/replicated_engine.py) and compile its grammar
        themselves (`grammar` None while the request asks for structured output)."""
        if grammar is None and params.structured_output is not None:
            grammar = self._request_grammar(params, timed=False)  # admitted by the driver: the same outcome
        req = Request(rid, ids, params, seed, next(self._arrival),
                      token_limit=min(len(ids) + params.max_tokens, self.limits.context_length),
                      stop_ids=frozenset(params.stop_token_ids).union(() if params.ignore_eos
                                                                      else self.eos_token_ids),
                      grammar=grammar,
                      bad_word_ids=params.bad_words_token_ids(self.tokenizer, self.runner.model_config.vocab_size))
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
        self.requests[rid] = req
        self.scheduler.add(req)

    def _request_grammar(self, params: SamplingParams, timed: bool = True):
        """The request's grammar state (runtime/grammar.py) when it asks for structured output, else None;
        InvalidRequestError naming the field when the constraint cannot be served, does not compile or fails at
        its first mask (runtime/grammar.py compiles it within its budget; `timed` False: without the wall-clock
        one, for a tensor-parallel worker, whose driver has admitted the request)."""
        spec = params.structured_output
        if spec is None:
            return None
        with self._lock:
            if self._grammar is None:
                if self.tokenizer is None:
                    raise InvalidRequestError(f"{spec.field} needs the model's tokenizer (tokenizer.json), which "
                                              f"this model does not ship", field=spec.field)
                self._grammar = GrammarBackend(self.tokenizer.to_json(), self.runner.model_config.vocab_size,
                                               self.eos_token_ids, spec.field)
        return self._grammar.request_grammar(spec, timed)

    def _grammar_batch(self, reqs: list[Request]) -> GrammarBatch | None:
        """The step's grammar rows (one per request), or None when no request has structured output."""
        if self._grammar is None or all(q.grammar is None for q in reqs):
            return None
        return GrammarBatch(self._grammar, [q.grammar for q in reqs])

    @property
    def grammar_stats(self) -> dict | None:
        """Tree nodes masked, how many were dead (their token refused by the grammar), host seconds spent on
        masks; None before the first request with structured output."""
        g = self._grammar
        return None if g is None else {"tree_nodes": g.tree_nodes, "dead_nodes": g.dead_nodes,
                                       "mask_seconds": g.mask_seconds}

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
    def step(self, finished_only: bool = False, shared: bool = False) -> list[RequestOutput]:
        """Plan and launch the next step, resolve the one before it (overlap) or this one; return the outputs
        of every request whose state changed (`finished_only`: of those that finished, as offline callers
        need: running requests' outputs and text are then not built).

        `shared`: a running request's output holds the request's own token id and logprob lists, not copies, valid
        until the next step, for a caller that consumes each step's outputs before it steps again (the engine
        process's delta encoder): a copy of every request's whole output at every step made the outputs' cost grow
        with the square of the output length."""
        with self._lock:
            counters = self.counters
            t0 = time.perf_counter()
            resolving = counters.seconds["wait"] + counters.seconds["resolve"]
            touched = self._take_aborted()
            previous, self._inflight = self._inflight, None
            launched, previous = self._plan_and_launch(previous, touched)
            t1 = time.perf_counter()  # a preemption may have resolved the step in flight: not launch time
            counters.add("launch", t1 - t0 - (counters.seconds["wait"] + counters.seconds["resolve"] - resolving))
            if previous is not None:
                self._resolve(previous, touched)
            if launched is not None:
                if self.limits.overlap and not launched.grammar:
                    self._inflight = launched
                else:
                    self._resolve(launched, touched)
            t2 = time.perf_counter()
            outputs = self._outputs(touched, finished_only, shared)
            counters.add("outputs", time.perf_counter() - t2)
            return outputs

    def step_and_stats(self, due: Callable[[bool], bool] | None = None,
                       shared: bool = False) -> tuple[list[RequestOutput], dict | None]:
        """`step(shared=shared)` and then `stats()` (None unless `due(busy)` says they are wanted, busy: requests are
        still unfinished; `due` None: always) within one hold of the engine lock: what a serving loop takes after
        every step. Taken apart, the stats waited behind the add_request calls queued on the lock during the step
        (1.8 ms a step at concurrency 64 on the H100, ~10% of the engine thread's time)."""
        with self._lock:
            outputs = self.step(shared=shared)
            if due is not None and not due(self.has_unfinished()):
                return outputs, None
            return outputs, self.stats()

    def drain(self) -> list[RequestOutput]:
        """Resolve the step in flight (if any) and flush aborts without launching anything; outputs as from
        `step`. Afterwards no launched step holds a row, so every finished request's pages are free."""
        with self._lock:
            touched = self._take_aborted()
            if self._inflight is not None:
                self._resolve(self._inflight, touched)
                self._inflight = None
            return self._outputs(touched, finished_only=False)

    def _take_aborted(self) -> dict[str, Request]:
        """The requests aborted since the last step, as the start of this step's touched set."""
        touched = {q.request_id: q for q in self._aborted}
        self._aborted = []
        return touched

    def _outputs(self, touched: dict[str, Request], finished_only: bool, shared: bool = False) -> list[RequestOutput]:
        """End of a step: release settled pages, build finished texts, then the touched requests' outputs."""
        self.scheduler.release_settled()
        if self.debug:
            self.scheduler.check_accounting()
        self._build_final_texts()
        return [self._output(q, shared) for q in touched.values() if q.finished or not finished_only]

    def _plan_and_launch(self, previous: LaunchedStep | None, touched: dict[str, Request]):
        """Plan the next step and launch it. Preemption needs the step in flight resolved first (its requests'
        pages must settle): then `previous` is resolved here and None is handed back in its place."""
        sched = self.scheduler
        sched.admit()
        planned = sched.next_step()
        if planned is None:
            return None, previous
        kind, reqs = planned
        if kind == "prefill":
            return self._launch_prefill(reqs), previous
        while True:
            if not reqs:
                return None, previous
            if sched.reserve_decode(reqs) is None:
                if kind == "mixed":
                    return self._launch_mixed(reqs, previous), previous
                return self._launch_decode(reqs), previous
            if previous is not None:  # pages may come back with the step in flight: resolve it first
                self._resolve(previous, touched)
                previous = None
                sched.release_settled()
            else:
                sched.preempt_youngest()
            reqs = sched.decode_requests()

    def _sampling(self, reqs: list[Request], repeat: int = 1) -> SamplingTensors:
        """The batch's sampling tensors: none for an all-greedy batch; else built once per batch composition."""
        if all(q.params.temperature == 0.0 and not q.params.has_logit_processors for q in reqs):
            return self._greedy
        key = (tuple(q.arrival for q in reqs), repeat)  # arrival numbers are never reused, unlike request ids
        if self._sampling_cache[0] != key:
            tensors = SamplingTensors.build([q.params for q in reqs], [q.seed for q in reqs],
                                            self.runner.model_config.vocab_size, self.runner.device, repeat,
                                            [len(q.prompt_ids) for q in reqs], [q.stop_ids for q in reqs],
                                            [q.bad_word_ids for q in reqs])
            self._sampling_cache = (key, tensors)
        return self._sampling_cache[1]

    def _launch_prefill(self, reqs: list[Request]) -> LaunchedStep:
        """One batch of prompt chunks (oldest first, up to chunked_prefill_size tokens)."""
        stepped, chunks = self._prefill_chunks(reqs, self.limits.chunked_prefill_size)
        finals = [q for q, c in zip(stepped, chunks) if c.final]
        logprobs = prefill_plan(stepped, chunks, finals)
        sampling = self._sampling(finals)
        self._start_histories(finals, sampling)
        launch_start = time.perf_counter()
        with self.runner.timer.phase("prefill"):
            result = self.strategy.prefill(chunks, sampling, logprobs, self._grammar_batch(finals))
        launch_s = time.perf_counter() - launch_start
        self.scheduler.batching.launched(launch_s, len(chunks))
        self._commit_histories(finals, result, sampling)
        self._chunks_launched(stepped, chunks)
        self.counters.launched(False, len(stepped), False, launch_s)
        return self._launched(stepped, finals, result, decode=False, logprobs=logprobs)

    def _prefill_chunks(self, reqs: list[Request], budget: int) -> tuple[list[Request], list[PrefillChunk]]:
        """The prompt chunks of one step, up to `budget` tokens (Scheduler.prefill_spans), and their requests;
        always-on: each chunk's pages cover it."""
        stepped: list[Request] = []
        chunks: list[PrefillChunk] = []
        for q, start, take in self.scheduler.prefill_spans(reqs, budget):
            self.runner.page_table.check_covers(q.row, start + take, f"prefill of request {q.request_id}")
            ids = q.token_ids
            final = start + take == q.num_tokens
            chunks.append(PrefillChunk(q.row, start, ids[start:start + take], ids[start + 1:start + take + 1], final))
            stepped.append(q)
        return stepped, chunks

    @staticmethod
    def _chunks_launched(stepped: list[Request], chunks: list[PrefillChunk]) -> None:
        """The host's record of launched prompt chunks: committed past each, decoding after a final one."""
        for q, c in zip(stepped, chunks):
            q.committed = c.start + len(c.tokens)
            if c.final:
                q.status = Status.DECODE

    def _launch_mixed(self, decode: list[Request], previous: LaunchedStep | None) -> LaunchedStep:
        """One mixed step (runtime/mixed_step.py): the decoding requests `decode`, whose pages cover `lookahead`
        positions ahead, and prompt chunks of the prefilling requests in the rest of the token budget (a plain
        decode step when none prefills any more: a preemption for `decode`'s pages took them). `previous`: the
        step in flight (its decode rows are one token ahead on the device)."""
        prefill = self.scheduler.prefill_requests()
        if not prefill:
            return self._launch_decode(decode)
        stepped, chunks = self._prefill_chunks(prefill, self.scheduler.mixed_prefill_budget(len(decode)))
        in_flight = previous.result_reqs[previous.prefill_results:] if previous is not None and previous.decode else ()
        positions = decode_positions(decode, in_flight)
        rows = [q.row for q in decode]
        self.runner.page_table.check_covers_rows(rows, [p + 1 for p in positions], "mixed step")
        if self.debug:
            check_decode_positions(self.runner, rows, positions)
        finals = [q for q, c in zip(stepped, chunks) if c.final]
        results = finals + decode  # result rows: the final chunks', then the decode rows'
        logprobs = prefill_plan(stepped, chunks, results)
        sampling = self._sampling(results)
        self._start_histories(finals, sampling)
        with self.runner.timer.phase("mixed"):
            result = mixed_forward(self.runner, chunks, rows, positions, sampling,
                                   lambda rows_t: self.strategy.history(sampling, rows_t), logprobs,
                                   self._grammar_batch(results))
        self._commit_histories(results, result, sampling)
        self._chunks_launched(stepped, chunks)
        self.counters.launched(True, len(decode), False, mixed=True)
        launched = self._launched(stepped + decode, results, result, decode=True, logprobs=logprobs)
        launched.prefill_results = len(finals)
        launched.chosen = self.strategy
        return launched

    def _launch_decode(self, reqs: list[Request]) -> LaunchedStep:
        """One decode step (speculative round) for `reqs`, whose pages cover `lookahead` positions ahead."""
        advance = self.limits.step_advance
        rows = [q.row for q in reqs]
        # the positions the step may write, after those in flight (a draft LM's KV also holds the next root)
        ends = [q.committed + (q.inflight + 1) * advance + self.limits.draft_ahead for q in reqs]
        # always-on: the pages cover every position the step, after those in flight, may write
        self.runner.page_table.check_covers_rows(rows, ends, "decode step")
        strategy = self.strategy.choose(reqs)  # adaptive speculation: a round or a plain step
        spec = strategy.speculative
        logprobs = decode_plan(reqs, self.limits.step_advance if spec else 1)
        sampling = self._sampling(reqs, strategy.tree_width)  # one row per tree node
        # planning data for library attention kernels: the committed length the host knows (a lower bound of
        # the device's under overlap) and whose pages are final (DESIGN §13)
        self.runner.set_known_prefix(rows, [q.committed for q in reqs])
        try:
            result = strategy.decode(rows, max(ends), sampling, logprobs, self._grammar_batch(reqs))
        finally:
            self.runner.set_known_prefix(None, None)
        self._commit_histories(reqs, result, sampling)
        launched = self._launched(reqs, reqs, result, decode=True, logprobs=logprobs, speculated=spec)
        launched.chosen = strategy
        self.counters.launched(True, len(reqs), spec)
        return launched

    def _start_histories(self, finals: list[Request], sampling: SamplingTensors) -> None:
        """Requests whose prompt completes: set their rows' device history from the output kept through a
        preemption (normally none): with penalties, prompt masks and output counts (runtime/penalties.py); with
        bad words, output tails (runtime/token_restrictions.py). Nothing when the batch has neither."""
        if sampling.penalties is not None:
            started = [q for q in finals if q.params.has_penalties]
            self.runner.penalties.start([q.row for q in started], [q.prompt_ids for q in started],
                                        [q.output_ids for q in started])
        if sampling.bad_words is not None:
            started = [q for q in finals if q.bad_word_ids]
            self.runner.output_tails.start([q.row for q in started], [q.output_ids for q in started])

    def _commit_histories(self, reqs: list[Request], result: torch.Tensor, sampling: SamplingTensors) -> None:
        """Add a launched step's committed tokens (result rows, still on the device) to the device history of
        its requests with penalties or bad words: the next step sees them with no host sync."""
        if sampling.penalties is not None:
            idx = [i for i, q in enumerate(reqs) if q.params.has_penalties]
            self.runner.penalties.commit([reqs[i].row for i in idx], idx, result)
        if sampling.bad_words is not None:
            idx = [i for i, q in enumerate(reqs) if q.bad_word_ids]
            self.runner.output_tails.commit([reqs[i].row for i in idx], idx, result)

    def _launched(self, reqs: list[Request], result_reqs: list[Request], result: torch.Tensor,
                  decode: bool, logprobs: LogprobPlan | None = None, speculated: bool = False) -> LaunchedStep:
        """Record a queued step: start the copy of its result (and logprob pack) to the host and mark its
        requests in flight."""
        for q in reqs:
            q.inflight += 1
        done = None
        if self._result_buffers:
            slot = self._next_buffer
            host = self._result_view(slot, result.shape)
            done = self._result_events[slot]
            self._next_buffer = 1 - slot
            host.copy_(result, non_blocking=True)
            if logprobs is not None:  # read back under the same event: no extra sync
                logprobs.host = self._pack_readback.copy(slot, logprobs.pack)
            done.record(self._stream)
            result = host
        else:  # the result may be a view of a static buffer that the next step overwrites
            result = result.clone()
            if logprobs is not None:
                logprobs.host = logprobs.pack
        return LaunchedStep(reqs, result_reqs, result, done, decode, speculated, logprobs,
                            grammar=any(q.grammar is not None for q in reqs))

    def _resolve(self, step: LaunchedStep, touched: dict[str, Request]) -> None:
        """Wait for a launched step and apply its tokens (dropped for requests finished meanwhile)."""
        with self.runner.timer.phase("sync"):
            t0 = time.perf_counter()
            if step.done is not None:
                step.done.synchronize()
            t_read = time.perf_counter()
            waited = t_read - t0
            rows = step.result.tolist()
            packed = step.logprobs.host.tolist() if step.logprobs is not None else None
        for q in step.reqs:
            q.inflight -= 1
        slots = {}
        if packed is not None:
            slots = step.logprobs.row_slots()
            self._add_prompt_logprobs(step.logprobs, packed)
        for i, (q, row) in enumerate(zip(step.result_reqs, rows)):
            if q.finished:
                continue
            accepted = row[0]
            if step.decode and i >= step.prefill_results:  # a decode row (a final chunk's committed at launch)
                q.committed += accepted + 1
                if step.speculated:
                    q.spec.add_round(accepted, self.limits.num_steps)
                    self.spec_stats.add_round(accepted, self.limits.num_steps)
            lps = packed[slots[i]:slots[i] + accepted + 1] if i in slots else None
            tokens = row[1:accepted + 2]
            if q.grammar is not None:  # its grammar consumes the tokens, up to the one that completes it
                tokens = tokens[:q.grammar.advance(tokens)]
            self._append(q, tokens, lps)
            if q.grammar is not None and not q.finished and (q.grammar.error is not None or q.grammar.stopped):
                self._final_text.append(q)  # the grammar failed (RequestGrammar.error says how), or is complete
                self.scheduler.finish(q, "error" if q.grammar.error is not None else "stop")
            touched[q.request_id] = q
        if step.decode:
            first = step.prefill_results  # a mixed step's decode rows follow its final chunks'
            # the step's served seconds: since the previous step's results, when that one was a decode step too
            # (under overlap the device ran this step meanwhile; a prefill or an idle engine breaks the chain)
            seconds = t_read - self._decode_read if self._decode_read is not None and not first else None
            self.strategy.on_round(step.chosen, step.result_reqs[first:] if first else step.result_reqs,
                                   rows[first:] if first else rows, seconds)
        self._decode_read = t_read if step.decode else None
        self.counters.add("wait", waited)
        self.counters.add("resolve", time.perf_counter() - t_read)

    # --- logprobs (runtime/logprobs.py) -----------------------------------------------------------------------------
    def _token_text(self, token_id: int) -> str | None:
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else None

    def _add_prompt_logprobs(self, plan: LogprobPlan, packed: list[list[float]]) -> None:
        """Fill the prompt logprobs a prefill step scored: positions [first, first + count) of each span."""
        at = len(plan.rows) * plan.width
        for q, first, count in plan.prompt_spans:
            if not q.finished:
                n, ids = q.params.prompt_logprobs, q.prompt_ids
                for t in range(count):
                    q.prompt_logprobs[first + t] = make_entry(packed[at + t], ids[first + t], n, self._token_text)
            at += count

    def _add_logprobs(self, q: Request, tokens: list[int], lps: list[list[float]]) -> None:
        """The logprob entries of tokens just appended to the output (one pack row each)."""
        n = q.params.logprobs
        q.logprobs.extend(make_entry(row, t, n, self._token_text) for t, row in zip(tokens, lps))

    # --- stop conditions and outputs ------------------------------------------------------------------------------
    def _append(self, q: Request, tokens: list[int], lps: list[list[float]] | None = None) -> None:
        """Append tokens until a stop condition; the rest are dropped (with their logprob pack rows `lps`, one
        per token, when the request wants logprobs). Text is built per token only for requests with stop
        strings; the others' text catches up when an output is made."""
        if q.params.stop:
            for i, t in enumerate(tokens):
                if self._append_tokens(q, [t], None if lps is None else lps[i:i + 1]):
                    return
                added = self._sync_text(q)
                if added and self._cut_at_stop_string(q, added):
                    self.scheduler.finish(q, "stop")  # the text ends before the stop string: nothing to flush
                    return
        else:
            self._append_tokens(q, tokens, lps)

    def _append_tokens(self, q: Request, tokens: list[int], lps: list[list[float]] | None = None) -> bool:
        """Append tokens up to the first stop token or the length limit (finishing the request), and their
        logprobs; True if it finished."""
        room = q.token_limit - len(q.prompt_ids) - len(q.output_ids)  # tokens before "length"
        if len(tokens) == 1 and room > 1 and tokens[0] not in q.stop_ids:  # the common case, kept cheap
            q.output_ids.append(tokens[0])
            if lps is not None:
                self._add_logprobs(q, tokens, lps)
            q.new_token_count += 1
            self.tokens_generated += 1
            return False
        stop_at = next((i for i, t in enumerate(tokens) if t in q.stop_ids), None)
        take = min(len(tokens), room) if stop_at is None else min(stop_at + 1, room)
        q.output_ids.extend(tokens[:take])
        if lps is not None:
            self._add_logprobs(q, tokens[:take], lps)
        q.new_token_count += take
        self.tokens_generated += take
        if take == room or stop_at is not None:
            self._final_text.append(q)
            self.scheduler.finish(q, "stop" if stop_at is not None and stop_at < room else "length")
            return True
        return False

    def _build_final_texts(self) -> None:
        """Whole text of the requests that finished in this step. Those whose text was never started are
        decoded in one batch call (the same text as the incremental detokenizer's, by its contract); the others
        catch up and flush."""
        if not self._final_text:
            return
        fresh, started = [], []
        for q in self._final_text:
            (fresh if q.detokenizer is not None and q.detokenized == 0 else started).append(q)
        for q, text in zip(fresh, self.tokenizer.decode_batch([q.output_ids for q in fresh]) if fresh else ()):
            q.text = text
            q.detokenized = len(q.output_ids)
        for q in started:  # text begun incrementally (stop strings, streaming): catch up and flush
            self._sync_text(q, flush=True)
        self._final_text = []

    def _sync_text(self, q: Request, flush: bool = False) -> int:
        """Feed the detokenizer the tokens it has not seen (and, flushing, what it holds back); returns how
        many characters the text grew by."""
        if q.detokenizer is None:
            return 0
        before = len(q.text)
        if q.detokenized < len(q.output_ids):
            q.text += q.detokenizer.add(q.output_ids[q.detokenized:])
            q.detokenized = len(q.output_ids)
        if flush:
            q.text += q.detokenizer.flush()
        return len(q.text) - before

    def _cut_at_stop_string(self, q: Request, added: int) -> bool:
        """Search the text that `added` new characters could complete a stop string in; cut before the first."""
        longest = max(len(s) for s in q.params.stop)
        start = max(0, len(q.text) - added - longest + 1)
        cut = min((i for i in (q.text.find(s, start) for s in q.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        q.text = q.text[:cut]
        return True

    def _output(self, q: Request, shared: bool = False) -> RequestOutput:
        """The request's output now: its lists copied, or (`shared`, see `step`) its own."""
        n = q.new_token_count
        q.new_token_count = 0
        if not q.finished or q.finish_reason == "abort":
            self._sync_text(q, flush=q.finished)
        copy = _shared if shared else list
        out = RequestOutput(
            request_id=q.request_id, prompt_token_ids=q.prompt_ids, token_ids=copy(q.output_ids), text=q.text,
            new_token_ids=q.output_ids[len(q.output_ids) - n:] if n else [], finished=q.finished,
            finish_reason=q.finish_reason, spec_stats=(q.spec.built or q.spec.as_dict()) if self.speculative else {},
            logprobs=None if q.logprobs is None else copy(q.logprobs),
            prompt_logprobs=None if q.prompt_logprobs is None else copy(q.prompt_logprobs),
            num_cached_tokens=q.cached_tokens,
            error=q.grammar.error if q.grammar is not None and q.finish_reason == "error" else None,
        )
        if q.finished:
            self.requests.pop(q.request_id, None)
        return out

    # --- scoring --------------------------------------------------------------------------------------------------
    def next_token_logits(self, token_ids: list[int], first: int = 0) -> torch.Tensor:
        """Teacher-forced float32 logits [len(token_ids) - first, V]: row i is what the target computes after
        token_ids[:first + i + 1] (its prediction of the token that follows).

        The sequence is prefilled in chunks through the engine's own EXTEND path into a page-table row and
        pages taken for this call and given back before it returns; raises InvalidRequestError when the
        engine has no free row or too few free pages (score on an idle engine)."""
        lim, runner = self.limits, self.runner
        with self._lock:
            row = runner.page_table.alloc_row()
            if row is None:
                raise InvalidRequestError("no free request row to score a sequence: wait for the engine to idle")
            pages = self.scheduler.alloc_pages(lim.pages_for(len(token_ids)))  # may evict cached pages
            if pages is None:
                runner.page_table.release_row(row)
                raise InvalidRequestError(f"no room for {len(token_ids)} positions in the KV cache", status=413)
            runner.page_table.append_pages(row, pages)
            hidden = []  # per chunk: [n, H] from index `first` on
            try:
                with torch.no_grad():
                    for start in range(0, len(token_ids), lim.chunked_prefill_size):
                        chunk = token_ids[start:start + lim.chunked_prefill_size]
                        h, _ = runner.prefill_forward([row], [start], [chunk], aux=False)  # [n, H]
                        hidden.append(h[max(first - start, 0):].clone())
                    return runner.target.compute_logits(torch.cat(hidden)).float()  # [len - first, V]
            finally:
                runner.allocator.free(runner.page_table.release_row(row))

    def shutdown(self) -> None:
        """Stop what the engine started: nothing for one process (a tensor-parallel driver stops its workers)."""

    # --- introspection ----------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.runner.model_config.vocab_size

    @property
    def phase_timer(self):
        """Per-phase timing (runtime/timer.py), off until a benchmark enables it."""
        return self.runner.timer

    def reset_stats(self) -> None:
        """Zero the speculation statistics (benchmarks measure one run at a time)."""
        with self._lock:
            self.spec_stats = SpecStats()

    def model_shape(self) -> dict[str, int]:
        mc = self.runner.model_config
        return {"layers": mc.num_layers, "hidden": mc.hidden_size, "vocab": mc.vocab_size}

    def weight_bytes(self) -> int:
        """Bytes of the target model's weights (all of them, every expert included; tensor-parallel: this
        rank's slices)."""
        return sum(p.numel() * p.element_size() for p in self.runner.target.parameters())

    def decode_read_bytes(self, batch_size: int, context_len: int) -> float:
        """Bytes a plain decode step of `batch_size` requests at `context_len` cached tokens each must read at
        least once: the weights it touches (routed experts by their expected share) plus the cached KV
        (tensor-parallel: what one rank reads, its slices and its KV heads)."""
        kv = target_pool_bytes_per_token(self.runner.target_pool_config, self.runner.kv_dtype) * batch_size * context_len
        return self.runner.target.weight_bytes_read(batch_size) + kv

    def check_no_leaks(self) -> None:
        """Raise InvariantError unless every page is free or held by a running or retiring request."""
        with self._lock:
            self.scheduler.check_accounting()

    def info(self) -> dict[str, str]:
        """What this engine serves and how: device, model, dtype, attention backend, speculation, graphs."""
        cfg, lim, spec = self.config, self.limits, self.config.speculative
        return {
            "device": device_name(str(self.runner.device)), "model": str(cfg.model), "dtype": cfg.dtype,
            "attention_backend": self.runner.backend.describe(), "page_size": str(lim.page_size),
            "weights": getattr(self.runner.target, "weight_format", cfg.dtype),
            "kv_cache_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "speculative": (f"{spec.algorithm} S={spec.num_steps} K={spec.eagle_topk} N={spec.num_draft_tokens}"
                            + (" adaptive" if spec.adaptive else "")
                            + (f" widths={','.join(map(str, spec.tree_widths))}" if spec.adaptive_widths else "")
                            if spec is not None else "off"),
            "synthetic_acceptance": describe_synthetic(spec.synthetic_acceptance_rates if spec is not None else None),
            "overlap_schedule": "on" if lim.overlap else "off",
            "mixed_steps": "on" if self.scheduler.mixed_steps else "off",
            "cuda_graph_buckets": ",".join(map(str, lim.graph_buckets)) if self.runner.graphs.enabled else "off",
            "prefill_graph_tokens": (",".join(map(str, lim.prefill_graph_tokens)) if self.runner.prefill_graphs.enabled
                                     else "off"),
            "cuda_graphs_captured": str(self.runner.graphs.count + self.runner.prefill_graphs.count),
        }

    def _prefix_cache_stats(self) -> dict | None:
        cache = self.scheduler.prefix_cache
        if cache is None:
            return None
        return {"cached_pages": cache.num_pages, "hit_tokens": cache.hit_tokens,
                "queried_tokens": cache.queried_tokens, "hit_rate": round(cache.hit_rate, 4)}

    def flush_cache(self) -> int:
        """Drop every prefix-cache page no running request holds (SGLang's /flush_cache); returns how many."""
        with self._lock:
            return self.scheduler.flush_cache()

    def stats(self) -> dict:
        with self._lock:
            alloc = self.runner.allocator
            return {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                # the work held (SGLang's load): the running requests' tokens so far and the waiting prompts
                "request_tokens": (sum(r.num_tokens for r in self.scheduler.running)
                                   + sum(len(r.prompt_ids) for r in self.scheduler.waiting)),
                "kv_pages_used": alloc.num_used,
                "kv_pages_free": alloc.num_free,
                "kv_pages_total": alloc.capacity,
                "tokens_generated": self.tokens_generated,
                "preemptions": self.scheduler.num_preemptions,
                "prefill_holds": self.scheduler.batching.held,
                "steps": self.counters.as_dict(),
                "prefix_cache": self._prefix_cache_stats(),
                "spec": self.spec_stats.as_dict() if self.speculative else None,
                "adaptive": self.strategy.stats(),
                "triton_compiles": compile_watch.compiles(),
            }
