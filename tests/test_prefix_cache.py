"""Prefix cache (radix tree over committed full pages, shared by the target's and the draft's KV).

A shared system prompt is computed once (reported as cached tokens); outputs and, with speculation, every
round's accept length equal the run without the cache (so the draft's KV in cached pages is right too);
a page is matched only with its next token (the draft's pair at its last position depends on it); LRU
eviction under memory pressure never leaks or double-frees (every engine is leak-checked, cache included)."""

from __future__ import annotations

import pytest

from spruce import SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.errors import InvariantError
from spruce.limits import Limits
from spruce.memory.page_allocator import PageAllocator
from spruce.memory.prefix_cache import PrefixCache

pytestmark = pytest.mark.slow  # scheduled first (conftest)

SYSTEM = "".join(f"def f{i}(a, b):\n    return a * {i} + b\n\n\n" for i in range(6))
PROMPTS = [SYSTEM + tail for tail in ("def mul(a, b):", "class Point:\n    def __init__(self", "import os\nx = [",
                                      "for i in range(10):")]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def run(make_llm, prompts, one_by_one: bool, **kw):
    llm = make_llm(builtin_model_path(), max_running_requests=4, **kw)
    outs = [o for p in prompts for o in llm.generate([p], PARAMS)] if one_by_one else llm.generate(prompts, PARAMS)
    return llm, outs


SPEC = [dict(), dict(draft_model=str(builtin_draft_path()), speculative_num_steps=3, speculative_eagle_topk=1,
                     speculative_num_draft_tokens=4),
        dict(draft_model=str(builtin_draft_path()), speculative_num_steps=4, speculative_eagle_topk=4,
             speculative_num_draft_tokens=12)]


@pytest.mark.parametrize("spec", SPEC, ids=["plain", "eagle3-K1", "eagle3-K4"])
@pytest.mark.parametrize("page", [1, 16])
def test_shared_prompt_computed_once_outputs_unchanged(make_llm, spec, page):
    if spec and not builtin_draft_path().exists():
        pytest.skip("bundled draft head absent")
    base, want = run(make_llm, PROMPTS, True, page_size=page, disable_radix_cache=True, **spec)
    llm, outs = run(make_llm, PROMPTS, True, page_size=page, **spec)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert outs[0].num_cached_tokens == 0 and all(o.num_cached_tokens == 0 for o in want)
    shared = len(llm.tokenizer.encode(SYSTEM)) - 1
    for o in outs[1:]:  # every later request reuses the system prompt's full pages
        assert shared - 2 * page < o.num_cached_tokens < len(o.prompt_token_ids)
    if spec:  # the draft's KV in cached pages is what it would have computed: same accept lengths
        assert [o.spec_stats["accept_length_counts"] for o in outs] == [
            o.spec_stats["accept_length_counts"] for o in want]
    stats = llm.engine.stats()["prefix_cache"]
    assert stats["hit_tokens"] == sum(o.num_cached_tokens for o in outs) and 0 < stats["hit_rate"] < 1
    assert base.engine.stats()["prefix_cache"] is None


def test_nextn_on_mla_with_prefix_cache(make_llm, pycodemla):
    """MLA latent pages and the MTP layer's own cache, shared through the tree."""
    kw = dict(page_size=16, max_running_requests=4, speculative_algorithm="NEXTN", speculative_num_steps=3,
              speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    plain = make_llm(pycodemla, disable_radix_cache=True, **kw)
    cached = make_llm(pycodemla, **kw)
    want = [o for p in PROMPTS for o in plain.generate([p], PARAMS)]
    got = [o for p in PROMPTS for o in cached.generate([p], PARAMS)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.spec_stats["accept_length_counts"] for o in got] == [o.spec_stats["accept_length_counts"] for o in want]
    assert all(o.num_cached_tokens > 0 for o in got[1:])


def test_eviction_under_memory_pressure(make_llm):
    """A cache too small for all prompts: least recently used pages go, requests still fit, nothing leaks."""
    modules = [f"# module {i}\n" + SYSTEM[: 60 + 40 * i] for i in range(8)]
    # without the cache each prompt decodes alone in an engine holding nothing: the second pass's reference is the
    # first's (8 reference runs for the 16 requests)
    base, want = run(make_llm, modules, True, page_size=4, disable_radix_cache=True, max_total_tokens=240)
    llm, outs = run(make_llm, modules * 2, True, page_size=4, max_total_tokens=240)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want] * 2
    cache = llm.engine.scheduler.prefix_cache
    assert cache.num_pages <= llm.engine.limits.num_pages - 1
    held = cache.num_pages
    assert held > 0 and llm.engine.flush_cache() == held and cache.num_pages == 0


def test_batched_requests_share_and_preempt(make_llm):
    """Requests admitted together (no hits yet), then later ones hitting pages that running requests hold,
    with preemption in a small cache."""
    base, want = run(make_llm, PROMPTS * 2, False, page_size=4, disable_radix_cache=True, max_total_tokens=400)
    llm, outs = run(make_llm, PROMPTS * 2, False, page_size=4, max_total_tokens=400)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def _cache(page_size=2, pages=20):
    lim = Limits(max_running_requests=2, page_size=page_size, context_length=64, num_pages=pages,
                 chunked_prefill_size=64)
    alloc = PageAllocator(lim)
    return PrefixCache(page_size, alloc), alloc


def test_pages_match_only_with_their_next_token():
    cache, alloc = _cache()
    pages = alloc.alloc(3)
    tokens = [1, 2, 3, 4, 5, 6]  # pages [1,2] [3,4] [5,6]; [5,6] has no next token: not cached
    assert cache.release([], tokens, pages, valid=5) == pages[2:]
    assert [n.page for n in cache.match([1, 2, 3, 4, 5, 9])] == pages[:2]
    assert [n.page for n in cache.match([1, 2, 3, 4, 9])] == pages[:1]  # page [3,4] was cached before a 5
    assert cache.match([1, 2, 7, 4]) == []  # page [1,2] was cached with next token 3
    assert cache.match([1, 2]) == []  # at least one token is left to compute


def test_refcounts_lru_and_duplicates():
    cache, alloc = _cache()
    a = alloc.alloc(2)
    assert cache.release([], [1, 2, 3, 4, 5], a, valid=4) == []
    path = cache.match([1, 2, 3, 4, 5])
    cache.lock(path)
    assert cache.evict(5) == 0  # held by a running request
    b = alloc.alloc(2)  # a second request computed the same content into its own pages
    assert cache.release([], [1, 2, 3, 4, 5], b, valid=4) == b  # duplicates: freed
    alloc.free(b)
    cache.release(path, [1, 2, 3, 4, 5], list(a), valid=4)
    with pytest.raises(InvariantError, match="unlock of page"):
        cache.unlock(path)
    c = alloc.alloc(1)
    cache.release([], [9, 9, 9], c, valid=2)  # newer
    assert cache.evict(1) == 1 and alloc.num_used == 2  # the leaf [3,4] of the older path goes first
    assert [n.page for n in cache.match([1, 2, 3, 4, 5])] == a[:1]

