"""Prefill CUDA graphs without CUDA: every prefill whose tokens fit a bucket runs the way its graph replays it
(the batch padded up to the token bucket, one padding request on the dummy row, the captured kv bound), but
eagerly, and must give the same tokens (and the same prompt logprobs) as the plain eager path; plus the
buckets' sizes from Limits and the flag's checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spruce import LLM, SamplingParams
from spruce.cli import build_parser, engine_kwargs
from spruce.config import EngineConfig, builtin_model_path
from spruce.errors import ConfigError, InvariantError
from spruce.limits import Limits
from spruce.runtime.cuda_graph import BucketGraphs
from checkpoints import write_eagle3_checkpoint

TARGET = builtin_model_path()
PROMPTS = ["def fib(n):", "import os\n", "class A:\n    def", "x = [1, 2,", "for i in", "with open("]


def as_if_prefill_graphed(llm, max_tokens: int) -> list[tuple[str, int]]:
    """Make the runner's prefill graphs pad every prefill (and draft extend) of at most `max_tokens` tokens to its
    bucket and run the captured functions (`prefill_phase`, `draft_prefill_phase`) eagerly over it, planned as
    before a replay. Returns the list the (phase, bucket) pairs that ran are appended to."""
    runner = llm.engine.runner
    limits = dataclasses.replace(runner.limits, prefill_graph_max_tokens=max_tokens)
    graphs = BucketGraphs.for_prefill(limits, runner.device, enabled=True)
    graphs.enabled = True  # BucketGraphs enables itself on CUDA only
    ran: list[tuple[str, int]] = []

    def run(name, fn, bucket, max_kv_len, plan=None):
        assert name in ("prefill", "draft_prefill") and bucket in limits.prefill_graph_tokens
        plan(bucket, max_kv_len)
        ran.append((name, bucket))
        with graphs.running(name):
            return fn(bucket, max_kv_len)

    graphs.captured = lambda name, bucket: True
    graphs.run = run
    runner.prefill_graphs = graphs
    return ran


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("d") / "e3", TARGET, seed=2))


@pytest.mark.parametrize("spec", [False, True])
def test_padded_prefill_equals_eager(draft, spec):
    """Several prompts prefilled together (ragged), prefix-cache hits (chunks that start past 0), chunks larger
    than the largest bucket (eager) beside graphed ones: same tokens and prompt logprobs either way."""
    kw = dict(page_size=4, max_running_requests=8, context_length=160, chunked_prefill_size=40)
    if spec:
        kw.update(draft_model=draft, speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    shared = "def f(a, b):\n    return a + b\n\n" * 3
    prompts = PROMPTS + [shared + p for p in PROMPTS[:3]]
    params = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    results = []
    for padded in (False, True):
        llm = LLM(TARGET, **kw)
        ran = as_if_prefill_graphed(llm, max_tokens=32) if padded else []
        outs = [o for batch in (prompts[:4], prompts[4:5], prompts[5:], PROMPTS[5:])
                for o in llm.generate(batch, params)]
        results.append([(o.token_ids, [list(d.items()) if d else d for d in o.prompt_logprobs]) for o in outs])
        llm.engine.check_no_leaks()
        if padded:
            # graphed prefills of both sizes ran (and with a draft its extends); the 40-token chunks ran eagerly
            phases = ("prefill", "draft_prefill") if spec else ("prefill",)
            assert set(ran) == {(phase, bucket) for phase in phases for bucket in (16, 32)}
    (want, got) = results
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp_got), (_, lp_want) in zip(got, want):
        for g, w in zip(lp_got, lp_want):
            assert (g is None) == (w is None)
            if g is not None:
                assert [k for k, _ in g] == [k for k, _ in w]
                assert [v.logprob for _, v in g] == pytest.approx([v.logprob for _, v in w], abs=1e-4)


def test_padded_prefill_equals_eager_triton():
    """The triton backend's kernels (under the interpreter) over the padded layout a graph captures: one prompt
    alone, then two together, the second past a cached prefix."""
    kw = dict(page_size=4, max_running_requests=4, context_length=64, attention_backend="triton")
    batches = [PROMPTS[:1], [PROMPTS[1], PROMPTS[0] + " return"]]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    runs = []
    for padded in (False, True):
        llm = LLM(TARGET, **kw)
        ran = as_if_prefill_graphed(llm, max_tokens=16) if padded else []
        runs.append([o.token_ids for batch in batches for o in llm.generate(batch, params)])
    assert runs[1] == runs[0] and ("prefill", 16) in ran


def test_padded_batch_layout():
    """extend(pad_to=T): the padding request (dummy row) owns tokens n..T, which write the dummy page and attend
    to nothing; requests past it are empty; the batch is the one padded_extend describes."""
    llm = LLM(TARGET, page_size=4, max_running_requests=4, context_length=64)
    runner = llm.engine.runner
    builder, lim = runner.builder, runner.limits
    row = runner.page_table.alloc_row()
    runner.page_table.append_pages(row, runner.allocator.alloc(2))
    batch = builder.extend([row], [2], [[5, 6, 7]], pad_to=16)
    assert (batch.batch_size, batch.num_tokens, batch.max_q_len) == (5, 16, 16)
    assert batch.layout == builder.padded_extend(16, lim.kv_capacity).layout
    assert batch.req_rows.tolist() == [row, lim.dummy_row, lim.dummy_row, lim.dummy_row, lim.dummy_row]
    assert batch.qo_indptr.tolist() == [0, 3, 16, 16, 16, 16]
    assert batch.positions[:3].tolist() == [2, 3, 4] and batch.kv_lens[:3].tolist() == [3, 4, 5]
    assert batch.token_rows[3:].tolist() == [lim.dummy_row] * 13
    assert batch.kv_lens[3:].tolist() == [0] * 13 and batch.out_slots[3:].tolist() == [0] * 13
    with pytest.raises(InvariantError, match="do not fit a padded batch of 16 tokens"):
        builder.extend([row], [0], [list(range(17))], pad_to=16)
    runner.allocator.free(runner.page_table.release_row(row))


@pytest.mark.parametrize("page,pad_to", [(4, None), (4, 64), (1, 64), (16, None)])
def test_prefill_slots_made_on_the_host_equal_the_page_table_lookup(page, pad_to):
    """A prefill's page slots and kv lengths, made on the host from the rows' pages (`PageTable.slots`), are what
    the device table's lookup gives (`paged_slots`, kv = position + 1), chunks crossing pages and starting
    mid-page; padded, the padding tokens and a dummy-row chunk (warm_eager's) write slot 0 and attend to nothing,
    unpadded the dummy row's positions map into the dummy page; tree masks are cleared."""
    from spruce.runtime.batch_builder import paged_slots

    llm = LLM(TARGET, page_size=page, max_running_requests=4, context_length=64)
    runner = llm.engine.runner
    builder, lim = runner.builder, runner.limits
    rows = [runner.page_table.alloc_row() for _ in range(2)]
    for row, positions in zip(rows, (23, 41)):
        runner.page_table.append_pages(row, runner.allocator.alloc(lim.pages_for(positions)))
    builder.tree_mask.fill_(-1)
    chunk_rows, starts, lens = [rows[0], lim.dummy_row, rows[1]], [3, 5, 17], [20, 6, 24]
    builder.extend(chunk_rows, starts, [[7] * n for n in lens], pad_to=pad_to)
    n = sum(lens)
    token_rows = torch.tensor([r for r, m in zip(chunk_rows, lens) for _ in range(m)])
    positions = torch.tensor([s + j for s, m in zip(starts, lens) for j in range(m)])
    want_slots = paged_slots(runner.page_table.table, token_rows, positions, page)
    want_kv = positions + 1
    if pad_to is not None:
        dummy = token_rows == lim.dummy_row
        want_slots, want_kv = want_slots.masked_fill(dummy, 0), want_kv.masked_fill(dummy, 0)
    total = n if pad_to is None else pad_to
    assert builder.out_slots[:n].tolist() == want_slots.tolist()
    assert builder.kv_lens[:n].tolist() == want_kv.tolist()
    assert builder.out_slots[n:total].abs().sum() == 0 and builder.kv_lens[n:total].abs().sum() == 0
    assert builder.tree_mask[:total].abs().sum() == 0
    for row in rows:
        runner.allocator.free(runner.page_table.release_row(row))


def test_prefill_buckets_from_limits():
    def limits(max_tokens, chunk=2048, r=64):
        return Limits(max_running_requests=r, page_size=16, context_length=4096, num_pages=64,
                      chunked_prefill_size=chunk, prefill_graph_max_tokens=max_tokens)

    assert limits(256).prefill_graph_tokens == (16, 32, 48, 64, 96, 128, 192, 256)
    assert limits(100).prefill_graph_tokens == (16, 32, 48, 64, 96, 100)
    assert limits(8).prefill_graph_tokens == (8,)
    assert limits(0).prefill_graph_tokens == ()
    lim = limits(256)
    assert [lim.prefill_bucket_for(n) for n in (1, 16, 17, 65, 200, 256, 257)] == [16, 16, 32, 96, 256, 256, None]
    assert (lim.prefill_graph_rows(16), lim.prefill_graph_rows(256)) == (17, 65)
    assert limits(0).prefill_bucket_for(1) is None


def test_prefill_graph_flag():
    """The flag reaches the config; it is capped by the chunk size; graphs stay off on CPU; bad values fail."""
    args = build_parser().parse_args(["generate", "--model", str(TARGET), "--prompt", "x",
                                      "--cuda-graph-max-prefill-tokens", "64"])
    assert engine_kwargs(args)["cuda_graph_max_prefill_tokens"] == 64
    cfg = EngineConfig(model=str(TARGET), cuda_graph_max_prefill_tokens=512, chunked_prefill_size=128)
    object.__setattr__(cfg, "cuda_graph", True)  # as on a GPU (the check runs at construction)
    lim = Limits.derive(cfg, 1024, 64, None)
    assert lim.prefill_graph_max_tokens == 128 and lim.prefill_graph_tokens[-1] == 128
    llm = LLM(TARGET, max_running_requests=2, context_length=64)
    assert llm.engine.info()["prefill_graph_tokens"] == "off"
    assert not llm.engine.runner.prefill_graphs.enabled
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="cuda_graph_max_prefill_tokens must be an integer >= 0"):
            EngineConfig(model=str(TARGET), cuda_graph_max_prefill_tokens=bad)
    assert torch.cuda.is_available() or LLM(TARGET, cuda_graph_max_prefill_tokens=0, context_length=64).engine


def test_padded_prefill_equals_eager_mla(pycodemla):
    """The DeepSeek-V3 fixture (MLA latent attention, MoE): padded prefills give the same tokens."""
    kw = dict(page_size=4, max_running_requests=4, context_length=96, chunked_prefill_size=24)
    prompts = ["def add(a, b):\n    return", "import sys\nfor line in sys.stdin:\n    print(line.strip())\n# end"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in LLM(pycodemla, **kw).generate(prompts, params)]
    llm = LLM(pycodemla, **kw)
    ran = as_if_prefill_graphed(llm, max_tokens=16)
    got = [o.token_ids for o in llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)]
    assert got == want and ("prefill", 16) in ran

