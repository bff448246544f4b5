"""The eager warm-up at start-up (DecodeStrategy.warm_eager): it reaches every compiled variant of the attention
kernels that a served prompt can meet, it changes no output, and on the GPU nothing is compiled
after it while serving a mixed workload."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random

import pytest
import torch

from spruce import LLM, SamplingParams
from spruce.attention.triton_backend import TritonAttention
from spruce.config import builtin_model_path
from spruce.limits import Limits
from spruce.ops import compile_watch
from spruce.runtime.strategy import WARM_FAR, warm_spans
from checkpoints import write_eagle3_checkpoint
from conftest import assert_no_leaks
from test_adaptive import DRAFT_19M, forced
from test_overlap import PROMPTS

pytestmark = pytest.mark.slow  # scheduled first (conftest)

TARGET = builtin_model_path()


@functools.cache
def _engine_limits() -> Limits:
    """Limits of the bundled model's engine (one engine built for every test of the module)."""
    return LLM(TARGET, max_running_requests=4).engine.limits


def _limits(context_length: int, chunked_prefill_size: int) -> Limits:
    """Limits of the bundled model's engine, with the context and per-forward budget given."""
    return dataclasses.replace(_engine_limits(), context_length=context_length,
                               chunked_prefill_size=chunked_prefill_size)


@pytest.fixture(scope="module")
def limits() -> Limits:
    return _limits(4096, 2048)


def _variants_met(limits: Limits, sms: int, blocking) -> set[tuple]:
    """The compiled variant of each warm-up forward, as the Triton backend on a GPU of `sms` SMs chooses it:
    `blocking(backend, batch_size, max_q_len, max_kv_len)` gives (what names the variant..., splits) -> (what
    names it..., split or not)."""
    backend = TritonAttention(limits.page_size, limits)
    backend._sms = sms
    met = set()
    for spans in warm_spans(limits):
        chosen = blocking(backend, len(spans), max(n for _, n in spans), max(start + n for start, n in spans))
        met.add((*chosen[:-1], chosen[-1] > 1))
    return met


@pytest.mark.parametrize("sms,heads,kv_heads", [(132, 6, 6), (132, 32, 8), (78, 8, 2), (4, 6, 2), (132, 64, 8)])
def test_warm_spans_meet_every_paged_kernel_variant(limits, sms, heads, kv_heads):
    """Each (packed or not, query block, kv split or not) variant the paged kernel can be compiled in for a
    prefill is met by one of the warm-up's forwards (its batch's shape), on GPUs of many or few SMs and models
    of few or many heads: grouped-query models pack the query heads of chunks of at most 16 tokens (16 or 32
    rows a block) and run longer chunks in 32-token blocks; models without grouping, 16 or 32 tokens."""
    def blocking(backend, bs, max_q, max_kv):
        pack, block, _, splits = backend.paged_blocking(bs, max_q, max_kv, heads, kv_heads, torch.device("cpu"))
        return pack, block, splits

    met = _variants_met(limits, sms, blocking)
    packed = {(True, block, split) for block in (16, 32) for split in (False, True)}
    per_head = {(False, block, split) for block in ((32,) if heads > kv_heads else (16, 32))
                for split in (False, True)}
    assert met == (packed if heads > kv_heads else set()) | per_head


@pytest.mark.parametrize("sms,heads", [(132, 16), (132, 128), (78, 16)])
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_warm_spans_meet_every_latent_kernel_variant(limits, sms, heads, fp8_cache):
    """The same for MLA's kernel: its row block (16 or 64 rows; 16 over an FP8 cache) and kv split."""
    met = _variants_met(limits, sms, lambda backend, bs, max_q, max_kv: backend.latent_blocking(
        bs, max_q, max_kv, heads, torch.device("cpu"), fp8_cache=fp8_cache)[::3])  # (block, splits)
    want = {(64, False), (64, True), (16, True), (16, False)} if heads < 64 else {(64, False), (64, True)}
    assert met == ({(16, True), (16, False)} if fp8_cache else want)


def test_warm_spans_stay_within_the_limits():
    """Short contexts and small per-forward budgets bound the spans: every forward fits the budget and every
    position the context."""
    for context, budget in [(4096, 2048), (512, 2048), (96, 48), (20, 16)]:
        lim = _limits(context, budget)
        spans = warm_spans(lim)
        assert spans and all(sum(n for _, n in batch) <= lim.max_tokens_per_forward for batch in spans)
        assert all(len(batch) <= lim.max_running_requests for batch in spans)
        assert all(0 <= start and start + n <= context for batch in spans for start, n in batch)
        assert max(start for batch in spans for start, _ in batch) == max(min(WARM_FAR, context - min(
            64, lim.max_tokens_per_forward)), 0)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("drafts") / "eagle3", TARGET, seed=4))


