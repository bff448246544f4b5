"""A server whose KV cache (--max-total-tokens) is smaller than one context: it advertises the limit it can
really serve, fits default max_tokens into it, and refuses (never silently cuts) a max_tokens beyond it."""

from __future__ import annotations

import httpx
import pytest

from conftest import assert_no_leaks
from server_util import MODEL_NAME, ServerThread, engine_kwargs, one_torch_thread  # noqa: F401
from spruce import LLM

CONTEXT = 256
MAX_TOTAL_TOKENS = 64


@pytest.fixture(scope="module")
def small_kv(tmp_path_factory):
    llm = LLM(**engine_kwargs(tmp_path_factory.mktemp("draft"), context_length=CONTEXT,
                              max_total_tokens=MAX_TOTAL_TOKENS))
    with ServerThread(llm.engine) as srv:
        yield srv
    assert_no_leaks(llm)


def served_limit(engine) -> int:
    """What one request can hold: every page but the last `lookahead` positions a decode step reserves."""
    lim = engine.limits
    return engine.runner.allocator.capacity * lim.page_size - lim.lookahead


def test_models_advertise_what_the_kv_cache_holds(small_kv):
    limit = served_limit(small_kv.engine)
    assert limit < CONTEXT
    card = httpx.get(f"{small_kv.base_url}/v1/models").json()["data"][0]
    assert card["id"] == MODEL_NAME and card["max_model_len"] == limit


def test_default_max_tokens_fit(small_kv):
    """Without max_tokens a chat request gets the room left (it used to ask for a whole context: 413)."""
    r = httpx.post(f"{small_kv.base_url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "def f():"}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["total_tokens"] == served_limit(small_kv.engine)
    assert body["choices"][0]["finish_reason"] == "length"
    r = httpx.post(f"{small_kv.base_url}/v1/completions", json={"prompt": "x = 1\n" * 9, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text


def test_max_tokens_beyond_the_limit_is_refused(small_kv):
    limit = served_limit(small_kv.engine)
    prompt_tokens = len(small_kv.engine.tokenizer.encode("def f():\n"))
    url = f"{small_kv.base_url}/v1/completions"
    r = httpx.post(url, json={"prompt": "def f():\n", "max_tokens": limit - prompt_tokens + 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens", r.text
    assert f"max_tokens must be <= {limit - prompt_tokens}" in err["message"]
    r = httpx.post(url, json={"prompt": "def f():\n", "max_tokens": limit - prompt_tokens, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == limit, r.text
    r = httpx.post(url, json={"prompt": list(range(1, limit + 1)), "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt", r.text
