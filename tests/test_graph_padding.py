"""The CUDA-graph path without CUDA: run every decode-time phase the way a graph replays it (padded to the bucket,
captured kv bound, dummy rows) but eagerly, and require the same tokens as the plain eager path, and, speculating
with the trained EAGLE-3 head (no oracle), the same accept lengths: the target's verification makes tokens immune to
a corrupted draft, so only the accept lengths show draft-side damage done by padding."""

from __future__ import annotations

import dataclasses

import pytest

from spruce import LLM, SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.runtime.cuda_graph import BucketGraphs

TARGET = builtin_model_path()
PROMPTS = ["def fib(n):", "import os\n", "class A:\n    def", "x = [1, 2,", "for i in", "with open("]
MAX_TOKENS = [8, 11, 6, 9, 12, 7]  # unequal: the batch shrinks as requests finish, crossing buckets


def as_if_graphed(llm, graph_max_bs: int = 8) -> list[tuple[str, int, int]]:
    """Give the runner BucketGraphs that pad every decode-time phase to its bucket (Limits.graph_buckets up to
    `graph_max_bs`) and run the phase as a replay runs it: planned for the bucket's rows and the captured kv bound,
    then fn(bucket, kv_bound). Returns the list each run's (phase, real batch size, rows run) is appended to."""
    runner = llm.engine.runner
    limits = dataclasses.replace(runner.limits, graph_max_bs=graph_max_bs)
    graphs = BucketGraphs(limits, runner.device, enabled=False)
    graphs.enabled = True  # BucketGraphs enables itself on CUDA only
    ran: list[tuple[str, int, int]] = []

    def run(name, fn, bs, max_kv_len, *previous, plan=None):
        bucket = graphs.bucket(bs)
        assert bucket is not None and bucket >= bs
        for prev in previous:  # a replayed phase reads its predecessor's output made for the bucket's rows
            assert getattr(prev, "batch_rows", bucket) == bucket
        if plan is not None:  # the backend is planned for the padded batch, as before a capture or replay
            plan(bucket, graphs.kv_bound)
        ran.append((name, bs, bucket))
        with graphs.running(name):  # the phase's forwards must match that plan
            return fn(bucket, graphs.kv_bound, *previous)

    graphs.run = run
    runner.graphs = graphs
    return ran


def generate(padded: bool, spec: bool, bs: int):
    """(token ids, accept length counts) per request, and the padded runs' log."""
    kw = dict(page_size=4, max_running_requests=8, context_length=64)
    if spec:
        kw.update(draft_model=str(builtin_draft_path()), speculative_num_steps=3, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=8)
    llm = LLM(TARGET, **kw)
    ran = as_if_graphed(llm) if padded else []
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS[:bs]]
    outs = llm.generate(PROMPTS[:bs], params)
    llm.engine.check_no_leaks()
    assert llm.engine.runner.allocator.num_used == llm.engine.scheduler.cached_pages
    return [(o.token_ids, (o.spec_stats or {}).get("accept_length_counts")) for o in outs], ran


@pytest.mark.parametrize("spec", [False, True])
def test_padded_graph_path_equals_eager(spec):
    """Six requests of unequal lengths: the batch of 6 (and of 5, 3, as requests finish) runs padded to 8 (8, 4)."""
    want, _ = generate(False, spec, len(PROMPTS))
    got, ran = generate(True, spec, len(PROMPTS))
    assert got == want
    assert {name for name, _, _ in ran} == ({"draft", "verify", "extend"} if spec else {"decode"})
    assert (6, 8) in {(real, rows) for _, real, rows in ran}  # padding rows ran
    if spec:
        assert sum(sum(counts[1:]) for _, counts in got) > 0  # the trained head's drafts are accepted
