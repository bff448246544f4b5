"""Pages that fall out of every window are freed: a tiny random Mistral (every layer slides over WINDOW positions,
shorter than the prompts) generating past several windows, transformers as the oracle.
- greedy tokens == transformers (pages of 1 and 16, overlap on and off) while every decoding request holds about a
  window's worth of pages (the allocator's used count stays bounded);
- freed pages poisoned with NaN (and never handed out again) change nothing: target tokens == transformers, and the
  draft's hidden states, plain and EAGLE-3 tree rounds, equal those of a run that frees nothing;
- the prefix cache: a request's matched pages are never freed under it; a request that freed caches nothing;
- an all-chunked Llama 4 frees behind its chunk (poisoned, greedy == transformers); sliding Qwen2 == transformers;
- WindowReach's arithmetic, and models with a full-attention layer (gpt-oss, Llama 4) free nothing;
- GPU: the Triton kernels, eager and in CUDA graphs, over poisoned freed pages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spruce import SamplingParams
from spruce.limits import DUMMY_PAGE
from spruce.memory.window import WindowReach
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import Attention
from checkpoints import write_eagle3_checkpoint, write_llama_checkpoint
from oracle_draft import install_oracle

transformers = pytest.importorskip("transformers")

WINDOW = 8
PROMPT_LENGTHS = (5, 30)  # the longer one spans two prefill chunks of 16
MAX_NEW = 20  # two windows and more past each prompt
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(target dir, EAGLE-3 head dir, prompts, transformers' greedy continuations)."""
    root = tmp_path_factory.mktemp("window_pages")
    target = write_llama_checkpoint(root / "target", variant="mistral", sliding_window=WINDOW, layers=2, vocab=256)
    draft = write_eagle3_checkpoint(root / "draft", target, draft_vocab_size=128, seed=3, aux_layer_ids=[0, 0, 1])
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    want = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=None)
            want.append(out[0, len(p):].tolist())
    return str(target), str(draft), prompts, want


def engine(make_llm, case, page: int, overlap: bool = True, spec_k: int | None = None, **kw):
    """An engine on the case's target (with an oracle-steered EAGLE-3 head when spec_k is given)."""
    target, draft, prompts, want = case
    if spec_k is not None:
        s, n = {1: (3, 4), 4: (3, 8)}[spec_k]
        kw.update(draft_model=draft, speculative_algorithm="EAGLE3", speculative_num_steps=s,
                  speculative_eagle_topk=spec_k, speculative_num_draft_tokens=n)
    llm = make_llm(target, page_size=page, max_running_requests=4, chunked_prefill_size=16,
                   disable_overlap_schedule=not overlap, **kw)
    if spec_k is not None:
        oracle = install_oracle(llm, 0.6)
        for p, w in zip(prompts, want):
            oracle.add_reference(p, w)
    return llm


def test_every_mistral_layer_slides_and_the_context_is_not_capped(case):
    cfg = ModelConfig.from_dir(case[0])
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [WINDOW] * 2
    assert cfg.max_position_embeddings == 512
    assert WindowReach.of_model(cfg).frees


def window_pages_bound(lim) -> int:
    """Pages a decoding request may hold: its columns from the oldest read position (committed - W + 1) to the
    last reserved one (committed + lookahead - 1)."""
    return lim.pages_for(WINDOW - 1 + lim.lookahead) + 1


def watch_used_pages(llm) -> list[tuple[int, int]]:
    """After every plan while only decoding requests run: (pages the allocator has handed out, the bound for the
    requests running, the pages they would hold without freeing: their columns)."""
    eng = llm.engine
    sched, seen = eng.scheduler, []
    plan = sched.next_step

    def watched():
        planned = plan()
        if sched.running and not sched.prefill_requests():
            used = eng.runner.allocator.num_used - sched.cached_pages
            columns = sum(len(eng.runner.page_table.pages(q.row)) for q in sched.running)
            seen.append((used, len(sched.running) * window_pages_bound(eng.limits), columns))
        return planned

    sched.next_step = watched
    return seen


@pytest.mark.parametrize("page,overlap", [(1, True), (16, False)])
def test_greedy_equals_transformers_in_a_window_of_pages(make_llm, case, page, overlap):
    llm = engine(make_llm, case, page, overlap)
    seen = watch_used_pages(llm)
    assert [o.token_ids for o in llm.generate(case[2], PARAMS)] == case[3]
    assert seen and all(used <= bound for used, bound, _ in seen), seen
    used, _, columns = seen[-1]  # by the end, far fewer than the requests' whole contexts
    assert used * 2 < columns, seen[-1]


