"""vLLM's metric names, labels and buckets on /metrics (what vLLM's dashboards query), and the server's operations
surface: /ready beside /health, sampling defaults from the model's generation_config.json, JSON log lines,
`python -m spruce`."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_util import MODEL_NAME, ServerThread, metric, one_torch_thread, wait_idle  # noqa: F401
from spruce import LLM
from spruce.cli import build_parser
from spruce.sampling_defaults import model_sampling_defaults
from spruce.server.app import unready_reason
from spruce.server.cli import app_options
from spruce.server.logs import JsonFormatter, configure_logging, uvicorn_log_config
from spruce.server.vllm_metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def server():
    """A plain engine (prefix cache on) whose sampling defaults say greedy, as a generation_config.json of
    temperature 0 would."""
    llm = LLM(page_size=4, max_running_requests=4, context_length=128)
    with ServerThread(llm.engine, sampling_defaults={"temperature": 0.0}) as srv:
        yield srv


def complete(server, **body) -> dict:
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def families(text: str) -> dict:
    """{name: family} of the vllm:* families (counters under their name without _total)."""
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def value(fams: dict, name: str, sample: str | None = None, **labels) -> float:
    found = [s.value for s in fams[name].samples if s.name == (sample or name)
             and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, sample, labels, fams[name].samples)
    return found[0]


def test_vllm_series_count_the_requests_with_vllms_labels_and_buckets(server):
    usages = [complete(server, temperature=0.0)["usage"] for _ in range(2)]
    text = wait_idle(server.base_url)
    fams = families(text)
    expected = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
                "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
                "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter",
                "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
                "vllm:num_preemptions": "counter", "vllm:time_to_first_token_seconds": "histogram",
                "vllm:inter_token_latency_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
                "vllm:e2e_request_latency_seconds": "histogram"}
    assert {name: fams[name].type for name in expected} == expected
    for fam in fams.values():
        for s in fam.samples:
            assert (s.labels["model_name"], s.labels["engine"]) == (MODEL_NAME, "0"), s
    assert value(fams, "vllm:num_requests_running") == value(fams, "vllm:num_requests_waiting") == 0
    assert 0 <= value(fams, "vllm:kv_cache_usage_perc") <= 1
    generated = metric(text, "spruce_generation_tokens_total")
    assert value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == generated >= 2 * MAX_TOKENS
    assert value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert value(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == \
        metric(text, "spruce_prefix_cache_queried_tokens_total")
    assert value(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == \
        metric(text, "spruce_prefix_cache_hit_tokens_total") > 0  # the second prompt is the first's
    success = {s.labels["finished_reason"]: s.value for s in fams["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert success == {"length": 2, "stop": 0, "abort": 0, "error": 0}
    finished = metric(text, 'spruce_requests_finished_total{finish_reason="length"}')
    assert value(fams, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == finished
    assert value(fams, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == finished
    gaps = sum(u["completion_tokens"] - 1 for u in usages)
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert value(fams, name, name + "_count") == gaps
    for name, buckets in (("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
                          ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
                          ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS)):
        bounds = [float(s.labels["le"]) for s in fams[name].samples if s.name == name + "_bucket"]
        assert bounds == [*buckets, float("inf")]
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and REQUEST_LATENCY_BUCKETS[-1] == 7680.0  # vLLM's


def test_the_vllm_dashboards_queries_find_their_series(server):
    """examples/grafana-vllm.json (vLLM's dashboard queries): every vllm:* series it reads is served (the
    vllm:spec_decode_* ones by a speculative server: test_server_tooling.py)."""
    import re
    from pathlib import Path

    complete(server, temperature=0.0)
    text = wait_idle(server.base_url)
    served = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = (Path(__file__).parent.parent / "examples" / "grafana-vllm.json").read_text()
    queried = set(re.findall(r"vllm:[a-z0-9_]+", dashboard))
    spec = {name for name in queried if name.startswith("vllm:spec_decode_")}  # served with speculation on
    assert len(queried - spec) >= 12 and queried - spec <= served, queried - spec - served
    assert spec <= {"vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"}


def test_sampling_defaults_fill_what_a_request_leaves_unset(server):
    greedy = complete(server, temperature=0.0, max_tokens=12)["choices"][0]["text"]
    assert complete(server, max_tokens=12, seed=3)["choices"][0]["text"] == greedy  # the default: temperature 0
    sampled = {complete(server, max_tokens=12, seed=s, temperature=1.0)["choices"][0]["text"] for s in (3, 4, 5)}
    assert sampled != {greedy}  # a request's own temperature still wins


def test_ready_and_health(server):
    assert httpx.get(f"{server.base_url}/ready").json() == {"status": "ready"}
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


def fake_loop(**kw):
    state = dict(failure=None, alive=True, accepting=True, in_flight=0)
    state.update(kw)
    return SimpleNamespace(engine=SimpleNamespace(limits=SimpleNamespace(max_running_requests=4)), **state)


@pytest.mark.parametrize("state,words", [
    ({}, None),
    ({"in_flight": 6}, None),  # 4 run, 2 wait of at most 3
    ({"in_flight": 7}, "queue is full"),  # one more would make 4 wait
    ({"accepting": False}, "shutting down"),
    ({"alive": False}, "not running"),
    ({"failure": "RuntimeError: boom", "alive": False}, "RuntimeError: boom"),
])
def test_unready_reasons(state, words):
    reason = unready_reason(fake_loop(**state), max_queued=3)
    assert reason is None if words is None else words in reason


def test_model_sampling_defaults_read_generation_config(tmp_path, caplog):
    assert model_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "repetition_penalty": 1.05,
         "eos_token_id": 1}))
    assert model_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                 "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_k": 0, "min_p": 0.1}))
    with caplog.at_level(logging.WARNING, logger="spruce"):
        assert model_sampling_defaults(tmp_path) == {"min_p": 0.1}
    assert "temperature=-1" in caplog.text
    args = build_parser().parse_args(["serve"])
    assert app_options(args, str(tmp_path))["sampling_defaults"] == {"min_p": 0.1}  # --sampling-defaults model
    args = build_parser().parse_args(["serve", "--sampling-defaults", "openai"])
    assert app_options(args, str(tmp_path))["sampling_defaults"] == {}


def test_json_log_lines():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        configure_logging("info", "json")
        root.handlers[0].setStream(stream)
        logging.getLogger("spruce.server").info("serving %r", "m")
        try:
            raise ValueError("bad")
        except ValueError:
            logging.getLogger("spruce.server").exception("failed")
    finally:
        root.handlers[:], root.level = saved
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (first["level"], first["logger"], first["message"]) == ("INFO", "spruce.server", "serving 'm'")
    assert first["time"].endswith("Z") and "exception" not in first
    assert second["message"] == "failed" and "ValueError: bad" in second["exception"]
    assert uvicorn_log_config("json") is None and uvicorn_log_config("text") is not None
    assert json.loads(JsonFormatter().format(logging.makeLogRecord({"msg": "x\ny"})))["message"] == "x\ny"
    assert build_parser().parse_args(["serve", "--log-format", "json"]).log_format == "json"


def test_python_dash_m_spruce():
    out = subprocess.run([sys.executable, "-m", "spruce", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("spruce ")
