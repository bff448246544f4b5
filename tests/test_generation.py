"""Engine foundation: greedy generation equals transformers token for token; batching, paging, stops."""

from __future__ import annotations

import pytest

from spruce import SamplingParams
from spruce.errors import ConfigError, InvalidRequestError, ModelLoadError
from conftest import hf_greedy

PROMPT_TOKENS = [37, 90, 11, 150]  # mixed prompt lengths
MAX_NEW = 20


@pytest.fixture(scope="session")
def hf_reference(pycode19m, heldout_prompts):
    """Prompts (token ids) and transformers' greedy continuations, float32."""
    return hf_greedy(pycode19m, heldout_prompts, PROMPT_TOKENS, MAX_NEW)


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_greedy_equals_transformers(make_llm, pycode19m, hf_reference, page_size):
    prompts, want = hf_reference
    llm = make_llm(pycode19m, page_size=page_size, max_running_requests=4, chunked_prefill_size=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    for o, w in zip(outs, want):
        assert o.token_ids == w
        assert o.finish_reason == "length"


def test_requests_joining_mid_flight(make_llm, pycode19m, hf_reference):
    prompts, want = hf_reference
    llm = make_llm(pycode19m, page_size=4, max_running_requests=3)
    eng = llm.engine
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    ids = [eng.add_request(prompts[0], params), eng.add_request(prompts[1], params)]
    done = {}
    for _ in range(5):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    ids += [eng.add_request(prompts[2], params), eng.add_request(prompts[3], params)]  # 4th waits for a row
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert [done[i].token_ids for i in ids] == want


def test_out_of_pages_queues_and_preempts(make_llm, pycode19m, hf_reference):
    prompts, want = hf_reference
    # room for about two requests at a time: the others wait, and decode growth forces preemptions
    llm = make_llm(pycode19m, page_size=4, max_running_requests=4, max_total_tokens=360)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert llm.engine.runner.allocator.num_used == llm.engine.scheduler.cached_pages


def test_stop_conditions(make_llm, pycode19m, hf_reference):
    prompts, want = hf_reference
    llm = make_llm(pycode19m, page_size=16)
    tok = llm.tokenizer
    # stop token id: generation ends at the first occurrence, inclusive
    stop_id = want[0][5]
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_NEW, stop_token_ids=(stop_id,)))[0]
    assert out.token_ids == want[0][: want[0].index(stop_id) + 1] and out.finish_reason == "stop"
    # stop string: the text is cut before it
    full = tok.decode(want[1])
    stop = full[8:12]
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=MAX_NEW, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
    # eos ends generation unless ignored
    eos = tok.eos_token_ids[0]
    out = llm.generate([prompts[2]], SamplingParams(max_tokens=MAX_NEW, stop_token_ids=(), ignore_eos=False))[0]
    assert eos not in out.token_ids[:-1]


def test_abort_frees_everything_at_once(make_llm, pycode19m, hf_reference):
    """An aborted request leaves the queues at once; its pages come back as soon as no launched step holds
    them: at once in the synchronous loop, after the step in flight under overlap."""
    prompts, _ = hf_reference
    for overlap in (False, True):
        llm = make_llm(pycode19m, page_size=4, disable_overlap_schedule=not overlap)
        eng = llm.engine
        rid = eng.add_request(prompts[3], SamplingParams(max_tokens=200, ignore_eos=True))
        eng.step()
        eng.step()
        assert eng.runner.allocator.num_used > 0
        eng.abort(rid)
        if overlap:
            assert eng.drain()[0].finish_reason == "abort"  # the step in flight completes, then pages return
        else:
            assert eng.runner.allocator.num_used == eng.scheduler.cached_pages  # no step in flight: freed at once
            outs = eng.step()
            assert outs[0].finish_reason == "abort" and outs[0].finished
        assert eng.runner.allocator.num_used == eng.scheduler.cached_pages and not eng.has_unfinished()


def test_seeded_sampling_is_reproducible_across_batches(make_llm, pycode19m, hf_reference):
    prompts, _ = hf_reference
    llm = make_llm(pycode19m, page_size=16)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = llm.generate([prompts[0]], p)[0].token_ids
    batched = llm.generate([prompts[1], prompts[0], prompts[2]],
                           [SamplingParams(max_tokens=7, temperature=1.0), p, SamplingParams(max_tokens=3)])[1]
    assert alone == batched.token_ids
    other = llm.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.9, seed=99))[0].token_ids
    assert other != alone


def test_text_prompt_and_chat_template(make_llm, pycode19m):
    llm = make_llm(pycode19m)
    out = llm.generate("def fib(n):", SamplingParams(max_tokens=8))[0]
    assert len(out.token_ids) == 8 and isinstance(out.text, str)
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "user" in chat and chat.endswith("assistant\n")


@pytest.mark.parametrize("prompt,params,field", [
    ("", {}, "prompt"),
    ([], {}, "prompt"),
    ([1, 2, -5], {}, "prompt"),
    ("x " * 3000, {}, "prompt"),
    ("def f():", dict(max_tokens=0), "max_tokens"),
    ("def f():", dict(max_tokens=-3), "max_tokens"),
    ("def f():", dict(temperature=-0.5), "temperature"),
    ("def f():", dict(top_p=0.0), "top_p"),
    ("def f():", dict(top_p=1.5), "top_p"),
    ("def f():", dict(top_k=-7), "top_k"),
])
def test_bad_request_is_refused_and_engine_stays_usable(make_llm, pycode19m, prompt, params, field):
    llm = make_llm(pycode19m, context_length=1024)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([prompt, "def ok():"] if not params else prompt, SamplingParams(**params))
    assert e.value.field == field
    assert llm.engine.runner.allocator.num_used == llm.engine.scheduler.cached_pages and not llm.engine.has_unfinished()
    assert len(llm.generate("def ok():", SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_bad_engine_settings(tmp_path, pycode19m):
    from spruce import LLM

    with pytest.raises(ConfigError, match="attention_backend='flash'"):
        LLM(pycode19m, attention_backend="flash")
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(tmp_path / "does-not-exist")
