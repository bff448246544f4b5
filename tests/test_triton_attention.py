"""The triton backend equals the torch reference on every phase shape (CPU: Triton's interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from spruce.attention.metadata import ForwardBatch, Phase  # noqa: E402
from spruce.attention.torch_backend import TorchAttention  # noqa: E402
from spruce.attention.triton_backend import MAX_SPLITS, TritonAttention  # noqa: E402
from spruce.speculative.tree import ancestor_masks  # noqa: E402

pytestmark = pytest.mark.slow  # scheduled first (conftest)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_tree_parents(n: int, g) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def make_case(phase: Phase, bs: int, q_len: int, kv_lens: list[int], page_size: int, width: int,
              heads: int, kv_heads: int, head_dim: int, dtype, seed: int = 0, max_pages: int = 64):
    """Random pools, a shuffled page table and a ForwardBatch for one phase."""
    g = torch.Generator().manual_seed(seed)
    rows = bs + 1
    num_pages = 1 + sum(-(-(kv + q_len) // page_size) for kv in kv_lens) + 2
    pages = torch.randperm(num_pages - 1, generator=g) + 1
    table = torch.zeros(rows, max_pages, dtype=torch.int32)
    used = 0
    for r, kv in enumerate(kv_lens):
        n = -(-(kv + q_len) // page_size)
        table[r, :n] = pages[used:used + n].to(torch.int32)
        used += n
    scratch_start = num_pages * page_size
    slots = scratch_start + rows * width
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
    t = bs * q_len
    words = max(1, -(-width // 64))
    if phase == Phase.EXTEND:  # causal over new tokens at positions kv .. kv + q_len - 1
        positions = torch.cat([torch.arange(kv, kv + q_len) for kv in kv_lens])
        tok_kv = positions + 1
        mask = torch.zeros(t, words, dtype=torch.int64)
        token_rows = torch.arange(bs).repeat_interleave(q_len)
        page = table[token_rows, positions // page_size].long()
        out_slots = page * page_size + positions % page_size
    else:  # scratch phases: prefix = kv, tokens in scratch entries 0..q_len-1 with ancestor masks
        token_rows = torch.arange(bs).repeat_interleave(q_len)
        tok_kv = torch.tensor(kv_lens, dtype=torch.long).repeat_interleave(q_len)
        if width:
            parents = torch.tensor([random_tree_parents(q_len, g) for _ in range(bs)])
            mask = ancestor_masks(parents, words, q_len).reshape(t, words)
            out_slots = scratch_start + token_rows * width + torch.arange(q_len).repeat(bs)
        else:
            mask = torch.zeros(t, words, dtype=torch.int64)
            positions = tok_kv.clone()
            page = table[token_rows, positions // page_size].long()
            out_slots = page * page_size + positions % page_size
            tok_kv = tok_kv + 1
    dev = DEVICE
    batch = ForwardBatch(
        phase=phase, batch_size=bs, num_tokens=t, input_ids=torch.zeros(t, dtype=torch.int64, device=dev),
        positions=torch.zeros(t, dtype=torch.int64, device=dev), out_slots=out_slots.long().to(dev),
        token_rows=token_rows.long().to(dev), kv_lens=tok_kv.to(torch.int32).to(dev), tree_mask=mask.to(dev),
        req_rows=torch.arange(bs, dtype=torch.int64, device=dev),
        qo_indptr=torch.arange(0, t + 1, q_len, dtype=torch.int32, device=dev)[: bs + 1] if q_len else
        torch.zeros(bs + 1, dtype=torch.int32, device=dev),
        max_kv_len=int(tok_kv.max()) if t else 0, scratch_width=width if phase != Phase.EXTEND else 0,
        max_q_len=q_len,
    )
    # q, k, v are strided views of one fused qkv output, as the model layers hand them over
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(dev)
    q, k, v = (x.view(t, h, head_dim) for x, h in zip(
        qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1), (heads, kv_heads, kv_heads)))
    return q, k, v, k_cache.to(dev), v_cache.to(dev), scratch_start, batch, table.to(dev)


def compare(case, page_size: int, tol: float, splits: int | None = None):
    q, k, v, kc, vc, start, batch, table = case
    ref_k, ref_v = kc.clone(), vc.clone()
    ref = TorchAttention(page_size).forward(q, k, v, ref_k, ref_v, start, batch, table, q.shape[-1] ** -0.5)
    fast = TritonAttention(page_size)
    if splits is not None:
        fast.num_splits = lambda *a: splits
    out = fast.forward(q, k, v, kc, vc, start, batch, table, q.shape[-1] ** -0.5)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), "KV store differs"
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    assert err < tol, err
    return err


SMALL = dict(heads=4, kv_heads=2, head_dim=16, dtype=torch.float32)


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_extend_prefill_causal(page_size):
    compare(make_case(Phase.EXTEND, 2, 5, [0, 7], page_size, 0, **SMALL), page_size, 1e-4)


@pytest.mark.parametrize("page_size,width", [(1, 8), (4, 20), (64, 70)])
def test_verify_tree_with_prefix(page_size, width):
    case = make_case(Phase.VERIFY, 3, min(width, 18), [9, 0, 33], page_size, width, **SMALL, seed=2)
    compare(case, page_size, 1e-4)


def test_decode_and_split_kv():
    """Any split count runs the one compiled kernel (a runtime argument, not a specialisation), powers of two or
    not, up to MAX_SPLITS."""
    case = make_case(Phase.DECODE, 2, 1, [40, 75], 4, 0, **SMALL, seed=3)
    compare(case, 4, 1e-4)
    for splits in (3, 4, MAX_SPLITS):
        compare(case, 4, 1e-4, splits=splits)


def test_draft_decode_scratch_only_tokens():
    """kv_len 0 (nothing committed yet) but scratch bits set: attends to its ancestors only."""
    compare(make_case(Phase.DRAFT_DECODE, 2, 4, [0, 0], 16, 12, **SMALL, seed=4), 16, 1e-4)


@pytest.mark.parametrize("phase,q_len,width", [(Phase.DECODE, 1, 0), (Phase.VERIFY, 4, 6)])
def test_heads_narrower_than_a_dot_tile(monkeypatch, phase, q_len, width):
    """A head of 8 values (a tiny draft's) runs in tiles of tl.dot's smallest width, 16, masked past 8 (the device
    refuses a dot over 8: the interpreter would not), and equals torch."""
    import spruce.attention.triton_backend as tb

    widths = []
    for name in ("paged_attention_kernel", "grouped_decode_kernel"):
        kernel = getattr(tb, name)
        monkeypatch.setattr(tb, name, type("Spy", (), {"__getitem__": lambda self, grid, kernel=kernel: (
            lambda *a, **kw: (widths.append(kw["BLOCK_D"]), kernel[grid](*a, **kw)))})())
    case = make_case(phase, 2, q_len, [21, 5], 4, width, heads=4, kv_heads=2, head_dim=8, dtype=torch.float32,
                     seed=6)
    compare(case, 4, 1e-4)
    assert widths == [16]



VERIFY_6, VERIFY_16 = (Phase.VERIFY, 6, 8, [30, 0, 41]), (Phase.VERIFY, 16, 16, [9, 40])
PACKED_CASES = [(8, 2, *case, splits) for case in (VERIFY_6, VERIFY_16, (Phase.DRAFT_DECODE, 4, 12, [0, 5]),
                                                  (Phase.EXTEND, 5, 0, [0, 7])) for splits in (None, 3)]
PACKED_CASES += [(6, 2, *VERIFY_16, None), (8, 1, *VERIFY_6, 3), (4, 4, *VERIFY_6, None)]


def spy_paged_launches(monkeypatch, tb) -> list:
    """(grid, PACK_GQA, BLOCK_M) of each paged_attention_kernel launch from here on (the kernel still runs)."""
    launches = []
    kernel = tb.paged_attention_kernel
    monkeypatch.setattr(tb, "paged_attention_kernel", type("Spy", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: (launches.append((grid, kw["PACK_GQA"], kw["BLOCK_M"])), kernel[grid](*a, **kw)))})())
    return launches


@pytest.mark.parametrize("heads,kv_heads,phase,q_len,width,kv,splits", PACKED_CASES)
def test_packed_gqa_rows_equal_torch(monkeypatch, heads, kv_heads, phase, q_len, width, kv, splits):
    """Requests of at most PACK_GQA_MAX_Q_LEN tokens under grouped-query attention run the paged kernel with a kv
    head's query heads as rows (PACK_GQA: a grid of kv heads, rows = tokens x GROUP in blocks that may split a
    token's heads, GROUP 3); equal to torch, with and without kv splits; without grouping, a grid of heads."""
    import spruce.attention.triton_backend as tb

    launches = spy_paged_launches(monkeypatch, tb)
    shape = dict(heads=heads, kv_heads=kv_heads, head_dim=16, dtype=torch.float32)
    compare(make_case(phase, len(kv), q_len, kv, 4, width, **shape, seed=7), 4, 1e-4, splits=splits)
    packed = heads > kv_heads
    rows = q_len * heads // kv_heads if packed else q_len
    block = 16 if rows <= 16 else 32
    ((grid, pack, block_m),) = launches
    assert (grid[:2], pack, block_m) == ((len(kv) * -(-rows // block), kv_heads if packed else heads), packed, block)
    assert splits is None or grid[2] == splits


def test_packed_gqa_lse_and_kv_start_equal_the_per_head_kernel(monkeypatch):
    """The lse / kv_start form FlashInfer's split attention takes (DESIGN §13): packed rows give the per-head
    kernel's outputs and log-sum-exps."""
    import spruce.attention.triton_backend as tb

    launches = spy_paged_launches(monkeypatch, tb)
    phase, q_len, width, kv = VERIFY_16
    q, k, v, kc, vc, start, batch, table = make_case(phase, len(kv), q_len, kv, 4, width, heads=8, kv_heads=2,
                                                     head_dim=16, dtype=torch.float32, seed=7)
    kv_start = (batch.kv_lens[batch.qo_indptr[1:] - 1] // 2).to(torch.int32)  # the tail half of each prefix
    fast = TritonAttention(4)
    fast.forward(q, k, v, kc, vc, start, batch, table, 0.25)  # stores the tokens' K/V
    got = fast.attend(q, kc, vc, start, batch, table, 0.25, kv_start=kv_start, return_lse=True)
    monkeypatch.setattr(TritonAttention, "packs_gqa", staticmethod(lambda *a: False))
    want = fast.attend(q, kc, vc, start, batch, table, 0.25, kv_start=kv_start, return_lse=True)
    assert [pack for _, pack, _ in launches] == [True, True, False]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)

def test_empty_batch_and_padding_tokens():
    case = make_case(Phase.DRAFT_EXTEND, 2, 3, [5, 6], 4, 0, **SMALL, seed=5)
    q, k, v, kc, vc, start, batch, table = case
    batch.kv_lens[3:] = 0  # second request is padding: attends to nothing
    out = TritonAttention(4).forward(q, k, v, kc, vc, start, batch, table, 0.25)
    assert torch.all(out[3:] == 0)
    empty = make_case(Phase.DECODE, 0, 1, [], 4, 0, **SMALL)
    assert TritonAttention(4).forward(*empty[:7], empty[7], 0.25).shape[0] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("phase,q_len,width,kv", [
    (Phase.EXTEND, 300, 0, [0, 1200]), (Phase.DECODE, 1, 0, [8000, 3000, 17]),
    (Phase.VERIFY, 32, 32, [4000, 100]), (Phase.VERIFY, 64, 64, [700]), (Phase.DRAFT_DECODE, 8, 48, [2000, 5]),
    (Phase.VERIFY, 6, 8, [4000, 100, 9]), (Phase.VERIFY, 16, 16, [700, 33]),  # packed query heads (PACK_GQA)
])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_real_shapes_bf16(phase, q_len, width, kv, page_size, head_dim):
    case = make_case(phase, len(kv), q_len, kv, page_size, width, heads=32, kv_heads=8, head_dim=head_dim,
                     dtype=torch.bfloat16, max_pages=9000 // page_size + 2)
    compare(case, page_size, 3e-2)


def test_engine_on_triton_equals_torch(tmp_path):
    """Whole engine, plain and speculative, through the triton kernels (interpreted on CPU)."""
    from spruce import LLM, SamplingParams
    from spruce.config import builtin_model_path
    from checkpoints import write_eagle3_checkpoint

    draft = str(write_eagle3_checkpoint(tmp_path / "d", builtin_model_path(), seed=1))
    prompts = ["def fib(n):", "import os\nimport sys\n"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)  # two or more rounds of S=3 drafts
    outs = {}
    for backend in ("torch", "triton"):
        for spec in (None, dict(draft_model=draft, speculative_num_steps=3, speculative_eagle_topk=2,
                                speculative_num_draft_tokens=5)):
            llm = LLM(attention_backend=backend, page_size=4, device=DEVICE, **(spec or {}))
            outs[(backend, spec is None)] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[("torch", True)] == outs[("triton", True)] == outs[("torch", False)] == outs[("triton", False)]


def with_positions(case, positions):
    """The case with batch.positions set (the window reads them)."""
    q, k, v, kc, vc, start, batch, table = case
    batch.positions = positions.to(torch.int64).to(batch.kv_lens.device)
    return case


@pytest.mark.parametrize("phase,window,splits,chunk", [
    (Phase.EXTEND, 3, None, None), (Phase.EXTEND, 40, None, None), (Phase.VERIFY, 5, None, None),
    (Phase.DECODE, 9, 4, None), (Phase.DECODE, None, 3, None), (Phase.VERIFY, None, None, None),
    (Phase.EXTEND, None, None, 8), (Phase.VERIFY, None, None, 8), (Phase.DECODE, None, 4, 16),
    (Phase.DECODE, 9, 1, None), (Phase.DECODE, None, 1, 16)])
def test_sliding_window_chunks_and_sinks_equal_torch(monkeypatch, phase, window, splits, chunk):
    """gpt-oss's attention: a window (shorter and longer than the prefix) and per-head sink logits, with and
    without kv splits (the sinks then applied in the merge); Llama 4's chunks (one inside a tree: positions
    13..19 cross 16). Decode runs the grouped kernel (a kv head's query heads in one tile)."""
    import spruce.attention.triton_backend as tb

    kernels = []
    for name in ("paged_attention_kernel", "grouped_decode_kernel"):
        kernel = getattr(tb, name)
        monkeypatch.setattr(tb, name, type("Spy", (), {"__getitem__": lambda self, grid, kernel=kernel, name=name: (
            lambda *a, **kw: (kernels.append(name), kernel[grid](*a, **kw)))})())
    q_len, width = {Phase.EXTEND: (6, 0), Phase.VERIFY: (7, 8), Phase.DECODE: (1, 0)}[phase]
    kv = [13, 40] if phase != Phase.EXTEND else [0, 21]
    case = make_case(phase, 2, q_len, kv, 4, width, **SMALL, seed=5)
    batch = case[6]
    if phase == Phase.EXTEND:
        positions = torch.cat([torch.arange(n, n + q_len) for n in kv])
    else:  # a tree's tokens sit past the committed prefix (decode: at it)
        positions = batch.kv_lens.long().cpu() - (1 if phase == Phase.DECODE else 0) + torch.arange(q_len).repeat(2)
    q, k, v, kc, vc, start, batch, table = with_positions(case, positions)
    sinks = torch.randn(SMALL["heads"], generator=torch.Generator().manual_seed(6)).to(DEVICE) * 2
    scale = q.shape[-1] ** -0.5
    ref_k, ref_v = kc.clone(), vc.clone()
    ref = TorchAttention(4).forward(q, k, v, ref_k, ref_v, start, batch, table, scale, window=window, sinks=sinks,
                                    chunk=chunk)
    plain = TorchAttention(4).forward(q, k, v, ref_k.clone(), ref_v.clone(), start, batch, table, scale)
    assert (ref - plain).abs().max() > 1e-3  # the sinks (and window) change the result
    fast = TritonAttention(4)
    if splits is not None:
        fast.num_splits = fast.grouped_splits = lambda *a: splits
    out = fast.forward(q, k, v, kc, vc, start, batch, table, scale, window=window, sinks=sinks, chunk=chunk)
    assert (out.float() - ref.float()).abs().max().item() < 1e-4
    assert kernels == ["grouped_decode_kernel" if phase == Phase.DECODE else "paged_attention_kernel"]
