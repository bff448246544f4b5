"""Logprobs: the target's raw float32 log-softmax at each committed position, identical with and without
speculation (trees, topk 1 and 4, page 1 and 16, overlap on and off), equal to a direct computation from the
target's logits, truncated with the tokens, computed only when asked; prompt logprobs and echo; the OpenAI
shapes through the official client; refusal of bad values.

Float32 tolerance: the same position's logits differ by float32 rounding between batch shapes (a request alone
vs in a batch of 3, decode vs extend, a verify tree vs a decode row): measured up to ~2e-5 on logprobs near -4,
which is relative 5e-6. `close` allows 1e-5 absolute + 1e-5 relative."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from spruce import SamplingParams
from spruce.config import builtin_model_path
from spruce.errors import InvalidRequestError
from checkpoints import write_eagle3_checkpoint
from oracle_draft import install_oracle

TARGET = builtin_model_path()
PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n", "for i in range(10):"]
SAMPLED_PROMPTS = ["with open(path) as f:\n    for line in f:\n        ", "x = ["]  # own prompts: own oracle references
MAX_NEW = 12
TOP = 5
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP, prompt_logprobs=3)
SAMPLED = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP, temperature=0.8, top_k=20, seed=11)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 + 1e-5 * abs(b)


def assert_same_logprobs(got: list, want: list) -> None:
    """Per position: the same tokens in the same order (chosen first, then the top alternatives), the same
    ranks, logprobs within float32 noise."""
    assert len(got) == len(want)
    for pos, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, pos
            continue
        assert list(g) == list(w), (pos, g, w)
        for t in w:
            assert close(g[t].logprob, w[t].logprob), (pos, t, g[t], w[t])
            assert g[t].rank == w[t].rank and g[t].decoded_token == w[t].decoded_token, (pos, t, g[t], w[t])


def assert_outputs_match(outs, refs) -> None:
    for o, r in zip(outs, refs):
        assert o.token_ids == r.token_ids  # greedy: token for token; seeded sampling: the same samples
        assert len(o.logprobs) == len(o.token_ids)
        assert_same_logprobs(o.logprobs, r.logprobs)
        if r.prompt_logprobs is not None:
            assert_same_logprobs(o.prompt_logprobs, r.prompt_logprobs)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("d") / "eagle3", TARGET, seed=1))  # every token draftable


@pytest.fixture(scope="module")
def plain():
    from spruce import LLM

    return LLM(TARGET, page_size=16, max_running_requests=8)


@pytest.fixture(scope="module")
def reference(plain):
    """Plain decoding: greedy outputs (with prompt logprobs) for PROMPTS, seeded samples for SAMPLED_PROMPTS."""
    outs = plain.generate(PROMPTS + SAMPLED_PROMPTS, [GREEDY] * len(PROMPTS) + [SAMPLED] * len(SAMPLED_PROMPTS))
    return outs[:len(PROMPTS)], outs[len(PROMPTS):]


def spec_llm(make_llm, draft, reference, k, page, fraction=0.8, **kw):
    llm = make_llm(TARGET, page_size=page, max_running_requests=8, draft_model=draft, speculative_algorithm="EAGLE3",
                   speculative_num_steps=3, speculative_eagle_topk=k, speculative_num_draft_tokens=4 if k == 1 else 8,
                   **kw)
    oracle = install_oracle(llm, fraction)  # most drafts right: rounds commit several tokens
    for r in reference[0] + reference[1]:  # the sampled ones: the seeded samples (the same with speculation)
        oracle.add_reference(r.prompt_token_ids, r.token_ids)
    return llm


CASES = [(1, 1, True), (1, 16, False), (4, 1, False), (4, 16, True)]


@pytest.mark.parametrize("k,page,overlap", CASES, ids=[f"K{k}-p{p}-{'overlap' if o else 'sync'}" for k, p, o in CASES])
def test_speculative_logprobs_equal_plain(make_llm, draft, reference, k, page, overlap):
    llm = spec_llm(make_llm, draft, reference, k, page, disable_overlap_schedule=not overlap)
    greedy, sampled = reference
    outs = llm.generate(PROMPTS + SAMPLED_PROMPTS, [GREEDY] * len(PROMPTS) + [SAMPLED] * len(SAMPLED_PROMPTS))
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.8  # several tokens per round
    assert_outputs_match(outs, greedy + sampled)


@pytest.mark.parametrize("k,n,page", [(1, 4, 16), (4, 8, 1)])
def test_nextn_logprobs_equal_plain(make_llm, pycodemla, k, n, page):
    from spruce import LLM

    prompts = [[1] + list(range(300, 300 + 9 * i + 7)) for i in range(2)]  # token ids: no tokenizer needed
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, temperature=1.0, seed=5)]
    refs = LLM(pycodemla, page_size=16, max_running_requests=4).generate(prompts, params)
    llm = make_llm(pycodemla, page_size=page, max_running_requests=4, speculative_algorithm="NEXTN",
                   speculative_num_steps=3, speculative_eagle_topk=k, speculative_num_draft_tokens=n)
    assert_outputs_match(llm.generate(prompts, params), refs)
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.2


def direct(llm, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits at every prompt and output position ([len - 1, V]: row i predicts
    token i + 1), by teacher forcing."""
    return llm.engine.next_token_logits(prompt_ids + output_ids[:-1]).log_softmax(dim=-1)


