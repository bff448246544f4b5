"""The vectorised torch backend equals a naive per-query-token reference on every phase shape."""

from __future__ import annotations

import pytest
import torch

from spruce.attention import torch_backend
from spruce.attention.metadata import ForwardBatch, Phase
from spruce.attention.torch_backend import TorchAttention

MAX_PAGES = 128


def naive_attention(q, k, v, k_cache, v_cache, scratch_start, batch, table, page_size, scale):
    """The contract of `spruce.attention.metadata`, one query token at a time (slow, obviously correct)."""
    k_cache[batch.out_slots] = k.to(k_cache.dtype)
    v_cache[batch.out_slots] = v.to(v_cache.dtype)
    group = q.shape[1] // k.shape[1]
    w = batch.scratch_width
    out = torch.zeros_like(q)  # [T, Hq, D]
    for t in range(batch.num_tokens):
        row, kv_len = int(batch.token_rows[t]), int(batch.kv_lens[t])
        slots = [int(table[row, p // page_size]) * page_size + p % page_size for p in range(kv_len)]
        slots += [scratch_start + row * w + j for j in range(w) if (int(batch.tree_mask[t, j // 64]) >> (j % 64)) & 1]
        if not slots:
            continue
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        vals = v_cache[slots].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[t].float(), keys) * scale, dim=-1)  # [Hq, n]
        out[t] = torch.einsum("hn,nhd->hd", probs, vals).to(q.dtype)
    return out


def random_table(extents: list[int], page_size: int, g) -> tuple[torch.Tensor, int]:
    """Page table [rows + 1, MAX_PAGES] (last row: the dummy row, all page 0) with shuffled distinct pages."""
    need = [-(-e // page_size) for e in extents]
    num_pages = 1 + sum(need)
    pages = (torch.randperm(num_pages - 1, generator=g) + 1).to(torch.int32)
    table = torch.zeros(len(extents) + 1, MAX_PAGES, dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = pages[used:used + n]
        used += n
    return table, num_pages


def make_case(phase: Phase, prefixes: list[int], q_lens: list[int], page_size: int, *, width: int = 0,
              heads: int = 4, kv_heads: int = 2, head_dim: int = 16, pad_rows: int = 0, real_counts=None,
              scratch_offset: int = 0, dtype=torch.float32, seed: int = 0):
    """Random pools and a ForwardBatch for one phase.

    Request b has `prefixes[b]` committed tokens and `q_lens[b]` query tokens (uniform phases: all equal).
    EXTEND / DECODE / DRAFT_EXTEND tokens sit at positions prefix.. (causal over the pages); DRAFT_EXTEND's
    tokens past `real_counts[b]` are padding. VERIFY / DRAFT_DECODE tokens write scratch entries
    scratch_offset.. and attend to the prefix and to random scratch bits. `pad_rows` padding requests use
    the dummy row.
    """
    g = torch.Generator().manual_seed(seed)
    table, num_pages = random_table([p + m for p, m in zip(prefixes, q_lens)], page_size, g)
    dummy = len(prefixes)
    scratch_start = num_pages * page_size
    k_cache = torch.randn(scratch_start + (dummy + 1) * width, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=g).to(dtype)
    rows = list(range(dummy)) + [dummy] * pad_rows
    lens = list(q_lens) + [q_lens[0] if phase != Phase.EXTEND else 0] * pad_rows
    counts = torch.tensor(lens, dtype=torch.int64)  # [bs]
    token_rows = torch.tensor(rows, dtype=torch.int64).repeat_interleave(counts)  # [T]
    idx = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts).repeat_interleave(counts)  # [T] within request
    prefix = torch.tensor(list(prefixes) + [0] * pad_rows, dtype=torch.int64).repeat_interleave(counts)  # [T]
    t, words = len(token_rows), max(1, -(-width // 64))
    tree_mask = torch.zeros(t, words, dtype=torch.int64)
    if phase in (Phase.VERIFY, Phase.DRAFT_DECODE):
        positions = prefix + idx
        kv_lens = prefix
        out_slots = scratch_start + token_rows * width + scratch_offset + idx
        bits = torch.rand(t, words * 64, generator=g) < 0.5
        bits[:, width:] = False
        weights = torch.tensor([1 << j for j in range(63)] + [-(1 << 63)], dtype=torch.int64)
        tree_mask = (bits.view(t, words, 64).long() * weights).sum(-1)
    else:
        positions = prefix + idx
        kv_lens = positions + 1
        out_slots = table[token_rows, positions // page_size].long() * page_size + positions % page_size
    if real_counts is not None:
        fake = idx >= torch.tensor(list(real_counts) + [0] * pad_rows).repeat_interleave(counts)
        out_slots, kv_lens = out_slots.masked_fill(fake, 0), kv_lens.masked_fill(fake, 0)
    pad = token_rows == dummy
    out_slots, kv_lens = out_slots.masked_fill(pad, 0), kv_lens.masked_fill(pad, 0)
    tree_mask = tree_mask.masked_fill(pad[:, None], 0)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    batch = ForwardBatch(
        phase=phase, batch_size=len(rows), num_tokens=t, input_ids=torch.zeros(t, dtype=torch.int64),
        positions=positions, out_slots=out_slots.long(), token_rows=token_rows, kv_lens=kv_lens.to(torch.int32),
        tree_mask=tree_mask, req_rows=torch.tensor(rows, dtype=torch.int64), qo_indptr=indptr,
        max_kv_len=int(kv_lens.max()) if t else 0, max_q_len=max(lens, default=0),
        scratch_width=width if phase in (Phase.VERIFY, Phase.DRAFT_DECODE) else 0,
    )
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = (x.view(t, h, head_dim) for x, h in zip(
        qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1), (heads, kv_heads, kv_heads)))
    return q, k, v, k_cache, v_cache, scratch_start, batch, table


def check(case, page_size: int, tol: float = 2e-6) -> torch.Tensor:
    """Run both implementations on copies of the pools; the stores must be equal and the outputs within tol."""
    q, k, v, kc, vc, start, batch, table = case
    scale = q.shape[-1] ** -0.5
    ref_k, ref_v = kc.clone(), vc.clone()
    ref = naive_attention(q, k, v, ref_k, ref_v, start, batch, table, page_size, scale)
    out = TorchAttention(page_size).forward(q, k, v, kc, vc, start, batch, table, scale)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), "KV store differs"
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    assert err <= tol, err
    return out


PAGE_SIZES = [1, 4, 16]
HEADS = [dict(heads=4, kv_heads=2), dict(heads=8, kv_heads=1), dict(heads=2, kv_heads=2)]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_extend_mixed_lengths(page_size, heads):
    """Prefill chunks of different lengths after different prefixes (a fresh prompt, a later chunk, one token)."""
    check(make_case(Phase.EXTEND, [0, 37, 5, 0], [23, 9, 1, 40], page_size, **heads, seed=page_size), page_size)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_decode_with_padding_rows(page_size, heads):
    check(make_case(Phase.DECODE, [0, 50, 13], [1, 1, 1], page_size, **heads, pad_rows=2, seed=1), page_size)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_verify_tree(page_size, heads):
    """N tree tokens per request over a prefix and random scratch bits, two mask words, padding rows."""
    case = make_case(Phase.VERIFY, [9, 0, 70], [12, 12, 12], page_size, width=70, **heads, pad_rows=1, seed=2)
    check(case, page_size)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_draft_decode_scratch_offset(page_size):
    """A later draft step: K tokens written at scratch entries (j-1)K.. with bits over earlier steps' entries."""
    case = make_case(Phase.DRAFT_DECODE, [0, 21], [4, 4], page_size, width=20, scratch_offset=8, seed=3)
    check(case, page_size)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_draft_extend_padding_tokens(page_size, heads):
    """Stride S+1 with only counts[b] real tokens per row: the rest attend to nothing and produce zeros."""
    case = make_case(Phase.DRAFT_EXTEND, [6, 30, 0], [4, 4, 4], page_size, **heads, real_counts=[1, 4, 2],
                     pad_rows=1, seed=4)
    out = check(case, page_size)
    assert torch.all(out[[1, 2, 3, 10, 11, 12, 13, 14, 15]] == 0)


def test_everything_padding_and_empty():
    """A batch of padding only (kv_len 0, mask 0) gives zeros, an empty batch an empty output."""
    case = make_case(Phase.VERIFY, [5], [3], 4, width=8, pad_rows=3, seed=5)
    q, k, v, kc, vc, start, batch, table = case
    batch.kv_lens.zero_()
    batch.tree_mask.zero_()
    assert torch.all(check(case, 4) == 0)
    empty = make_case(Phase.EXTEND, [], [], 4)
    assert TorchAttention(4).forward(*empty[:7], empty[7], 0.25).shape[0] == 0


def test_query_blocks(monkeypatch):
    """A score budget smaller than the batch splits the queries into several blocks: same result."""
    monkeypatch.setattr(torch_backend, "SCORE_ELEMENTS", 1000)
    check(make_case(Phase.EXTEND, [3, 0], [29, 17], 4, seed=6), 4)
    check(make_case(Phase.VERIFY, [11, 2], [8, 8], 1, width=8, seed=7), 1)


def test_bfloat16_pools():
    """bf16 q/k/v and pools: both compute in float32 and round once, so they agree to bf16 rounding."""
    check(make_case(Phase.VERIFY, [17, 40], [6, 6], 16, width=6, dtype=torch.bfloat16, seed=8), 16, tol=2e-2)
    check(make_case(Phase.EXTEND, [0, 9], [33, 5], 16, dtype=torch.bfloat16, seed=9), 16, tol=2e-2)