class Quarantine:
    """Freed pages are filled with NaN in every pool (target and draft, every layer) and never handed out again
    (given back to the allocator at the end), so any read of one, masked or not, turns an output into NaN."""

    def __init__(self, llm):
        self.eng = llm.engine
        self.pages: list[int] = []
        table = self.eng.runner.page_table
        free_columns = table.free_columns

        def poison(row, start, stop):
            pages = free_columns(row, start, stop)
            self.pages += pages
            ps = self.eng.limits.page_size
            slots = [p * ps + i for p in pages for i in range(ps)]
            for pool in (self.eng.runner.target_kv, self.eng.runner.draft_kv):
                for t in pool.tensors if pool is not None else ():
                    t[:, torch.tensor(slots, dtype=torch.long, device=t.device)] = float("nan")
            return []  # held back from the allocator

        table.free_columns = poison
        allocator = self.eng.runner.allocator
        check = allocator.check_accounting
        allocator.check_accounting = lambda expected_used: check(expected_used + len(self.pages))  # held back

    def release(self) -> None:
        self.eng.runner.allocator.free(self.pages)
        self.pages = []


def draft_hidden(llm) -> list[torch.Tensor]:
    """Every forward output of the (real) draft, in order."""
    outs = []
    draft = llm.engine.runner.draft
    (draft.draft if hasattr(draft, "draft") else draft).register_forward_hook(
        lambda m, args, out: outs.append(out.detach().clone()))
    return outs


def poisoned_run(llm, prompts) -> tuple[list[list[int]], int]:
    """Tokens of `prompts` with freed pages poisoned (Quarantine), and how many pages were freed."""
    quarantine = Quarantine(llm)
    outs = llm.generate(prompts, PARAMS)
    freed = len(quarantine.pages)
    quarantine.release()
    return [o.token_ids for o in outs], freed


def test_poisoned_freed_pages_change_nothing_plain(make_llm, case):
    llm = engine(make_llm, case, 1)
    tokens, freed = poisoned_run(llm, case[2])
    assert tokens == case[3]
    assert freed >= sum(PROMPT_LENGTHS) + 2 * MAX_NEW - 2 * (WINDOW + 6), freed


@pytest.mark.parametrize("page,spec_k,compare_draft", [(1, 4, True), (16, 1, False)])
def test_poisoned_freed_pages_change_nothing_speculative(make_llm, case, page, spec_k, compare_draft):
    """EAGLE-3 tree rounds over poisoned freed pages: tokens == transformers, and (compare_draft) every draft forward
    equals that of a run that frees nothing: the draft, held to the window, never reads a freed position."""
    llm = engine(make_llm, case, page, spec_k=spec_k)
    hidden = draft_hidden(llm)
    tokens, freed = poisoned_run(llm, case[2])
    assert tokens == case[3] and freed > 0
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.2
    if compare_draft:
        kept = engine(make_llm, case, page, spec_k=spec_k)
        kept.engine.scheduler.reach = None  # frees nothing (its draft is held to the window all the same)
        kept_hidden = draft_hidden(kept)
        assert [o.token_ids for o in kept.generate(case[2], PARAMS)] == case[3]
        assert len(hidden) == len(kept_hidden)
        assert all(torch.equal(a, b) for a, b in zip(hidden, kept_hidden))
    draft = llm.engine.runner.draft.draft
    assert {m.window for m in draft.modules() if isinstance(m, Attention)} == {WINDOW}


def test_prefix_cache_pages_stay_under_their_sharers(make_llm, case):
    """A short request (inside the window: frees nothing) caches its prompt's pages; a long one matching them keeps
    them (the cache owns them) while its own pages behind the window are freed, and caches none of its own."""
    target, _, prompts, want = case
    llm = engine(make_llm, case, 4)
    prompt = prompts[-1][:WINDOW + 1]  # 2 full pages, all read by its last query (the last position is recomputed)
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    sched = llm.engine.scheduler
    cached = sched.cached_pages
    assert cached == 2

    seen = []
    plan = sched.next_step

    def watched():
        planned = plan()
        for q in sched.running:
            pages = llm.engine.runner.page_table.pages(q.row)
            seen.append((pages.count(DUMMY_PAGE), pages[:len(q.cached_path)], [n.page for n in q.cached_path]))
        return planned

    sched.next_step = watched
    out = llm.generate([prompts[-1]], PARAMS)[0]
    assert out.token_ids == want[-1] and out.num_cached_tokens == 8
    assert any(freed > 2 for freed, _, _ in seen)  # its own pages went
    assert all(held == path and DUMMY_PAGE not in held for _, held, path in seen)  # the cache's did not
    assert sched.cached_pages == cached  # it freed pages: it adds none