def check_direct(entries: list, tokens: list[int], lp: torch.Tensor, n: int) -> None:
    """Each entry against its row of direct logprobs: the chosen token first with its logprob and rank, then
    exactly the n most likely tokens with theirs."""
    assert len(entries) == len(tokens) == lp.shape[0]
    for entry, token, row in zip(entries, tokens, lp):
        assert next(iter(entry)) == token
        assert close(entry[token].logprob, row[token].item())
        assert entry[token].rank == int((row >= row[token]).sum())
        values, ids = row.topk(n)
        for j, (value, t) in enumerate(zip(values.tolist(), ids.tolist())):
            assert entry[t].rank == j + 1 and close(entry[t].logprob, value)
        assert len(entry) == n + (token not in ids.tolist())


def test_logprobs_equal_direct_computation(plain, reference):
    """Greedy and seeded sampled requests: the logprob of the token actually committed (the raw target
    distribution, not the temperature/top-k one it was sampled from) and the top alternatives; prompt
    logprobs (None first) from the prefill logits."""
    greedy, sampled = reference
    raw_vs_scaled = 0.0
    for o in greedy + sampled:
        p = len(o.prompt_token_ids)
        lp = direct(plain, o.prompt_token_ids, o.token_ids)
        check_direct(o.logprobs, o.token_ids, lp[p - 1:], TOP)
        if o.prompt_logprobs is not None:
            assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == p
            check_direct(o.prompt_logprobs[1:], o.prompt_token_ids[1:], lp[:p - 1], 3)
        else:
            scaled = (plain.engine.next_token_logits(o.prompt_token_ids + o.token_ids[:-1], first=p - 1) / 0.8)
            scaled = scaled.log_softmax(dim=-1)
            raw_vs_scaled = max(raw_vs_scaled, max(abs(e[t].logprob - scaled[i, t].item())
                                                   for i, (e, t) in enumerate(zip(o.logprobs, o.token_ids))))
        assert [e[t].decoded_token for e, t in zip(o.logprobs, o.token_ids)] == \
            [plain.tokenizer.decode([t], skip_special_tokens=False) for t in o.token_ids]
    assert raw_vs_scaled > 1e-2  # the sampled requests' logprobs are the raw ones
    assert any(e[t].rank > 1 for o in sampled for e, t in zip(o.logprobs, o.token_ids))  # some non-argmax samples


@pytest.fixture(scope="module")
def spec(draft, reference):
    from spruce import LLM

    llm = LLM(TARGET, page_size=4, max_running_requests=8, draft_model=draft, speculative_algorithm="EAGLE3",
              speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    oracle = install_oracle(llm, 1.0)  # every draft right: each round commits S + 1 = 4 tokens
    for r in reference[0]:
        oracle.add_reference(r.prompt_token_ids, r.token_ids)
    return llm


def test_truncation_cuts_logprobs_with_tokens(spec, reference):
    """A stop string, a stop token and max_tokens inside a round of 4 tokens: logprobs stay one per token."""
    ref = reference[0][0]
    text = ref.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cases = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP, stop=stop),
             SamplingParams(max_tokens=6, ignore_eos=True, logprobs=TOP),
             SamplingParams(max_tokens=MAX_NEW, logprobs=TOP, stop_token_ids=[ref.token_ids[6]])]
    outs = spec.generate([PROMPTS[0]] * len(cases), cases)
    assert outs[0].finish_reason == "stop" and outs[0].text == text[:text.find(stop)]
    assert (outs[1].finish_reason, len(outs[1].token_ids)) == ("length", 6)
    assert outs[2].finish_reason == "stop" and outs[2].token_ids == ref.token_ids[:ref.token_ids.index(ref.token_ids[6]) + 1]
    for o in outs:
        n = len(o.token_ids)
        assert 0 < n < MAX_NEW and o.token_ids == ref.token_ids[:n]
        assert_same_logprobs(o.logprobs, ref.logprobs[:n])


