"""The endpoints and metric names that vLLM's and SGLang's tools read (tokenizer endpoints, /version, SGLang's
/server_info, vLLM's spec-decode metric names, /v1/models' vLLM fields, OpenAI's `usage: null` stream chunks)
and the bundled Grafana dashboard, against one speculative server (bundled pycode-6m, EAGLE-3 with an oracle
draft so that verify rounds accept drafts at every depth)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from oracle_draft import install_oracle
from server_util import SPEC, MODEL_NAME, ServerThread, engine_kwargs, metric, one_torch_thread, wait_idle  # noqa: F401
from spruce import LLM, SamplingParams

KEY = "sk-spruce-tooling"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "def fibonacci(n):\n"
S = SPEC["speculative_num_steps"]
DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana-spruce.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = LLM(**engine_kwargs(tmp_path_factory.mktemp("draft"), context_length=128, disable_radix_cache=False))
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=24))[0]
    install_oracle(llm, 0.7).add_reference(ref.prompt_token_ids, ref.token_ids)
    srv = ServerThread(llm.engine, api_key=KEY, metrics_no_auth=True).start()  # scraped without the key
    # one speculative run for the metrics and /server_info tests
    r = httpx.post(f"{srv.base_url}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text
    wait_idle(srv.base_url)
    yield srv
    srv.stop()


def post(server, path: str, body, headers=AUTH) -> httpx.Response:
    """POST `body` as ASCII JSON (a lone surrogate travels as its \\u escape, as a JSON client sends it)."""
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body),
                      headers={**headers, "Content-Type": "application/json"}, timeout=30)


# --- vLLM's /tokenize and /detokenize ------------------------------------------------------------------------
# vLLM docs (vllm.entrypoints.serve.tokenize.protocol): TokenizeCompletionRequest {model: str | None, prompt: str,
# add_special_tokens: bool = True, return_token_strs: bool | None = False}; TokenizeChatRequest {model, messages,
# add_generation_prompt: bool = True, add_special_tokens: bool = False, ...}; TokenizeResponse {count: int,
# max_model_len: int, tokens: list[int], token_strs: list[str] | None}; DetokenizeRequest {model: str | None,
# tokens: list[int]}; DetokenizeResponse {prompt: str}.
def test_tokenize_detokenize_round_trip(server):
    tok = server.engine.tokenizer
    text = "import os\nclass Config:\n    x = 'é'\n"
    r = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": text})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"} and body["token_strs"] is None
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.max_request_tokens
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False)
    r = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(body["tokens"], skip_special_tokens=False)}
    assert post(server, "/detokenize", {"tokens": plain["tokens"]}).json()["prompt"] == text


def test_tokenize_chat_form(server):
    tok = server.engine.tokenizer
    messages = [{"role": "user", "content": "write a parser"}]
    body = post(server, "/tokenize", {"messages": messages}).json()
    want = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    assert body["tokens"] == want and body["count"] == len(want)
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False),
                                        add_special_tokens=False)


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages[0].content"),
    ("/tokenize", {"messages": []}, "messages"),
])
def test_tokenizer_endpoints_name_the_bad_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenizer_endpoints_need_the_key_and_the_model(server):
    assert post(server, "/tokenize", {"prompt": "a"}, headers={}).status_code == 401
    assert post(server, "/detokenize", {"tokens": [1]}, headers={}).status_code == 401
    assert post(server, "/tokenize", {"model": "other", "prompt": "a"}).status_code == 404


# --- /version and SGLang's /server_info --------------------------------------------------------------------
def test_version(server):
    import spruce

    assert httpx.get(f"{server.base_url}/version").json() == {"version": spruce.__version__}


def test_server_info_as_sglang_bench_serving_reads_it(server):
    # sglang.bench_serving, after a run with an sglang backend: GET /get_server_info; if "decode" in the json, take
    # json["decode"][0]; then accept_length = json["internal_states"][0].get("avg_spec_accept_length").
    spec = server.engine.stats()["spec"]
    for path in ("/server_info", "/get_server_info"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 401
        info = httpx.get(f"{server.base_url}{path}", headers=AUTH).json()
        assert "decode" not in info
        assert info["internal_states"][0]["avg_spec_accept_length"] == spec["mean_accept_length"] > 1
        assert info["avg_spec_accept_length"] == spec["mean_accept_length"]
        lim = server.engine.limits
        assert info["speculative_algorithm"] == "EAGLE3" and info["tp_size"] == 1
        assert info["mixed_steps"] is False  # speculative rounds alternate with prefills
        assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) \
            == (lim.num_steps, lim.eagle_topk, lim.num_draft_tokens)
        assert (info["page_size"], info["max_running_requests"], info["context_length"]) \
            == (lim.page_size, lim.max_running_requests, lim.context_length) == (4, 8, 128)
        assert info["model_path"] == str(server.engine.config.model)


# --- vLLM's spec-decode metric names -----------------------------------------------------------------------
def samples(text: str, name: str) -> dict[str, float]:
    """{labels: value} of every sample named exactly `name`."""
    found = re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return {labels: float(v) for labels, v in found}


def test_vllm_spec_decode_aliases_equal_the_spruce_counters(server):
    # vLLM's counters as its dashboards and clients read them (SpecDecodingProm, exposed with _total):
    # vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
    # vllm:spec_decode_num_accepted_tokens_total, vllm:spec_decode_num_accepted_tokens_per_pos_total{position}.
    text = wait_idle(server.base_url)
    spec = server.engine.stats()["spec"]
    rounds = metric(text, "spruce_spec_verify_rounds_total")
    accepted = metric(text, "spruce_spec_accepted_tokens_total")
    assert rounds == spec["rounds"] > 0 and accepted == spec["committed_tokens"] - spec["rounds"] > 0
    assert metric(text, "spruce_spec_draft_tokens_total") == S * rounds
    per_pos = samples(text, "spruce_spec_accepted_tokens_per_pos_total")
    assert list(per_pos) == [f'{{position="{i}"}}' for i in range(S)]
    positions = list(per_pos.values())
    assert sum(positions) == accepted and positions == sorted(positions, reverse=True) and positions[-1] > 0
    assert [round(p / rounds, 4) for p in positions] == spec["accept_rate_per_depth"]
    labels = f'engine="0",model_name="{MODEL_NAME}"'  # prometheus_client writes labels sorted, as vLLM's do
    for alias, value in (("vllm:spec_decode_num_drafts_total", rounds),
                         ("vllm:spec_decode_num_draft_tokens_total", S * rounds),
                         ("vllm:spec_decode_num_accepted_tokens_total", accepted)):
        assert samples(text, alias) == {f"{{{labels}}}": value}
        assert f"# TYPE {alias} counter" in text
    assert samples(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == {
        f'{{{labels},position="{i}"}}': v for i, v in enumerate(positions)}


# --- OpenAI / vLLM response details -------------------------------------------------------------------------
def test_models_carry_vllm_root_and_max_model_len(server):
    # vLLM's ModelCard: id, object "model", created, owned_by, root, parent, max_model_len.
    card = httpx.get(f"{server.base_url}/v1/models", headers=AUTH).json()["data"][0]
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    assert card["root"] == str(server.engine.config.model) and card["parent"] is None
    assert card["max_model_len"] == server.engine.max_request_tokens


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_stream_chunks_carry_usage_null_until_the_usage_chunk(server, path, body):
    # OpenAI: with stream_options.include_usage, "the usage field on all chunks [but the last] will be null";
    # the last chunk before [DONE] has empty choices and the whole request's usage.
    body = {**body, "model": MODEL_NAME, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, headers=AUTH, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 3
    assert all("usage" in c and c["usage"] is None and c["choices"] for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    without = {k: v for k, v in body.items() if k != "stream_options"}
    with httpx.stream("POST", f"{server.base_url}{path}", json=without, headers=AUTH, timeout=60) as r:
        plain = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert plain and all("usage" not in c for c in plain)
    refused = post(server, path, {**body, "stream": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"


# --- the Grafana dashboard -----------------------------------------------------------------------------------
PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "avg", "ignoring", "group_left", "le", "job",
                "position", "finish_reason", "status", "label_values", "without", "on"}


def test_grafana_dashboard_queries_use_real_metric_names(server):
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 8 and all(p["targets"] for p in dash["panels"])
    text = wait_idle(server.base_url)
    exposed = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", text, re.MULTILINE))
    used = set()
    for e in exprs:
        e = re.sub(r'"[^"]*"', '""', e)  # label values
        e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
        used |= {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e) if w not in PROMQL_WORDS}
    assert {"spruce_time_to_first_token_seconds_bucket", "spruce_inter_token_latency_seconds_bucket",
            "spruce_requests_waiting", "spruce_kv_pages_used", "spruce_spec_accepted_tokens_per_pos_total"} <= used
    assert used <= exposed, f"dashboard queries name metrics /metrics does not expose: {sorted(used - exposed)}"


# --- prefix cache: OpenAI's cached_tokens, SGLang's /flush_cache, the hit-rate metric ----------------------------
def test_cached_tokens_flush_cache_and_hit_rate(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT * 6 + "x = 1\n", "max_tokens": 4, "temperature": 0}
    first = post(server, "/v1/completions", body).json()["usage"]
    second = post(server, "/v1/completions", body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0 or first["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 32  # the shared pages
    wait_idle(server.base_url)
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 0.0 < metric(text, "spruce_prefix_cache_hit_rate") < 1.0
    assert metric(text, "spruce_prefix_cache_hit_tokens_total") >= second["prompt_tokens_details"]["cached_tokens"]
    flushed = post(server, "/flush_cache", {}).json()["flushed_pages"]
    assert flushed > 0
    third = post(server, "/v1/completions", body).json()["usage"]
    assert third["prompt_tokens_details"]["cached_tokens"] == 0  # computed again after the flush
    assert post(server, "/flush_cache", {}, headers={}).status_code == 401
