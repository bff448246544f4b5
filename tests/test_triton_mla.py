"""The triton MLA (latent) attention equals the torch reference on every phase shape (CPU: Triton's interpreter).

Cases are the MHA cases with one KV head of width Dk: k[:, 0] is the new tokens' latent and k_cache[:, 0] the
latent cache, whose first Dv columns are the values. Small shapes keep Dv (and some Dk) off powers of two
(Dk = 24 + 8, Dv = 24) so the kernel's padded value and rope parts are exercised, and cover both row blocks
(16 rows for requests of fewer than 64 (token, head) rows, else 64); the GPU tests run the DeepSeek shapes
(Dk = 512 + 64, Dv = 512, 128 and 16 heads) in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

import test_torch_attention as mixed  # noqa: E402
import test_triton_attention as uniform  # noqa: E402
from spruce.attention.metadata import Phase  # noqa: E402
from spruce.attention.torch_backend import TorchAttention  # noqa: E402
from spruce.attention.triton_backend import TritonAttention  # noqa: E402

pytestmark = pytest.mark.slow  # scheduled first (conftest)

DEVICE = uniform.DEVICE
SMALL = dict(heads=4, key_dim=32, value_dim=24, dtype=torch.float32)  # a block holds 4 or 16 tokens
WIDE = dict(heads=16, key_dim=64, value_dim=48, dtype=torch.float32)  # one decode token's 16 heads per block
ODD = dict(heads=6, key_dim=40, value_dim=32, dtype=torch.float32)  # blocks that end inside a token's heads


def mixed_case(phase: Phase, prefixes, q_lens, page_size: int, *, heads: int, key_dim: int, value_dim: int,
               dtype, **kw):
    """A latent case from `test_torch_attention.make_case` (mixed lengths, padding rows and tokens), on DEVICE."""
    case = mixed.make_case(phase, prefixes, q_lens, page_size, heads=heads, kv_heads=1, head_dim=key_dim,
                           dtype=dtype, **kw)
    q, k, _, kc, _, start, batch, table = case
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(batch, name, value.to(DEVICE))
    return q.to(DEVICE), k[:, 0].to(DEVICE), kc[:, 0].to(DEVICE), value_dim, start, batch, table.to(DEVICE)


def uniform_case(phase: Phase, bs: int, q_len: int, kv_lens, page_size: int, width: int, *, heads: int,
                 key_dim: int, value_dim: int, dtype, **kw):
    """A latent case from `test_triton_attention.make_case` (uniform query lengths, any table width)."""
    q, k, _, kc, _, start, batch, table = uniform.make_case(phase, bs, q_len, kv_lens, page_size, width, heads=heads,
                                                           kv_heads=1, head_dim=key_dim, dtype=dtype, **kw)
    return q, k[:, 0], kc[:, 0], value_dim, start, batch, table  # q, latent: strided views of one fused output


def compare(case, page_size: int, tol: float, splits: int | None = None) -> torch.Tensor:
    """Both backends on copies of the cache: stores equal, outputs within tol. Returns the triton output."""
    q, latent, cache, value_dim, start, batch, table = case
    scale = q.shape[-1] ** -0.5
    ref_cache = cache.clone()
    ref = TorchAttention(page_size).forward_latent(q, latent, ref_cache, value_dim, start, batch, table, scale)
    fast = TritonAttention(page_size)
    if splits is not None:
        fast.num_latent_splits = lambda *a: splits
    fast_cache = cache.clone()
    out = fast.forward_latent(q, latent, fast_cache, value_dim, start, batch, table, scale)
    # slot 0 (the dummy page) takes every padding token's write, in no particular order
    assert torch.equal(fast_cache[1:], ref_cache[1:]), "latent store differs"
    assert out.shape == (*q.shape[:2], value_dim) and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    assert err < tol, err
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_extend_mixed_lengths(page_size):
    """Prefill chunks of different lengths after different prefixes (a fresh prompt, a later chunk, one token)."""
    compare(mixed_case(Phase.EXTEND, [0, 37, 5], [23, 9, 1], page_size, **SMALL, seed=page_size), page_size, 1e-4)


@pytest.mark.parametrize("shape,q_lens", [(WIDE, [7, 5]), (ODD, [7, 2]), (ODD, [12, 5])])
def test_extend_head_blocks(shape, q_lens):
    """Blocks of whole tokens (16 heads), and of 16 or 64 rows that split a token's 6 heads between blocks."""
    compare(mixed_case(Phase.EXTEND, [3, 0], q_lens, 4, **shape, seed=1), 4, 1e-4)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("splits", [None, 4, 64])
def test_decode_and_split_kv(page_size, splits):
    """Decode with padding rows; 64 splits leave most splits without keys (their lse is -inf)."""
    case = mixed_case(Phase.DECODE, [0, 90, 13], [1, 1, 1], page_size, **SMALL, pad_rows=2, seed=2)
    compare(case, page_size, 1e-4, splits)


def test_decode_wide_split_kv():
    compare(mixed_case(Phase.DECODE, [70, 33], [1, 1], 4, **WIDE, seed=3), 4, 1e-4, splits=2)
    compare(mixed_case(Phase.DECODE, [70, 33], [1, 1], 4, **WIDE, seed=3), 4, 1e-4, splits=3)


