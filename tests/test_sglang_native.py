"""SGLang's native /generate and /health_generate against one speculative server on the bundled pycode-6m:
greedy output equal to /v1/completions', SGLang's response and stream shapes (cumulative chunks, [DONE]), batched
text and input_ids, stop strings, logprobs, and 400s naming SGLang's field."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from server_util import MODEL_NAME, ServerThread, engine_kwargs, metric, one_torch_thread  # noqa: F401
from spruce import LLM

PROMPT = "def fibonacci(n):\n"
PROMPT2 = "import os\n"
GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = LLM(**engine_kwargs(tmp_path_factory.mktemp("draft"), context_length=256))
    srv = ServerThread(llm.engine).start()
    yield srv
    srv.stop()


def generate(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/generate", json=body, timeout=60)


def completion(server, prompt, max_tokens: int = 12, **extra) -> dict:
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_greedy_equals_completions(server):
    ref = completion(server, PROMPT)
    r = generate(server, {"text": PROMPT, "sampling_params": GREEDY, "rid": "my-request"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == ref["text"] and body["output_ids"] == ref["token_ids"]
    meta = body["meta_info"]
    assert meta["id"] == "my-request"
    assert meta["prompt_tokens"] == len(ref["prompt_token_ids"]) and meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0


def test_stream_chunks_are_cumulative_and_end_with_done(server):
    whole = generate(server, {"text": PROMPT, "sampling_params": GREEDY}).json()
    with httpx.stream("POST", f"{server.base_url}/generate", timeout=60,
                      json={"text": PROMPT, "sampling_params": GREEDY, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert len(chunks) >= 2
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        assert after["meta_info"]["completion_tokens"] >= before["meta_info"]["completion_tokens"]
        assert before["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["completion_tokens"] == len(last["output_ids"]) == 12
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_batched_text_and_input_ids(server):
    one, two = (generate(server, {"text": p, "sampling_params": GREEDY}).json() for p in (PROMPT, PROMPT2))
    r = generate(server, {"text": [PROMPT, PROMPT2], "sampling_params": GREEDY, "rid": ["a", "b"]})
    assert r.status_code == 200, r.text
    batch = r.json()
    assert [b["output_ids"] for b in batch] == [one["output_ids"], two["output_ids"]]
    assert [b["meta_info"]["id"] for b in batch] == ["a", "b"]
    ids = [completion(server, p, max_tokens=1)["prompt_token_ids"] for p in (PROMPT, PROMPT2)]
    by_ids = generate(server, {"input_ids": ids, "sampling_params": {**GREEDY, "n": 2}}).json()
    assert [b["output_ids"] for b in by_ids] == [one["output_ids"]] * 2 + [two["output_ids"]] * 2
    single = generate(server, {"input_ids": ids[0], "sampling_params": GREEDY}).json()
    assert isinstance(single, dict) and single["text"] == one["text"]


def test_stop_string_cut_matched_and_kept_with_no_stop_trim(server):
    whole = generate(server, {"text": PROMPT, "sampling_params": GREEDY}).json()["text"]
    stop = whole[3:6]
    cut = whole[:whole.index(stop)]
    body = generate(server, {"text": PROMPT, "sampling_params": {**GREEDY, "stop": [stop]}}).json()
    assert body["text"] == cut
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = generate(server, {"text": PROMPT, "sampling_params": {**GREEDY, "stop": stop, "no_stop_trim": True}})
    assert kept.json()["text"] == cut + stop


def test_stop_token_id_is_the_matched_token(server):
    ids = generate(server, {"text": PROMPT, "sampling_params": GREEDY}).json()["output_ids"]
    stop_id = ids[4]
    body = generate(server, {"text": PROMPT, "sampling_params": {**GREEDY, "stop_token_ids": [stop_id]}}).json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert body["output_ids"] == ids[:ids.index(stop_id) + 1]


def test_logprobs_shape(server):
    r = generate(server, {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 4}, "return_logprob": True,
                          "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    prompt_len = meta["prompt_tokens"]
    assert [e[1] for e in meta["output_token_logprobs"]] == body["output_ids"]
    assert all(isinstance(e[0], float) and e[0] <= 0 and isinstance(e[2], str) for e in meta["output_token_logprobs"])
    assert len(meta["input_token_logprobs"]) == prompt_len and meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_top_logprobs"]) == 4 and all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert meta["output_top_logprobs"][0][0][1] == body["output_ids"][0]  # greedy: the chosen token ranks first
    plain = generate(server, {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 4},
                              "return_logprob": True}).json()["meta_info"]
    assert plain["input_token_logprobs"] == [] and "output_top_logprobs" not in plain
    assert [e[2] for e in plain["output_token_logprobs"]] == [None] * 4


def test_bench_serving_payload_and_unknown_fields_are_accepted(server):
    """What sglang.bench_serving sends (neutral lora_path, logprob_start_len -1, ...), plus a routing field."""
    r = generate(server, {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 3,
                                                                       "ignore_eos": True},
                          "stream": False, "lora_path": None, "return_logprob": False,
                          "return_routed_experts": False, "logprob_start_len": -1, "routing_key": "x"})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("body, param", [
    ({"text": PROMPT, "input_ids": [1, 2]}, "input_ids"),
    ({"sampling_params": GREEDY}, "text"),
    ({"text": [PROMPT, 3]}, "text"),
    ({"input_ids": [[1, 2], "x"]}, "input_ids"),
    ({"input_ids": [1, 10**9]}, "input_ids"),
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens"),
    ({"text": PROMPT, "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"text": PROMPT, "sampling_params": {"top_p": 2.0}}, "sampling_params.top_p"),
    ({"text": PROMPT, "sampling_params": {"beam_width": 4}}, "sampling_params.beam_width"),
    ({"text": PROMPT, "sampling_params": {"stop_regex": "x+"}}, "sampling_params.stop_regex"),
    ({"text": PROMPT, "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
    ({"text": PROMPT, "lora_path": "adapter"}, "lora_path"),
    ({"text": PROMPT, "top_logprobs_num": 2}, "top_logprobs_num"),
    ({"text": PROMPT, "return_logprob": True, "logprob_start_len": 1000}, "logprob_start_len"),
    ({"text": PROMPT, "return_logprob": "yes"}, "return_logprob"),
    ({"text": [PROMPT, PROMPT2], "rid": "one"}, "rid"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = generate(server, body)
    assert r.status_code in (400, 413), r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert param.split(".")[-1] in error["message"]


def test_health_generate(server):
    r = httpx.get(f"{server.base_url}/health_generate", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_health_generate_is_503_when_nothing_can_be_generated(server):
    loop = server.engine_loop
    loop._accepting = False  # as a shutdown does; the module's other tests ran before (file order)
    try:
        r = httpx.get(f"{server.base_url}/health_generate", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "unhealthy", r.text
    finally:
        loop._accepting = True


def abort_count(base_url: str) -> float:
    text, name = httpx.get(f"{base_url}/metrics").text, 'spruce_requests_finished_total{finish_reason="abort"}'
    return metric(text, name) if name in text else 0.0  # the series appears with the first abort


def pages_used_until(base_url: str, predicate, timeout: float = 5.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = metric(httpx.get(f"{base_url}/metrics").text, "spruce_kv_pages_used")
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_the_request(server, stream):
    before = abort_count(server.base_url)
    body = json.dumps({"text": "class A:\n", "stream": stream,
                       "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert pages_used_until(server.base_url, lambda v: v > 0) > 0
    sock.close()
    assert pages_used_until(server.base_url, lambda v: v == 0) == 0
    assert abort_count(server.base_url) == before + 1
