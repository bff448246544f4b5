"""Server metrics in the Prometheus text exposition format: spruce's own series (spruce_*), then vLLM's names for
the common ones (vllm:*, through prometheus_client: server/vllm_metrics.py).

Engine-side figures (running/waiting requests, KV pages, generated tokens, speculation) come from a snapshot
of `Engine.stats()` the serving loop takes after a step (`StatsCadence`: at most every STATS_INTERVAL_S while
requests run, and after the step that leaves the engine idle), so a scrape never waits on the engine lock. The
engine process sends the stats of a step that leaves the engine idle after that step's outputs; readers wait for
them (up to STATS_WAIT_S), so a scrape after the requests end still sees them whole. Latency histograms are fed as
outputs are dispatched.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from spruce.server.vllm_metrics import VllmMetrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
RATE_WINDOW_S = 10.0
STATS_INTERVAL_S = 0.05  # while requests run, the engine's stats are taken at most this often (StatsCadence)
STATS_WAIT_S = 1.0  # how long a reader waits for stats that follow the outputs it may have seen (expect_stats)


class StatsCadence:
    """Whether the serving loop takes `Engine.stats()` after a step: always once the engine is idle (a scrape after
    the requests end sees them whole; the engine process takes them after that step's outputs are sent), else at
    most every `interval` seconds: building, pickling and unpickling them after every step costs host time that
    a short step cannot spare."""

    def __init__(self, interval: float = STATS_INTERVAL_S, clock=time.monotonic):
        self.interval = interval
        self.clock = clock
        self._next = -math.inf

    def due(self, busy: bool) -> bool:
        now = self.clock()
        if busy and now < self._next:
            return False
        self._next = now + self.interval
        return True

    def with_step(self, busy: bool) -> bool:
        """Whether a step's stats go with its outputs (Engine.step_and_stats's `due`): while requests run, when
        `due`; not for a step that leaves the engine idle, whose stats the serving loop takes after its outputs are
        out (announced: Metrics.expect_stats), calling `due(False)` then so that the interval counts from them."""
        return busy and self.due(True)


class Histogram:
    """A cumulative histogram: bucket upper bounds, a sum and a count."""

    def __init__(self, name: str, help: str, buckets):
        self.name, self.help = name, help
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for bound, c in zip(self.buckets, self.counts):
            acc += c
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {acc}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


@dataclass
class RequestClock:
    """Per-request timing and speculation counters the metrics need between outputs."""

    arrival: float
    last_token: float | None = None  # when its last token came (None: none yet)
    spec_rounds: int = 0
    spec_committed: int = 0
    spec_seen: dict | None = None  # the last speculation statistics read (the same object until its next round)


class Metrics:
    """Everything /metrics reports. Thread-safe: the engine thread writes, the event loop renders."""

    def __init__(self, num_spec_steps: int = 0, info: dict[str, str] | None = None):
        self.num_spec_steps = num_spec_steps
        self.model_name = (info or {}).get("model", "")  # model_name label of the vllm:* aliases (create_app sets it)
        self.info = dict(info or {})  # constant labels of spruce_server_info (device, model, speculation, ...)
        self._lock = threading.Lock()
        self.ttft = Histogram("spruce_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.", LATENCY_BUCKETS)
        self.itl = Histogram("spruce_inter_token_latency_seconds",
                             "Time between tokens of a request (a round committing k tokens counts k gaps of dt/k).",
                             LATENCY_BUCKETS)
        self.e2e = Histogram("spruce_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             E2E_BUCKETS)
        bounds = [k + 0.5 for k in range(1, num_spec_steps + 1)] or [1.5]
        self.accept = Histogram("spruce_spec_accept_length",
                                "Tokens committed per verify round (accepted drafts + bonus).", bounds)
        self.finished: dict[str, int] = {}
        self.errors: dict[int, int] = {}
        self.stats: dict = {}
        self._samples: deque[tuple[float, int]] = deque()
        self._stats_current = threading.Event()  # clear while stats announced by `expect_stats` are on their way
        self._stats_current.set()
        self.prompt_tokens = 0  # prompt tokens of the requests that produced a token
        self.vllm = VllmMetrics(self)

    # --- writers (engine thread / handlers) ---------------------------------------------------------------
    def on_output(self, clock: RequestClock, new_tokens: int, spec: dict, finished: str | None, now: float,
                  prompt_tokens: int = 0) -> None:
        """Record one output of a request: TTFT (and its `prompt_tokens`) or inter-token gaps, accept lengths, and
        its end."""
        with self._lock:
            if new_tokens:
                if clock.last_token is None:
                    self.ttft.observe(now - clock.arrival)
                    self.vllm.observe_ttft(now - clock.arrival)
                    self.prompt_tokens += prompt_tokens
                    if new_tokens > 1:
                        self.itl.observe(0.0, new_tokens - 1)
                        self.vllm.observe_itl(0.0, new_tokens - 1)
                else:
                    self.itl.observe((now - clock.last_token) / new_tokens, new_tokens)
                    self.vllm.observe_itl((now - clock.last_token) / new_tokens, new_tokens)
                clock.last_token = now
            if spec and spec is not clock.spec_seen:  # (an adaptive engine's plain steps repeat the last one:
                clock.spec_seen = spec  # Request.spec.as_dict is built once a round, and so is its IPC copy)
                rounds = spec.get("rounds", 0) - clock.spec_rounds
                committed = spec.get("committed_tokens", 0) - clock.spec_committed
                if rounds > 0:
                    self.accept.observe(committed / rounds, rounds)
                clock.spec_rounds += rounds
                clock.spec_committed += committed
            if finished:
                self.e2e.observe(now - clock.arrival)
                self.vllm.observe_e2e(now - clock.arrival)
                self.finished[finished] = self.finished.get(finished, 0) + 1

    def on_finished(self, reason: str) -> None:
        """Count the end of a request nobody listens to any more (aborted or failed)."""
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def on_error(self, status: int) -> None:
        with self._lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def on_engine_stats(self, stats: dict, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.stats = stats
            self._samples.append((now, stats.get("tokens_generated", 0)))
            while len(self._samples) > 2 and now - self._samples[1][0] > RATE_WINDOW_S:
                self._samples.popleft()
        self._stats_current.set()

    def expect_stats(self, expected: bool = True) -> None:
        """The engine's stats after the outputs about to be dispatched follow them (the engine process sends a step
        that leaves the engine idle before its stats): until they come (`on_engine_stats`), readers wait, up to
        STATS_WAIT_S. False: none will come (the engine failed); readers stop waiting."""
        if expected:
            self._stats_current.clear()
        else:
            self._stats_current.set()

    # --- readers --------------------------------------------------------------------------------------------
    def tokens_per_second(self, now: float | None = None) -> float:
        """Generation throughput over the last ~10 s (0 when idle that long)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if len(self._samples) < 2:
                return 0.0
            (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        if now - t1 >= RATE_WINDOW_S:
            return 0.0
        return (n1 - n0) / max(now - max(t0, now - RATE_WINDOW_S), 1e-9)

    def snapshot(self) -> dict:
        """The latest engine stats (taken by the engine thread after its last step) and the generation
        throughput: what /server_info reports, read without waiting on the engine lock."""
        self._stats_current.wait(STATS_WAIT_S)
        tps = self.tokens_per_second()
        with self._lock:
            return {**self.stats, "tokens_per_second": tps}

    def spec_counters(self) -> "SpecCounters":
        """The speculation counts of the latest stats snapshot (which has them: speculation is on)."""
        return spec_counters(self.stats["spec"], self.num_spec_steps)

    def _render_spec_counters(self, out: list[str], c: "SpecCounters") -> None:
        """The speculation counters under spruce's names (vLLM's, with the very same values: vllm_metrics)."""
        counter = _emit(out, "counter")
        per_pos = {("position", str(i)): v for i, v in enumerate(c.accepted_per_pos)}
        counter("spruce_spec_verify_rounds_total", "Speculative verify rounds (one per request per decode step).",
                c.rounds)
        counter("spruce_spec_draft_tokens_total",
                f"Draft tokens proposed, counted as num_steps (S={self.num_spec_steps}, the tree depth) per verify "
                f"round: the most a round can accept (the tree holds more candidates than that).", c.draft_tokens)
        counter("spruce_spec_accepted_tokens_total", "Draft tokens accepted (the bonus token of each round "
                "excluded).", c.accepted)
        counter("spruce_spec_accepted_tokens_per_pos_total", "Verify rounds that accepted the draft token at "
                "0-based position i (tree depth i+1).", per_pos)

    def render(self) -> str:
        self._stats_current.wait(STATS_WAIT_S)
        tps = self.tokens_per_second()
        with self._lock:
            s = dict(self.stats)
            out: list[str] = []
            gauge = _emit(out, "gauge")
            counter = _emit(out, "counter")
            if self.info:
                labels = ",".join(f'{k}="{_label(v)}"' for k, v in self.info.items())
                out += ["# HELP spruce_server_info What this server serves and how (labels; value 1).",
                        "# TYPE spruce_server_info gauge", f"spruce_server_info{{{labels}}} 1"]
            gauge("spruce_requests_running", "Requests in the running batch.", s.get("running", 0))
            gauge("spruce_requests_waiting", "Requests queued for admission.", s.get("waiting", 0))
            gauge("spruce_kv_pages_used", "KV cache pages in use.", s.get("kv_pages_used", 0))
            gauge("spruce_kv_pages_free", "KV cache pages free.", s.get("kv_pages_free", 0))
            gauge("spruce_kv_pages_total", "KV cache pages in all.", s.get("kv_pages_total", 0))
            counter("spruce_generation_tokens_total", "Tokens generated.", s.get("tokens_generated", 0))
            counter("spruce_prefill_holds_total", "Admission rounds that held arrivals back for a shared prefill "
                    "(--scheduler-delay-factor).", s.get("prefill_holds", 0))
            gauge("spruce_generation_tokens_per_second", "Tokens generated per second (10 s window).", tps)
            steps = s.get("steps")
            if steps is not None:
                counter("spruce_engine_steps_total", "Engine launches by kind (prefill: a batch of prompt chunks; "
                        "decode: a plain step or a speculative round; round: the decode launches that were "
                        "speculative rounds; mixed: the decode launches that ran prompt chunks too).",
                        {("kind", "prefill"): steps["prefills"], ("kind", "decode"): steps["decodes"],
                         ("kind", "round"): steps["rounds"], ("kind", "mixed"): steps["mixed"]})
                counter("spruce_engine_decode_rows_total", "Requests over all decode launches (their mean batch: "
                        "this over the decode launches).", steps["decode_rows"])
                counter("spruce_engine_prefill_launch_seconds_total", "Wall seconds of the prefill launches (within "
                        "the launch part; their mean is what --scheduler-delay-factor holds arrivals back by).",
                        steps["prefill_launch"])
                counter("spruce_engine_step_seconds_total", "Wall seconds of the engine's steps by part (launch: "
                        "planning and launching; wait: blocked on the device; resolve: applying results; "
                        "outputs: building the outputs).", {("part", k): v for k, v in steps["seconds"].items()})
            process = s.get("process_seconds")
            if process is not None:
                counter("spruce_engine_process_seconds_total", "Wall seconds of the engine process's loop by part "
                        "(idle: nothing to run; messages: applying the server's; step: Engine.step; encode and "
                        "send: the step's outputs to the server).", {("part", k): v for k, v in process.items()})
            if s.get("process_cpu_seconds") is not None:
                counter("spruce_engine_process_cpu_seconds_total", "CPU seconds of the engine process, all its "
                        "threads (against its busy wall seconds: below them, it waited for a CPU).",
                        s["process_cpu_seconds"])
            counter("spruce_server_process_cpu_seconds_total", "CPU seconds of this (HTTP) server process, all its "
                    "threads (with the engine in this process, its too).", time.process_time())
            counter("spruce_requests_finished_total", "Finished engine requests by finish reason.",
                    {("finish_reason", k): v for k, v in sorted(self.finished.items())})
            counter("spruce_request_errors_total", "Requests answered with an error, by HTTP status.",
                    {("status", str(k)): v for k, v in sorted(self.errors.items())})
            counter("spruce_triton_compiles_total", "Triton kernel compilations, during start-up and while serving "
                    "(each one made while serving stalled a step: ops/compile_watch.py).",
                    {("phase", k): v for k, v in sorted(s.get("triton_compiles", {}).items())})
            cache = s.get("prefix_cache")
            if cache is not None:
                gauge("spruce_prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / prompt tokens "
                      "looked up, since start.", cache.get("hit_rate", 0.0))
                counter("spruce_prefix_cache_hit_tokens_total", "Prompt tokens served by the prefix cache.",
                        cache.get("hit_tokens", 0))
                counter("spruce_prefix_cache_queried_tokens_total", "Prompt tokens looked up in the prefix cache.",
                        cache.get("queried_tokens", 0))
                gauge("spruce_prefix_cache_pages", "KV pages held by the prefix cache.", cache.get("cached_pages", 0))
            spec = s.get("spec")
            if spec is not None:
                rounds, committed = spec.get("rounds", 0), spec.get("committed_tokens", 0)
                rate = (committed - rounds) / (rounds * self.num_spec_steps) if rounds and self.num_spec_steps else 0
                gauge("spruce_spec_accept_rate", "Accepted draft tokens / drafted depth (num_steps) per round.",
                      rate)
                gauge("spruce_spec_mean_accept_length", "Mean tokens committed per verify round.",
                      spec.get("mean_accept_length", 0.0))
                gauge("spruce_spec_accept_rate_per_depth", "Fraction of rounds that accepted depth d.",
                      {("depth", str(d + 1)): r for d, r in enumerate(spec.get("accept_rate_per_depth", []))})
                out += self.accept.render()
                self._render_spec_counters(out, spec_counters(spec, self.num_spec_steps))
            if s.get("adaptive") is not None:
                _render_adaptive(out, s["adaptive"])
            for h in (self.ttft, self.itl, self.e2e):
                out += h.render()
            vllm = self.vllm.render()
        return "\n".join(out) + "\n" + vllm


def _render_adaptive(out: list[str], a: dict) -> None:
    """Adaptive speculation (speculative/adaptive.py): per batch-size bucket the current candidate (0: a plain step,
    else a verify width), the acceptance EMA per width, the start-up step costs, steps per candidate, probes and
    collapsed requests."""
    def series(name: str, kind: str, help: str, rows: list[tuple[str, float]]) -> None:
        if not rows:  # no sample yet: left out (see _emit)
            return
        out.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
        out.extend(f"{name}{{{labels}}} {_num(v)}" if labels else f"{name} {_num(v)}" for labels, v in rows)

    series("spruce_adaptive_choice", "gauge", "Current candidate per batch-size bucket (0: plain, else the verify "
           "width) once the bucket left the configured N.", [(f'bucket="{b}"', c) for b, c in a["choice"].items()])
    series("spruce_adaptive_accept_ema", "gauge", "Drafts a round accepts per request at each verify width (EMA).",
           [(f'width="{w}"', v) for w, v in a["accept_ema"].items()])
    series("spruce_adaptive_step_seconds", "gauge", "Seconds per step of each candidate at each bucket, measured at "
           "start-up.", [(f'candidate="{k.split("@")[0]}",bucket="{k.split("@")[1]}"', v)
                         for k, v in a["step_seconds"].items()])
    chosen = a["chosen"]
    series("spruce_adaptive_steps_total", "counter", "Decode steps per choice: plain (with or without draft work) "
           "or speculative (a round at any verify width).",
           [('choice="plain"', chosen.get(0, 0) + a["collapsed_steps"]),
            ('choice="speculative"', sum(n for c, n in chosen.items() if c))])
    series("spruce_adaptive_width_rounds_total", "counter", "Rounds run at each verify width.",
           [(f'width="{c}"', n) for c, n in sorted(chosen.items()) if c])
    series("spruce_adaptive_collapsed_steps_total", "counter", "Plain steps without draft work: batches whose every "
           "request collapsed (counted in spruce_adaptive_steps_total too).", [("", a["collapsed_steps"])])
    series("spruce_adaptive_probes_total", "counter", "Rounds at N run by the probe schedule.",
           [("", a["probes"])])
    series("spruce_adaptive_catch_ups_total", "counter", "Plain steps with the draft's extend, run before a round "
           "over drafts that plain steps left behind (counted in spruce_adaptive_steps_total as plain).",
           [("", a["catch_ups"])])
    series("spruce_adaptive_collapsed_requests_total", "counter", "Requests whose acceptance collapsed (they run "
           "plainly to their end).", [("", a["collapsed_requests"])])


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative speculation counts, derived from one `Engine.stats()["spec"]` snapshot."""

    rounds: int
    draft_tokens: int  # rounds x S (S = num_steps, the tree depth)
    accepted: int  # accepted draft tokens, bonus excluded
    accepted_per_pos: list[int]  # [S]: rounds that accepted depth i+1


def spec_counters(spec: dict, num_steps: int) -> SpecCounters:
    """Counts from the engine's speculation stats: a round that accepted a drafts accepted depths 1..a, so
    position i (depth i+1) was accepted by the rounds with a > i (`accept_length_counts[a]` rounds each)."""
    rounds, committed = spec.get("rounds", 0), spec.get("committed_tokens", 0)
    counts = list(spec.get("accept_length_counts") or [])
    counts += [0] * (num_steps + 1 - len(counts))
    per_pos = [sum(counts[i + 1:]) for i in range(num_steps)]
    return SpecCounters(rounds, rounds * num_steps, committed - rounds, per_pos)


def _emit(out: list[str], kind: str):
    """The writer of one series kind. A labelled series with no sample yet (no request finished, no error) is
    left out, HELP and TYPE too: a family whose label names differ between two servers' scrapes (none on an idle
    one) is what SGLang's router refuses to merge in its /engine_metrics."""
    def emit(name: str, help: str, value) -> None:
        if isinstance(value, dict) and not value:
            return
        out.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
        if isinstance(value, dict):
            out.extend(f'{name}{{{k}="{v_label}"}} {_num(v)}' for (k, v_label), v in value.items())
        else:
            out.append(f"{name} {_num(value)}")

    return emit


def _label(v: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if isinstance(v, float) else str(int(v))