@pytest.mark.parametrize("page_size,splits", [(1, None), (16, 2), (64, None)])
def test_verify_tree_with_prefix(page_size, splits):
    """N tree tokens per request over a prefix and random scratch bits, two mask words, a padding row."""
    case = mixed_case(Phase.VERIFY, [9, 0, 70], [12, 12, 12], page_size, width=70, **SMALL, pad_rows=1, seed=4)
    compare(case, page_size, 1e-4, splits)


def test_verify_ancestor_tree():
    """A real tree (ancestor masks of random parents) over the prefix, the heads of one token per block."""
    compare(uniform_case(Phase.VERIFY, 2, 8, [21, 4], 4, 8, **WIDE, seed=5), 4, 1e-4)


@pytest.mark.parametrize("splits", [None, 4])
def test_draft_decode_scratch_only_tokens(splits):
    """kv_len 0 (nothing committed yet): a later draft step's tokens attend to earlier steps' entries only."""
    case = mixed_case(Phase.DRAFT_DECODE, [0, 0], [4, 4], 16, width=20, scratch_offset=8, **SMALL, seed=6)
    compare(case, 16, 1e-4, splits)


@pytest.mark.parametrize("page_size", [4, 64])
def test_draft_extend_padding_tokens(page_size):
    """Stride S+1 with only counts[b] real tokens per row: the rest attend to nothing and produce zeros."""
    case = mixed_case(Phase.DRAFT_EXTEND, [6, 30, 0], [4, 4, 4], page_size, **SMALL, real_counts=[1, 4, 2],
                      pad_rows=1, seed=7)
    out = compare(case, page_size, 1e-4)
    assert torch.all(out[[1, 2, 3, 10, 11, 12, 13, 14, 15]] == 0)


def test_value_dim_equals_key_dim():
    """No rope part (Dv == Dk): the second key part is all padding."""
    compare(mixed_case(Phase.EXTEND, [5], [6], 4, heads=4, key_dim=32, value_dim=32, dtype=torch.float32), 4, 1e-4)


def test_latent_cast_on_store():
    """A latent in another dtype than the cache is rounded on store as the reference rounds it.

    (bf16 runs on the GPU only: the CPU interpreter's bf16 `tl.dot` is wrong, see test_gpu_real_shapes_bf16.)"""
    q, latent, cache, dv, start, batch, table = mixed_case(Phase.VERIFY, [17, 40], [6, 6], 16, width=6, **SMALL,
                                                           seed=8)
    compare((q, latent.double() * (1 + 1e-9), cache, dv, start, batch, table), 16, 1e-4)


def test_empty_batch():
    q, latent, cache, dv, start, batch, table = mixed_case(Phase.EXTEND, [], [], 4, **SMALL)
    assert TritonAttention(4).forward_latent(q, latent, cache, dv, start, batch, table, 0.25).shape == (0, 4, 24)


@pytest.mark.gpu
@pytest.mark.parametrize("phase,q_len,width,kv", [
    (Phase.EXTEND, 300, 0, [0, 1200]), (Phase.DECODE, 1, 0, [8000]), (Phase.DECODE, 1, 0, [8000, 3000, 17, 512]),
    (Phase.VERIFY, 32, 32, [4000, 100]), (Phase.DRAFT_DECODE, 8, 48, [2000, 0]),
])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [128, 16])
def test_gpu_real_shapes_bf16(phase, q_len, width, kv, page_size, heads):
    """DeepSeek-V3 (128 heads) and V2-Lite (16 heads) shapes: latent 512 + rope 64, value 512."""
    case = uniform_case(phase, len(kv), q_len, kv, page_size, width, heads=heads, key_dim=576, value_dim=512,
                        dtype=torch.bfloat16, max_pages=9000 // page_size + 2)
    compare(case, page_size, 3e-2)


@pytest.mark.gpu
def test_gpu_decode_forced_split_bf16():
    case = uniform_case(Phase.DECODE, 2, 1, [5000, 700], 16, 0, heads=128, key_dim=576, value_dim=512,
                        dtype=torch.bfloat16, max_pages=400)
    compare(case, 16, 3e-2, splits=1)
    compare(case, 16, 3e-2, splits=16)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Captured once in a CUDA graph (split kv + merge included), replays on new queries and shorter lengths."""
    q, latent, cache, dv, start, batch, table = uniform_case(Phase.DECODE, 2, 1, [3000, 500], 16, 0, heads=128,
                                                             key_dim=576, value_dim=512, dtype=torch.bfloat16,
                                                             max_pages=300)
    fast, scale = TritonAttention(16), 576 ** -0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        fast.forward_latent(q, latent, cache, dv, start, batch, table, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fast.forward_latent(q, latent, cache, dv, start, batch, table, scale)
    q.copy_(torch.randn_like(q))
    batch.kv_lens.sub_(torch.tensor([1000, 100], dtype=torch.int32, device=DEVICE))
    graph.replay()
    ref = TorchAttention(16).forward_latent(q, latent, cache.clone(), dv, start, batch, table, scale)
    assert (out.float() - ref.float()).abs().max().item() < 3e-2