@pytest.mark.parametrize("kind", ["plain", "eagle3", "adaptive"])
def test_warm_eager_changes_no_output(draft, kind):
    """Run on the CPU (where the engine skips it: nothing compiles there) between the steps of requests in flight,
    the warm-up changes no state a request reads (only the dummy row's and the dummy page's) and no output, greedy
    or sampled, and leaks no page."""
    kw = dict(page_size=4, max_running_requests=4)
    if kind != "plain":
        kw |= dict(draft_model=draft, speculative_adaptive=kind == "adaptive")
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3)]
    want = [[o.token_ids for o in LLM(TARGET, **kw).generate(PROMPTS, p)] for p in params]
    llm = LLM(TARGET, **kw)
    engine = llm.engine
    for p, expected in zip(params, want):
        ids = [engine.add_request(prompt, p) for prompt in PROMPTS]
        done = {}
        for step in itertools.count():
            if step in (1, 3):  # with every request in flight (a warm-up costs as much as several steps)
                before = _live_state(engine)
                engine.strategy.warm_eager()
                assert all(torch.equal(a, b) for a, b in zip(before, _live_state(engine), strict=True))
            done |= {o.request_id: o.token_ids for o in engine.step(finished_only=True)}
            if not engine.has_unfinished():
                break
        assert [done[i] for i in ids] == expected
    assert_no_leaks(llm)


def _live_state(engine) -> list[torch.Tensor]:
    """Copies of everything a request's decoding reads, less the dummy row's entries and the dummy page's slots:
    row states, both KV pools and the draft's step-0 state (those the strategy has)."""
    runner, lim = engine.runner, engine.limits
    rows = torch.arange(lim.num_rows, device=runner.device) != lim.dummy_row
    state = [runner.row_state.committed[rows], runner.row_state.last_token[rows]]
    for pool in (runner.target_kv, runner.draft_kv):
        if pool is None:
            continue
        slots = torch.ones(pool.num_slots, dtype=torch.bool, device=runner.device)
        slots[:lim.page_size] = False  # the dummy page
        dummy_scratch = pool.scratch_start + lim.dummy_row * pool.scratch_width
        slots[dummy_scratch:dummy_scratch + pool.scratch_width] = False
        state += [t[:, slots] for t in pool.tensors]
    worker = getattr(engine.strategy, "worker", engine.strategy)
    return state + [getattr(worker, name)[rows] for name in ("topk_p", "topk_ids", "hidden") if hasattr(worker, name)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["plain", "eagle3", "adaptive"])
def test_serving_compiles_nothing_after_start_up(monkeypatch, pycode19m, heldout_prompts, kind):
    """On the GPU (bf16, graphs, prefix cache): once an engine is built, a mixed workload compiles no Triton
    kernel: prompts of 1 to ~1500 tokens, a shared 1k prefix (cache hits: short chunks far into the context),
    batches of 1 to 16, and for adaptive speculation switches forced both ways."""
    compiled: list[str] = []
    llm_kw = dict(device="cuda", dtype="bfloat16", max_running_requests=16)
    if kind != "plain":
        llm_kw |= dict(draft_model=str(DRAFT_19M), speculative_adaptive=kind == "adaptive")
    llm = LLM(pycode19m, **llm_kw)
    if not compile_watch.install():
        pytest.skip("Triton's compile hook is unavailable")
    monkeypatch.setattr(compile_watch, "_record", compiled.append)
    if kind == "adaptive":
        n = llm.engine.limits.num_draft_tokens
        forced(llm, [n if c else 0 for c in [1, 0, 0, 0, 1, 0, 1, 1, 0]])
    rng = random.Random(0)
    tokenizer = llm.engine.tokenizer
    prefix = tokenizer.encode("\n".join(heldout_prompts))[:1024]
    prompts = [tokenizer.encode(p)[:rng.choice([1, 3, 17, 40, 200, 700, 1500])] for p in heldout_prompts[:24]]
    prompts = [p for p in prompts if p] + [prefix + tokenizer.encode(p)[:n] for p, n in
                                           zip(heldout_prompts[24:40], itertools.cycle([1, 9, 16, 33, 256]))]
    for batch in (prompts[:1], prompts[1:4], prompts[4:20], prompts[20:], prompts):
        llm.generate(batch, SamplingParams(max_tokens=rng.choice([8, 40, 70]), ignore_eos=True))
    assert compiled == [], f"{len(compiled)} kernels compiled while serving:\n" + "\n".join(compiled)
    assert_no_leaks(llm)