def test_all_chunked_llama4_frees_behind_its_chunk(make_llm, tmp_path):
    """Llama 4 with every layer chunked (rope on all): pages before the current chunk are freed; poisoned, they
    change nothing (greedy == transformers, overlap on, a prompt spanning chunks)."""
    from moe_checkpoints import write_moe_checkpoint

    target = write_moe_checkpoint(tmp_path / "m", "llama4", layers=2, top_k=1, attention_chunk_size=WINDOW,
                                  no_rope_layers=[1, 1], floor_scale=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = torch.randint(2, 256, (19,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        x = torch.tensor([prompt])
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                           eos_token_id=None, pad_token_id=None)[0, len(prompt):].tolist()
    llm = make_llm(str(target), page_size=4, max_running_requests=2, chunked_prefill_size=16)
    assert llm.engine.scheduler.reach is not None and llm.engine.scheduler.reach.chunks == (WINDOW,)
    tokens, freed = poisoned_run(llm, [prompt])
    assert tokens == [want] and freed >= (len(prompt) + MAX_NEW - 2 * WINDOW) // 4


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_triton_poisoned_freed_pages_change_nothing(case, cuda_graph):
    """The Triton kernels (the paged walk starts at the window's first position, in its tile), float32, pages of
    16, eager and in CUDA graphs: with freed pages poisoned, plain greedy and EAGLE-3 trees (K 4, random head)
    equal transformers'."""
    from spruce import LLM

    target, draft, prompts, want = case
    spec = dict(draft_model=draft, speculative_algorithm="EAGLE3", speculative_num_steps=3,
                speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    for kw in ({}, spec):
        llm = LLM(target, device="cuda", attention_backend="triton", dtype="float32", page_size=16,
                  max_running_requests=4, cuda_graph=cuda_graph, **kw)
        tokens, freed = poisoned_run(llm, prompts)
        assert tokens == want and freed > 0, kw
        llm.engine.check_no_leaks()
        del llm
        torch.cuda.empty_cache()


@pytest.mark.parametrize("first_sliding,frees", [(0, True), (1, False)])
def test_sliding_qwen2_equals_transformers(tmp_path, first_sliding, frees):
    """Qwen2 with use_sliding_window: the layers from max_window_layers on slide (all of them: pages are freed;
    one full layer first: none), logits == transformers over prompts longer than the window."""
    from test_models_vs_hf import TOL, logit_diff_vs_hf

    path = write_llama_checkpoint(tmp_path / "m", variant="qwen2", layers=2, use_sliding_window=True,
                                  sliding_window=WINDOW, max_window_layers=first_sliding)
    cfg = ModelConfig.from_dir(path)
    assert [cfg.layer_window(i) for i in range(2)] == [None] * first_sliding + [WINDOW] * (2 - first_sliding)
    assert WindowReach.of_model(cfg).frees == frees and cfg.max_position_embeddings == 512
    assert logit_diff_vs_hf(path) < TOL


def test_window_reach_arithmetic():
    def cfg(types, window=None, chunk=None):
        return SimpleNamespace(num_layers=len(types),
                               layer_window=lambda i: window if types[i] == "sliding_attention" else None,
                               layer_chunk=lambda i: chunk if types[i] == "chunked_attention" else None)

    sliding = WindowReach.of_model(cfg(["sliding_attention"] * 3, window=8))
    assert sliding.frees and sliding.first_read(20) == 13 and sliding.first_read(3) == 0
    assert sliding.with_draft().draft_window == 8 and sliding.with_draft().first_read(20) == 13
    chunked = WindowReach.of_model(cfg(["chunked_attention"] * 2, chunk=8))
    assert chunked.first_read(20) == 16 and chunked.first_read(16) == 16
    assert chunked.with_draft().first_read(20) == 13  # the draft, held to the last 8 positions, reads from 13
    # gpt-oss (sliding and full layers), Llama 4 (chunked and full): one page table serves every layer
    for mixed in (cfg(["sliding_attention", "full_attention"], window=8),
                  cfg(["chunked_attention"] * 3 + ["full_attention"], chunk=8)):
        reach = WindowReach.of_model(mixed)
        assert not reach.frees and reach.first_read(1000) == 0 and reach.with_draft().draft_window is None
    assert not WindowReach.of_model(cfg(["full_attention"])).frees
