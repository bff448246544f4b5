"""The CUDA-graph path without CUDA: run every phase the way a graph replays it (padded to the bucket,
captured kv bound, dummy rows) but eagerly, and require the same tokens as the plain eager path."""

from __future__ import annotations

import dataclasses

import pytest

from spruce import LLM, SamplingParams
from spruce.config import builtin_model_path
from checkpoints import write_eagle3_checkpoint
from oracle_draft import install_oracle

TARGET = builtin_model_path()
PROMPTS = ["def fib(n):", "import os\n", "class A:\n    def", "x = [1, 2,", "for i in", "with open("]


def as_if_graphed(llm, buckets=(2, 4, 8)):
    """Make BucketGraphs pad to a bucket and run each phase as captured: plan, then fn(bucket, kv_bound)."""
    graphs = llm.engine.runner.graphs
    graphs.enabled = True
    graphs.limits = dataclasses.replace(graphs.limits, graph_max_bs=max(buckets))

    def run(name, fn, bs, max_kv_len, *previous, plan=None):
        bucket = graphs.bucket(bs)
        rows, kv = (bucket, graphs.kv_bound) if bucket else (bs, max_kv_len)
        if plan is not None:  # the backend is planned for the padded batch, as before a capture or replay
            plan(rows, kv)
        with graphs.running(name):  # the phase's forwards must match that plan
            return fn(rows, kv, *previous)

    graphs.run = run
    return graphs


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("d") / "e3", TARGET, seed=2))


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("bs", [1, 3, 6])
def test_padded_graph_path_equals_eager(draft, spec, bs):
    kw = dict(page_size=4, max_running_requests=8, context_length=128)
    if spec:
        kw.update(draft_model=draft, speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    eager = LLM(TARGET, **kw)
    want = [o.token_ids for o in eager.generate(PROMPTS[:bs], params)]
    padded = LLM(TARGET, **kw)
    as_if_graphed(padded)
    if spec:
        for llm in (padded,):
            o = install_oracle(llm, 0.8)
            for p, w in zip(PROMPTS[:bs], want):
                o.add_reference(llm.tokenizer.encode(p), w)
    got = [o.token_ids for o in padded.generate(PROMPTS[:bs], params)]
    assert got == want
    padded.engine.check_no_leaks()
    assert padded.engine.runner.allocator.num_used == padded.engine.scheduler.cached_pages
