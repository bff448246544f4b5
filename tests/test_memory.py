"""Page allocator, page table, limits and fix-toggle plumbing."""

import pytest
import torch

from spruce.config import EngineConfig, SpeculativeConfig
from spruce.errors import ConfigError, InvariantError
from spruce.limits import DUMMY_PAGE, Limits
from spruce.memory import KVPool, PageAllocator, PageTable


def limits(**kw) -> Limits:
    base = dict(max_running_requests=4, page_size=4, context_length=64, num_pages=10, chunked_prefill_size=32)
    base.update(kw)
    return Limits(**base)


def test_allocator_never_hands_out_dummy_and_refuses_overflow():
    lim = limits()
    a = PageAllocator(lim)
    pages = a.alloc(9)
    assert DUMMY_PAGE not in pages and sorted(pages) == list(range(1, 10))
    assert a.alloc(1) is None  # queue, not crash
    a.free(pages[:3])
    assert a.num_free == 3
    with pytest.raises(InvariantError, match="not allocated"):
        a.free([pages[0]])
    a.free(pages[3:])
    a.check_accounting(0)


def test_allocator_accounting_detects_leak():
    a = PageAllocator(limits())
    a.alloc(2)
    with pytest.raises(InvariantError, match="leak"):
        a.check_accounting(0)


def test_page_table_rows_and_reset_to_dummy():
    lim = limits()
    pt = PageTable(lim, torch.device("cpu"))
    row = pt.alloc_row()
    pt.append_pages(row, [3, 5])
    assert pt.table[row, :2].tolist() == [3, 5]
    pt.check_covers(row, 8, "test")
    with pytest.raises(InvariantError, match="position 8"):
        pt.check_covers(row, 9, "test")
    with pytest.raises(InvariantError, match="max_pages_per_request"):
        pt.append_pages(row, list(range(100, 100 + lim.max_pages_per_request)))
    assert pt.release_row(row) == [3, 5]
    assert (pt.table == DUMMY_PAGE).all()
    assert [pt.alloc_row() for _ in range(4)] == [0, 1, 2, 3] and pt.alloc_row() is None


def test_batched_page_appends_reach_the_device_together_and_equal_one_by_one():
    """Appends inside PageTable.batched() are written when the block ends (one copy and one scatter) and leave the
    table exactly as the same appends one by one; a read of the table before that fails loudly, and a block that
    raises still writes what the host recorded."""
    import random

    lim = limits(max_running_requests=4, context_length=64)
    rng = random.Random(0)
    one, many = PageTable(lim, torch.device("cpu")), PageTable(lim, torch.device("cpu"))
    rows = [(one.alloc_row(), many.alloc_row()) for _ in range(3)]
    for _ in range(4):
        plan = [(i, [rng.randrange(1, 10) for _ in range(rng.randrange(0, 3))]) for i in range(3)]
        for i, pages in plan:
            one.append_pages(rows[i][0], pages)
        with many.batched():
            for i, pages in plan:
                many.append_pages(rows[i][1], pages)
            if any(pages for _, pages in plan):
                with pytest.raises(InvariantError, match="not on the device yet"):
                    many.check_written("a forward")
        many.check_written("a forward")
        assert torch.equal(one.table, many.table)
    with pytest.raises(RuntimeError, match="boom"):
        with many.batched():
            many.append_pages(rows[0][1], [7])
            raise RuntimeError("boom")
    assert many.table[rows[0][1], len(many.pages(rows[0][1])) - 1].item() == 7
    with pytest.raises(InvariantError, match="entered twice"):
        with many.batched(), many.batched():
            pass


def test_limits_widths_come_from_one_place():
    lim = limits(num_steps=3, eagle_topk=4, num_draft_tokens=70, graph_max_bs=20)
    assert lim.target_scratch_width == 70
    assert lim.draft_scratch_width == 12
    assert lim.mask_words == 2  # 70 nodes need two 64-bit words
    assert lim.lookahead == 4
    assert lim.max_tokens_per_forward == max(32, 4 * 70)
    assert lim.graph_buckets[-1] == 20 and lim.bucket_for(17) == 20 and lim.bucket_for(21) is None
    pool = KVPool(lim, 2, 1, 8, lim.target_scratch_width, torch.float32, torch.device("cpu"))
    assert pool.num_slots == lim.num_page_slots + lim.num_rows * 70
    assert pool.scratch_slots(torch.tensor([1]))[0, 0].item() == lim.num_page_slots + 70


def test_limits_derive_from_config():
    cfg = EngineConfig(model="x", page_size=16, max_running_requests=2, context_length=100)
    lim = Limits.derive(cfg, max_position_embeddings=2048, kv_bytes_per_token=64, kv_budget_bytes=None)
    assert lim.context_length == 100 and lim.num_pages >= 2 * lim.max_pages_per_request
    # the pool holds every running request at its longest, by the same bound every batch is checked against
    # (Limits.kv_capacity: context + the lookahead of the steps in flight, in whole pages), plus the dummy page
    for spec, overlap in ((False, True), (True, True), (True, False)):
        cfg = EngineConfig(model="x", page_size=16, max_running_requests=3, context_length=100,
                           disable_overlap_schedule=not overlap,
                           speculative=SpeculativeConfig("EAGLE3", "d", 5, 4, 8) if spec else None)
        lim = Limits.derive(cfg, max_position_embeddings=2048, kv_bytes_per_token=64, kv_budget_bytes=None)
        assert lim.kv_capacity == lim.max_pages_per_request * 16 >= 100 + lim.lookahead
        assert lim.num_pages == 3 * lim.max_pages_per_request + 1
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        Limits.derive(EngineConfig(model="x", context_length=4096), 2048, 64, None)


@pytest.mark.parametrize("kwargs,match", [
    (dict(page_size=0), "page_size"),
    (dict(attention_backend="flash"), "attention_backend='flash'"),
    (dict(dtype="int8"), "dtype='int8'"),
    (dict(device="tpu"), "device='tpu'"),
    (dict(cuda_graph=True), "cuda_graph=True needs device='cuda'"),
    (dict(max_running_requests=-1), "max_running_requests"),
])
def test_bad_engine_config_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model="x", **kwargs)


@pytest.mark.parametrize("s,k,n,match", [
    (3, 2, 12, r"needs 11 draft candidates.*K \+ \(S-1\)\*K\*K = 10"),
    (5, 8, 200, "exceeds the supported maximum"),
    (0, 4, 8, r"speculative_num_steps=0 is outside \[1, 127\]"),
    (5, 0, 8, "eagle_topk must be >= 1"),
    (5, 4, 1, "num_draft_tokens must be >= 2"),
])
def test_bad_speculative_config_is_refused(s, k, n, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig("EAGLE3", "d", s, k, n)
