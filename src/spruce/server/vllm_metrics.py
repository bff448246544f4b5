"""vLLM's metric names, labels and buckets (vllm/v1/metrics/loggers.py, PrometheusStatLogger), exported through
prometheus_client beside spruce's own series, so that vLLM's dashboards and clients read spruce unchanged.

Every series is labelled `model_name` (the served name) and `engine` ("0": one engine per server). Gauges and
counters are read at scrape time from the engine's stats snapshot (`Metrics.stats`) and the request counts
`Metrics` keeps; the latency histograms are observed as outputs are dispatched (`observe_*`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LABELS = ("model_name", "engine")
ENGINE = "0"
# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values, each exported from 0


class VllmMetrics:
    """The vLLM-named series of one server. `source` is the spruce `Metrics` whose snapshot and counts the
    scrape-time series read (its `model_name`, `stats`, `finished`, `prompt_tokens`, `spec_counters()`)."""

    def __init__(self, source):
        self.source = source
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, registry=self.registry, buckets=TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LABELS, registry=self.registry, buckets=ITL_BUCKETS)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds "
                              "(the inter-token latency, under vLLM's earlier name).", LABELS, registry=self.registry,
                              buckets=ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, registry=self.registry, buckets=REQUEST_LATENCY_BUCKETS)
        self.registry.register(_SnapshotCollector(source))

    def _labels(self) -> dict[str, str]:
        return {"model_name": self.source.model_name, "engine": ENGINE}

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(**self._labels()).observe(seconds)

    def observe_itl(self, seconds: float, times: int = 1) -> None:
        """`times` gaps of `seconds` each (a round committing k tokens counts k gaps of dt/k)."""
        labels = self._labels()
        itl, tpot = self.itl.labels(**labels), self.tpot.labels(**labels)
        for _ in range(times):
            itl.observe(seconds)
            tpot.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.labels(**self._labels()).observe(seconds)

    def render(self) -> str:
        """The series in the Prometheus text format; the histograms from zero before their first observation (as
        vLLM, which creates them labelled at start-up)."""
        labels = self._labels()
        for histogram in (self.ttft, self.itl, self.tpot, self.e2e):
            histogram.labels(**labels)
        return generate_latest(self.registry).decode()


class _SnapshotCollector:
    """Gauges and counters read at scrape time from the engine's stats snapshot and the request counts."""

    def __init__(self, source):
        self.source = source

    def describe(self):
        return []  # collected at scrape time only (nothing to check at registration)

    def collect(self):
        src = self.source
        s, labels = src.stats, [src.model_name, ENGINE]
        names = list(LABELS)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    s.get("running", 0))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.get("waiting", 0))
        total = s.get("kv_pages_total", 0)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s.get("kv_pages_used", 0) / total if total else 0.0)
        cache = s.get("prefix_cache") or {}
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      cache.get("queried_tokens", 0))
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      cache.get("hit_tokens", 0))
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      s.get("preemptions", 0))
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", src.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      s.get("tokens_generated", 0))
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*names, "finished_reason"])
        finished = dict.fromkeys(FINISHED_REASONS, 0) | src.finished
        for reason, n in sorted(finished.items()):
            success.add_metric([*labels, reason], n)
        yield success
        if s.get("spec") is not None:
            yield from _spec_decode(src.spec_counters(), labels, names)


def _spec_decode(c, labels: list[str], names: list[str]):
    """vLLM's spec-decode counters (SpecDecodingProm) from spruce's speculation counts (metrics.SpecCounters): a
    draft is a verify round; draft tokens count S (the tree depth) per round; accepted tokens exclude the bonus."""
    for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts (spruce: verify rounds).", c.rounds),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens (spruce: S per verify round, the tree "
             "depth).", c.draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens (bonus tokens excluded).",
             c.accepted)):
        family = CounterMetricFamily(name, doc, labels=names)
        family.add_metric(labels, value)
        yield family
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
                                  "position (spruce: rounds that accepted tree depth position+1).",
                                  labels=[*names, "position"])
    for i, v in enumerate(c.accepted_per_pos):
        per_pos.add_metric([*labels, str(i)], v)
    yield per_pos
