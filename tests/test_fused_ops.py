"""Fused Triton ops equal their torch references (CPU: Triton's interpreter; GPU: natively, bf16)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import spruce.ops.fused as F  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.fixture(autouse=True)
def force_triton():
    F._FORCE_TRITON[0] = True
    yield
    F._FORCE_TRITON[0] = False


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(7, 96, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w = torch.randn(96, generator=g).to(dtype).to(DEVICE)
    out, res = F.add_rms_norm(x, r, w, 1e-5)
    s = x + r
    assert torch.equal(res, s)
    ref = F.rms_norm_reference(s, w, 1e-5)
    assert (out.float() - ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)
    assert (F.rms_norm(x, w, 1e-5).float() - F.rms_norm_reference(x, w, 1e-5).float()).abs().max() < 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype):
    from spruce.models.rope import Rotary

    rot = Rotary(32, 128, 10000.0, None)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, 32, generator=g).to(dtype).to(DEVICE)
    pos = torch.tensor([0, 3, 17, 64, 127], device=DEVICE)
    cos, sin = rot.cos.to(DEVICE), rot.sin.to(DEVICE)
    ref = F.rotary_reference(x, cos, sin, pos)
    out = F.rotary_(x.clone(), cos, sin, pos)
    assert (out.float() - ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_rotary_in_one_launch_equals_the_separate_ops(dtype, norm):
    """q and k, views of one fused qkv row as the attention layer has them, RMSNorm'd (Qwen3's q/k norm) and rotated
    in one launch, in place: equal to rms_norm_reference then rotary_reference of each; v untouched."""
    from spruce.models.rope import Rotary

    rot = Rotary(32, 128, 10000.0, None)
    g = torch.Generator().manual_seed(2)
    hq, hk, d = 6, 2, 32
    qkv = torch.randn(5, (hq + 2 * hk) * d, generator=g).mul(3).to(dtype).to(DEVICE)
    qw, kw = (torch.randn(d, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    pos = torch.tensor([0, 3, 17, 64, 127], device=DEVICE)
    cos, sin = rot.cos.to(DEVICE), rot.sin.to(DEVICE)
    q, k, v = qkv.clone().split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v0 = q.reshape(5, hq, d), k.reshape(5, hk, d), v.clone()
    want_q, want_k = (q.clone(), k.clone()) if not norm else (F.rms_norm_reference(q, qw, 1e-6),
                                                               F.rms_norm_reference(k, kw, 1e-6))
    want_q, want_k = F.rotary_reference(want_q, cos, sin, pos), F.rotary_reference(want_k, cos, sin, pos)
    got_q, got_k = F.qk_rotary_(q, k, cos, sin, pos, *((qw, kw, 1e-6) if norm else ()))
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place, in the qkv row
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert (got_q.float() - want_q.float()).abs().max().item() <= tol
    assert (got_k.float() - want_k.float()).abs().max().item() <= tol
    assert torch.equal(v, v0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 2 * 80, generator=g).to(dtype).to(DEVICE)
    out = F.silu_and_mul(x)
    ref = F.silu_and_mul_reference(x)
    assert (out.float() - ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_empty_inputs():
    w = torch.ones(16, device=DEVICE)
    assert F.rms_norm(torch.zeros(0, 16, device=DEVICE), w, 1e-5).shape == (0, 16)
    assert F.silu_and_mul(torch.zeros(0, 32, device=DEVICE)).shape == (0, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 4, 8, 16])
def test_softmax_topk_equals_torch(k, dtype):
    """Chunked top-k + logsumexp == softmax then topk: same ids, same probabilities (fp32 rounding)."""
    from spruce.ops.topk import softmax_topk

    g = torch.Generator().manual_seed(k)
    logits = (4 * torch.randn(5, 5000, generator=g)).to(dtype).to(DEVICE)  # 3 chunks, the last one partial
    logits[1, 2048:4096] = float("-inf")  # a whole chunk masked out
    p, ids = softmax_topk(logits, k)
    ref_p, ref_ids = logits.float().softmax(-1).topk(k, dim=-1)
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    else:  # bf16 logits tie often, and torch.topk orders ties its own way: the chosen logits must be the same
        assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))
        assert all(len(set(row)) == k for row in ids.tolist())  # k distinct tokens per row
    assert (p - ref_p).abs().max().item() <= 1e-6 + 1e-5 * ref_p.abs().max().item()
    assert p.dtype == torch.float32 and ids.dtype == torch.int64


def test_fused_scratch_metadata_equals_torch_fill():
    """The one-launch metadata kernel writes exactly what the torch builder writes, padding rows included."""
    from spruce.attention.metadata import Phase
    from spruce.limits import Limits
    from spruce.memory import PageTable
    from spruce.runtime.batch_builder import BatchBuilder
    from spruce.speculative.tree import ancestor_masks

    lim = Limits(max_running_requests=4, page_size=4, context_length=64, num_pages=40, chunked_prefill_size=16,
                 num_steps=3, eagle_topk=4, num_draft_tokens=70)
    dev = torch.device(DEVICE)
    rows = torch.tensor([2, 0, lim.dummy_row], device=dev)
    committed = torch.tensor([5, 9, 0], device=dev)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (3, 70), generator=g).to(dev)
    depths = torch.randint(0, 4, (3, 70), generator=g).to(dev)
    parents = torch.tensor([[-1] + list(range(69))] * 3)
    masks = ancestor_masks(parents, 2, 69).to(dev)
    outs = []
    for fused in (False, True):
        b = BatchBuilder(lim, PageTable(lim, dev), dev)
        b.fused = fused
        batch = b.scratch_phase(Phase.VERIFY, rows, committed, ids, depths, masks, 0, 1000, 70, 40)
        outs.append([batch.input_ids, batch.positions, batch.out_slots, batch.token_rows, batch.kv_lens,
                     batch.tree_mask, batch.req_rows, batch.qo_indptr])
    for a, c in zip(*outs):
        assert torch.equal(a, c)


def _paged_fill_both_ways(lim, fill) -> dict[str, torch.Tensor]:
    """Run `fill(builder)` through the torch builder and the one-launch kernel (BatchBuilder.fused), each over a page
    table of distinct pages and buffers holding -7 (what a previous step left); assert every buffer equal and return
    the fused one's, by name."""
    from spruce.memory import PageTable
    from spruce.runtime.batch_builder import BatchBuilder

    dev = torch.device(DEVICE)
    outs = []
    for fused in (False, True):
        table = PageTable(lim, dev)
        pages = torch.arange(table.table.numel(), dtype=torch.int32).reshape(table.table.shape) % 251 + 1
        table.table.copy_(pages.to(dev))
        b = BatchBuilder(lim, table, dev)
        bufs = dict(ids=b.input_ids, pos=b.positions, slots=b.out_slots, token_rows=b.token_rows, kv=b.kv_lens,
                    mask=b.tree_mask, req_rows=b.req_rows, indptr=b.qo_indptr)
        for buf in bufs.values():
            buf.fill_(-7)
        b.fused = fused
        fill(b)
        outs.append(bufs)
    for name in outs[0]:
        assert torch.equal(outs[0][name], outs[1][name]), name
    return outs[1]