def test_cost_only_when_asked(spec, reference, monkeypatch):
    """No request wants logprobs: nothing is scored; one of three does: only its rows are."""
    import spruce.speculative.eagle_worker as ew
    import spruce.runtime.strategy as st
    from spruce.runtime import logprobs as lpmod

    calls = []
    original = lpmod.pack_logprobs

    def recording(logits, tokens, k):
        calls.append((logits.shape[0], k))
        return original(logits, tokens, k)

    for module in (ew, st, lpmod):  # the round, plain decoding, prefill
        monkeypatch.setattr(module, "pack_logprobs", recording)
    plain_params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = spec.generate(PROMPTS, plain_params)
    assert not calls and all(o.logprobs is None and o.prompt_logprobs is None for o in outs)
    outs = spec.generate(PROMPTS, [plain_params, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2),
                                   plain_params])
    assert calls[0] == (1, 2)  # prefill: the token sampled after the one prompt that wants logprobs
    assert len(calls) > 1 and all(c == (4, 2) for c in calls[1:])  # each round: 1 row x (S + 1) positions
    assert outs[1].logprobs is not None and outs[0].logprobs is None


def test_logprobs_through_preemption(make_llm, draft, reference):
    """Preempted requests recompute their cache; their logprobs (and prompt logprobs) do not change."""
    llm = spec_llm(make_llm, draft, reference, 4, 4, max_total_tokens=64)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_outputs_match(outs, reference[0])


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [21, -1, 2.0, True])
def test_bad_values_are_refused(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and str(value) in str(e.value)
    if value == 21:
        assert "between 0 and 20" in str(e.value)


# --- the OpenAI server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(draft, reference):
    from spruce import LLM
    from server_util import ServerThread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # engine, event loop and client share the cores
    llm = LLM(TARGET, page_size=4, max_running_requests=8, draft_model=draft, speculative_algorithm="EAGLE3",
              speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    oracle = install_oracle(llm, 0.8)
    for r in reference[0]:
        oracle.add_reference(r.prompt_token_ids, r.token_ids)
    srv = ServerThread(llm.engine).start()
    yield srv
    srv.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def completion(client, **kw):
    from server_util import MODEL_NAME

    return client.completions.create(**{"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_NEW,
                                        "temperature": 0, **kw})


def chat(client, **kw):
    from server_util import MODEL_NAME

    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "def fib"}],
                                          max_tokens=8, temperature=0, **kw)


def test_completions_logprobs_shape(client, reference):
    ref = reference[0][0]
    r = completion(client, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == ref.text
    assert lp.tokens == [e[t].decoded_token for e, t in zip(ref.logprobs, ref.token_ids)]
    assert "".join(lp.tokens) == ref.text
    assert all(close(a, e[t].logprob) for a, e, t in zip(lp.token_logprobs, ref.logprobs, ref.token_ids))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for top, e, t in zip(lp.top_logprobs, ref.logprobs, ref.token_ids):  # the chosen token and the top 3
        want = {x.decoded_token: x.logprob for x in e.values() if x.rank <= 3 or x is e[t]}
        assert top.keys() == want.keys() and all(close(top[k], want[k]) for k in want)
    # streamed: the chunks' logprobs concatenate to the same
    chunks = list(completion(client, logprobs=3, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    # logprobs=0: the chosen token alone
    r = completion(client, logprobs=0, max_tokens=4)
    assert all(len(top) == 1 for top in r.choices[0].logprobs.top_logprobs)


def test_completions_echo(server, client, reference):
    ref = reference[0][0]
    r = completion(client, echo=True, logprobs=2, max_tokens=4)
    choice = r.choices[0]
    p = len(ref.prompt_token_ids)
    assert choice.text == PROMPTS[0] + server.engine.tokenizer.decode(ref.token_ids[:4])
    assert len(choice.logprobs.tokens) == p + 4 == r.usage.prompt_tokens + r.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(close(a, e[t].logprob) for a, e, t in zip(choice.logprobs.token_logprobs[1:p], ref.prompt_logprobs[1:],
                                                         ref.prompt_token_ids[1:]))
    assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs[1:])
    chunks = list(completion(client, echo=True, logprobs=2, max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == choice.logprobs.tokens
    r = completion(client, echo=True, max_tokens=4)  # echo alone: the prompt text, no logprobs
    assert r.choices[0].text == choice.text and r.choices[0].logprobs is None


def test_chat_logprobs_shape(client):
    r = chat(client, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the most likely
        assert close(c.top_logprobs[0].logprob, c.logprob)
    chunks = list(chat(client, logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(close(a.logprob, b.logprob) for a, b in zip(streamed, content))
    r = chat(client, logprobs=True)  # no top_logprobs: the chosen tokens' alone
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)
    assert chat(client).choices[0].logprobs is None


BAD = [
    ("completions", {"logprobs": 21}, "logprobs"), ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"), ("chat/completions", {"logprobs": True, "top_logprobs": 21},
                                                      "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"), ("chat/completions", {"logprobs": 3}, "logprobs"),
]


@pytest.mark.parametrize("path,fields,param", BAD)
def test_bad_logprob_fields_are_refused(server, path, fields, param):
    body = ({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "x"})
    r = httpx.post(f"{server.base_url}/v1/{path}", json={**body, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"{param}" in err["message"], err
    assert json.dumps(fields[param]) in err["message"], err
