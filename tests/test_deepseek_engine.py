"""The whole engine on a DeepSeek-V3-architecture target (the pycode-mla fixture: MLA + MoE, trained):
greedy equals transformers on held-out prompts for every page size; EAGLE-3 tree speculation (a random head
steered by the oracle so every accept length runs) equals plain greedy for K in {1, 4, 8} x page {1, 16, 64},
with requests joining mid-flight and under preemption; no page leaks (make_llm checks every engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spruce import SamplingParams
from checkpoints import write_eagle3_checkpoint
from conftest import generate_joining, hf_greedy
from oracle_draft import install_oracle

PROMPT_TOKENS = [37, 90, 11, 150]
MAX_NEW = 16


@pytest.fixture(scope="module")
def target(pycodemla):
    return str(pycodemla)


@pytest.fixture(scope="module")
def reference(target):
    """Held-out prompts (token ids) and transformers' float32 greedy continuations."""
    texts = [json.loads(line)["text"] for line in (Path(target) / "heldout_prompts.jsonl").read_text().splitlines()]
    return hf_greedy(target, texts, PROMPT_TOKENS, MAX_NEW)


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("d") / "eagle3", target, draft_vocab_size=2048, seed=3))


PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_greedy_equals_transformers(make_llm, target, reference, page_size):
    prompts, want = reference
    llm = make_llm(target, page_size=page_size, max_running_requests=4, chunked_prefill_size=64)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == want


def spec_llm(make_llm, target, draft, reference, k, page, oracle=0.6, **kw):
    s, n = {1: (3, 4), 4: (3, 8), 8: (2, 16)}[k]
    llm = make_llm(target, page_size=page, draft_model=draft, speculative_algorithm="EAGLE3",
                   speculative_num_steps=s, speculative_eagle_topk=k, speculative_num_draft_tokens=n, **kw)
    o = install_oracle(llm, oracle)
    for p, w in zip(*reference):
        o.add_reference(p, w)
    return llm


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_spec_greedy_equals_plain(make_llm, target, draft, reference, k, page):
    prompts, want = reference
    llm = spec_llm(make_llm, target, draft, reference, k, page, max_running_requests=4)
    outs = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == want
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.2


def test_spec_joining_mid_flight_and_preemption(make_llm, target, draft, reference):
    """page 4 + topk 8 with a cache too small for all four requests: later requests join mid-flight and the
    youngest running ones get preempted and recomputed."""
    prompts, want = reference
    llm = spec_llm(make_llm, target, draft, reference, 8, 4, oracle=0.8, max_running_requests=3,
                   max_total_tokens=180)
    eng = llm.engine
    done = generate_joining(eng, prompts, PARAMS)
    assert done == dict(enumerate(want))
    assert eng.stats()["preemptions"] > 0