@pytest.mark.parametrize("page_size", [1, 4])
def test_fused_decode_metadata_equals_torch_fill(page_size):
    """The one-launch DECODE fill writes exactly what the torch builder writes: page slots through the table (a
    position on a later page included), causal kv lengths, empty masks, padding rows (the dummy row) writing the
    dummy page and attending to nothing; buffers past the batch untouched."""
    from spruce.limits import Limits

    lim = Limits(max_running_requests=6, page_size=page_size, context_length=64, num_pages=300,
                 chunked_prefill_size=16)
    dev = torch.device(DEVICE)
    rows = torch.tensor([2, 0, 3, lim.dummy_row, lim.dummy_row], device=dev)
    positions = torch.tensor([5, 13, 0, 7, 0], device=dev)
    ids = torch.tensor([11, 12, 13, 0, 0], device=dev)

    def fill(b):
        batch = b.decode(rows, positions, ids, 16)
        assert batch.num_tokens == 5 and batch.batch_size == 5

    out = _paged_fill_both_ways(lim, fill)
    assert out["slots"][3:5].tolist() == [0, 0] and out["kv"][:5].tolist() == [6, 14, 1, 0, 0]
    assert out["slots"][5].item() == -7 and out["indptr"][6].item() == -7


@pytest.mark.parametrize("page_size", [1, 4])
def test_fused_draft_extend_metadata_equals_torch_fill(page_size):
    """DRAFT_EXTEND's one-launch fill (stride S+1, counts = accepted + 1) writes what the torch builder writes: only
    each request's first counts[b] tokens get a page slot and a kv length, the rest and padding rows none."""
    from spruce.limits import Limits

    lim = Limits(max_running_requests=6, page_size=page_size, context_length=64, num_pages=300,
                 chunked_prefill_size=16, num_steps=3, eagle_topk=2, num_draft_tokens=4)
    stride = lim.draft_extend_stride
    dev = torch.device(DEVICE)
    rows = torch.tensor([4, 1, 0, lim.dummy_row], device=dev)
    starts = torch.tensor([9, 2, 30, 0], device=dev)
    counts = torch.tensor([1, stride, 2, 1], device=dev)
    ids = torch.arange(4 * stride, device=dev).reshape(4, stride) + 100

    def fill(b):
        batch = b.draft_extend(rows, starts, counts, ids, 48)
        assert batch.num_tokens == 4 * stride and batch.batch_size == 4

    out = _paged_fill_both_ways(lim, fill)
    kv = out["kv"][:4 * stride].reshape(4, stride).tolist()
    assert kv[0] == [10] + [0] * (stride - 1) and kv[1] == list(range(3, 3 + stride)) and kv[3] == [0] * stride

