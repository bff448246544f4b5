"""The fused MoE op equals its torch reference (CPU: Triton's interpreter, float32; GPU: natively, float32 and
bf16 at DeepSeek-V2-Lite and V3 shapes, and replayed from a CUDA graph with new routing)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import spruce.ops.fused as F  # noqa: E402
from spruce.ops import moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def force_triton():
    F._FORCE_TRITON[0] = True
    yield
    F._FORCE_TRITON[0] = False


def make_weights(h, inter, e, dtype=torch.float32, seed=0):
    """w13 [E, 2I, H], w2 [E, H, I], scaled so that every product stays O(1)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, h, generator=g, device=DEVICE, dtype=dtype).mul_(h ** -0.5)
    w2 = torch.randn(e, h, inter, generator=g, device=DEVICE, dtype=dtype).mul_(inter ** -0.5)
    return w13, w2


def route(t, e, k, seed, used=None, dtype=torch.float32):
    """x [t, H] is made by the caller; here topk_ids [t, k] (distinct experts per token, drawn from the first
    `used` experts so the others get none) and topk_weights [t, k] float32 as a softmax router gives them."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(t, e, generator=g, device=DEVICE)
    logits[:, used or e:] = float("-inf")
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return ids, weights


def assert_close_f32(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# --- align ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("t,e,k,used", [(1, 8, 2, None), (5, 8, 3, 4), (33, 4, 3, None), (33, 64, 6, 40),
                                        (200, 8, 2, 3)])
def test_align_invariants(t, e, k, used, block_m):
    ids, _ = route(t, e, k, seed=t + e, used=used)
    m = t * k
    sorted_ids, block_expert, num_blocks = moe._align(ids, e, block_m)
    blocks = (m + min(e, m) * (block_m - 1)) // block_m
    assert sorted_ids.shape == (blocks * block_m,) and block_expert.shape == (blocks,) and num_blocks.shape == (1,)
    flat, s, be, nb = ids.reshape(-1).cpu(), sorted_ids.cpu(), block_expert.cpu(), int(num_blocks)
    real = s[s != m]
    assert sorted(real.tolist()) == list(range(m))  # every assignment exactly once, all else the sentinel
    counts = torch.bincount(flat, minlength=e)
    assert nb == sum((c + block_m - 1) // block_m for c in counts.tolist()) <= blocks
    assert (s[nb * block_m:] == m).all() and (be[nb:] == e).all()  # unused blocks: padding only
    seen = []
    for b in range(nb):
        row = s[b * block_m:(b + 1) * block_m]
        live = row[row != m]
        assert len(live) and (flat[live] == be[b]).all()  # one expert per block, no block all padding
        assert (row[:len(live)] == live).all()  # padding only after the assignments
        seen.append(live)
    hit = be[:nb].tolist()
    assert hit == sorted(hit) and set(hit) == set(flat.tolist())  # blocks for experts that got tokens only
    for ex in set(hit):  # within an expert: ascending assignment ids (the sort is stable)
        got = torch.cat([seen[b] for b in range(nb) if hit[b] == ex])
        assert torch.equal(got, torch.nonzero(flat == ex).flatten().to(got.dtype))


def test_align_batch_one_reads_routed_experts_only():
    ids = torch.tensor([[5, 200, 17, 3, 99, 250, 0, 128]], device=DEVICE)
    _, block_expert, num_blocks = moe._align(ids, 256, 16)
    assert block_expert.shape == (8,) and int(num_blocks) == 8  # 8 + 8*15 entries: 8 blocks, one per expert
    assert block_expert.tolist() == sorted(ids[0].tolist())


# --- fused_moe vs the reference, float32 ----------------------------------------------------------------------
SHAPES = [(32, 16, 4, 1), (48, 48, 8, 2), (64, 32, 8, 3)]  # (H, I, E, k)
SMALL_BLOCKS = [moe._Config(16, 16, 16, 4, 2), moe._Config(32, 32, 32, 4, 2)]  # several N tiles and K steps


@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("h,inter,e,k", SHAPES)
def test_fused_moe_equals_reference_float32(t, h, inter, e, k):
    w13, w2 = make_weights(h, inter, e, seed=h + e)
    x = torch.randn(t, h, generator=torch.Generator(device=DEVICE).manual_seed(t), device=DEVICE)
    ids, weights = route(t, e, k, seed=t * k, used=max(k, e - 2))  # the last two experts get no token
    ref = moe.fused_moe_reference(x, w13, w2, ids, weights)
    assert_close_f32(moe.fused_moe(x, w13, w2, ids, weights), ref)
    for cfg in SMALL_BLOCKS:
        assert_close_f32(moe._fused_moe_triton(x, w13, w2, ids, weights, cfg), ref)


def test_fused_moe_past_the_one_program_align_equals_reference():
    """100 tokens x top 3 = 300 assignments (three chunks, the last partial), past ALIGN_KERNEL_MAX: the chunked
    align feeds the GEMMs."""
    h, inter, e, k, t = 32, 16, 8, 3, 100
    assert moe.align_path(t * k, e) == "chunked"
    w13, w2 = make_weights(h, inter, e, seed=11)
    x = torch.randn(t, h, generator=torch.Generator(device=DEVICE).manual_seed(12), device=DEVICE)
    ids, weights = route(t, e, k, seed=13)
    assert_close_f32(moe._fused_moe_triton(x, w13, w2, ids, weights, moe._config(t * k, e)),
                     moe.fused_moe_reference(x, w13, w2, ids, weights))

def test_fused_moe_repeated_experts_int32_ids_and_views():
    """A token may name an expert twice, ids may be int32, and the weights may be strided views."""
    h, inter, e, t, k = 48, 32, 6, 9, 3
    w13, w2 = make_weights(h, inter, e, seed=3)
    x = torch.randn(t, h, generator=torch.Generator(device=DEVICE).manual_seed(4), device=DEVICE)
    ids = torch.tensor([[1, 1, 4]] * 5 + [[4, 1, 1]] * 4, dtype=torch.int32, device=DEVICE)
    weights = torch.rand(t, k, generator=torch.Generator(device=DEVICE).manual_seed(5), device=DEVICE)
    ref = moe.fused_moe_reference(x, w13, w2, ids, weights)
    assert_close_f32(moe.fused_moe(x, w13, w2, ids, weights), ref)
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major experts
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    assert_close_f32(moe._fused_moe_triton(x, w13_t, w2_t, ids, weights, SMALL_BLOCKS[0]), ref)


def test_fused_moe_empty_batch():
    w13, w2 = make_weights(32, 16, 4)
    x = torch.zeros(0, 32, device=DEVICE)
    ids = torch.zeros(0, 2, dtype=torch.long, device=DEVICE)
    weights = torch.zeros(0, 2, device=DEVICE)
    assert moe.fused_moe(x, w13, w2, ids, weights).shape == (0, 32)
    assert moe.fused_moe_reference(x, w13, w2, ids, weights).shape == (0, 32)


def test_config_block_m_follows_tokens_per_expert():
    assert moe._config(1 * 8, 256).block_m == 16  # decode
    assert moe._config(256 * 8, 256).block_m == 16
    assert moe._config(256 * 6, 64).block_m == 64
    assert moe._config(2048 * 8, 256).block_m == 128  # prefill


# --- GPU: real shapes in bf16, CUDA graphs ---------------------------------------------------------------------
MODELS = {"v2-lite": (2048, 1408, 64, 6), "v3": (7168, 2048, 256, 8), "fixture": (384, 128, 8, 2)}  # H, I, E, k


@pytest.fixture(scope="module")
def experts(request):
    """bf16 expert weights of one model's MoE layer (V3: 22.5 GB), kept for the module's tests of that model."""
    h, inter, e, k = MODELS[request.param]
    return (h, e, k, *make_weights(h, inter, e, dtype=torch.bfloat16, seed=7))


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 256, 2048])
@pytest.mark.parametrize("experts", ["v2-lite", "v3"], indirect=True)
def test_fused_moe_bf16_real_shapes(experts, t):
    h, e, k, w13, w2 = experts
    x = torch.randn(t, h, generator=torch.Generator(device=DEVICE).manual_seed(t), device=DEVICE).bfloat16()
    ids, weights = route(t, e, k, seed=t)
    out = moe.fused_moe(x, w13, w2, ids, weights)
    ref = moe.fused_moe_reference(x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16 and out.shape == (t, h)
    assert rel_err(out, ref) < 1e-2  # ~4e-3 on an H100: both round every step to bf16, summing in other orders
    assert (out.float() - ref.float()).abs().max().item() <= 0.05 * ref.float().abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["fixture"], indirect=True)
def test_fused_moe_fixture_shape_float32_and_bf16(experts):
    h, e, k, w13, w2 = experts
    x = torch.randn(37, h, generator=torch.Generator(device=DEVICE).manual_seed(0), device=DEVICE)
    ids, weights = route(37, e, k, seed=1, used=e - 1)
    ref32 = moe.fused_moe_reference(x, w13.float(), w2.float(), ids, weights)
    assert_close_f32(moe.fused_moe(x, w13.float(), w2.float(), ids, weights), ref32)
    out = moe.fused_moe(x.bfloat16(), w13, w2, ids, weights)
    assert rel_err(out, moe.fused_moe_reference(x.bfloat16(), w13, w2, ids, weights)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64])
@pytest.mark.parametrize("experts", ["v2-lite"], indirect=True)
def test_fused_moe_cuda_graph_replay_new_routing(experts, t):
    """Captured once, replayed with other tokens and other routing (skewed onto few experts too): the
    replay equals eager, so no step of the op depends on values read at capture time."""
    h, e, k, w13, w2 = experts
    x = torch.zeros(t, h, dtype=torch.bfloat16, device=DEVICE)
    ids, weights = route(t, e, k, seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile the kernels and warm the allocator outside the capture
        moe.fused_moe(x, w13, w2, ids, weights)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, w2, ids, weights)
    for seed in range(1, 4):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        x.copy_(torch.randn(t, h, generator=g, device=DEVICE))
        new_ids, new_weights = route(t, e, k, seed=seed, used=k if seed == 3 else None)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe.fused_moe(x, w13, w2, ids, weights))


@pytest.mark.parametrize("t,e,k,block_m", [(1, 8, 2, 16), (5, 8, 3, 16), (33, 8, 2, 16), (16, 64, 6, 16),
                                           (200, 64, 6, 64), (1, 256, 8, 16)])
def test_align_kernel_equals_torch_align(t, e, k, block_m):
    """The one-program Triton align (decode sizes) == the torch align, stable order included."""
    g = torch.Generator().manual_seed(t * 7 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, k]
    if t > 3:
        ids[: t // 2] = ids[0]  # repeated routing: long runs of one expert
    ids = ids.to(DEVICE)
    want = moe._align(ids, e, block_m)
    got = moe._align_triton(ids, e, block_m)
    for w, o in zip(want, got):
        assert torch.equal(w, o)


@pytest.mark.parametrize("t,e,k,block_m", [(1, 8, 2, 16), (200, 64, 6, 64), (300, 32, 4, 16), (1100, 8, 2, 16),
                                           (513, 128, 8, 16), (64, 256, 8, 16), (1024, 256, 8, 128)])
def test_chunked_align_equals_torch_align(t, e, k, block_m):
    """The chunked Triton align (per-chunk counts, one program for the offsets, a per-chunk scatter) == the torch
    align, stable order included: one chunk, many with a partial last one, 256 experts at its most chunks (64)."""
    g = torch.Generator().manual_seed(t * 7 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, k]
    if t > 3:
        ids[: t // 2] = ids[0]  # repeated routing: long runs of one expert, across chunks
    ids = ids.to(DEVICE)
    want = moe._align(ids, e, block_m)
    got = moe._align_chunked(ids, e, block_m)
    for w, o in zip(want, got):
        assert torch.equal(w, o)


def test_align_path_by_assignments_and_experts():
    """One program up to 128 assignments, the chunked launches up to 128 chunks of 128 (64 with 256 experts, whose
    bins double the offsets tile), torch ops above."""
    assert [moe.align_path(m, 8) for m in (1, 128, 129, 16384, 16385)] == [
        "one_program", "one_program", "chunked", "chunked", "torch"]
    assert [moe.align_path(m, 256) for m in (8192, 8193)] == ["chunked", "torch"]


def test_chunked_align_refuses_more_chunks_than_its_tile():
    ids = torch.zeros(1025, 8, dtype=torch.long, device=DEVICE)  # 8200 assignments: 65 chunks, 256 experts take 64
    with pytest.raises(ValueError, match="more than 64 chunks"):
        moe._align_chunked(ids, 256, 16)


@pytest.mark.parametrize("t", [1, 9])
def test_fused_moe_biases_and_clamped_swiglu_equal_reference(t):
    """gpt-oss's experts: biases on gate/up and down, and the clamped SwiGLU (a limit the products cross)."""
    h, inter, e, k = 48, 32, 6, 2
    w13, w2 = make_weights(h, inter, e, seed=7)
    g = torch.Generator(device=DEVICE).manual_seed(8)
    b13 = torch.randn(e, 2 * inter, generator=g, device=DEVICE)
    b2 = torch.randn(e, h, generator=g, device=DEVICE)
    x = torch.randn(t, h, generator=g, device=DEVICE) * 3
    ids, weights = route(t, e, k, seed=9)
    ref = moe.fused_moe_reference(x, w13, w2, ids, weights, b13, b2, swiglu_limit=1.5, swiglu_alpha=1.702)
    assert not torch.allclose(ref, moe.fused_moe_reference(x, w13, w2, ids, weights, b13, b2))  # the clamp bites
    assert_close_f32(moe.fused_moe(x, w13, w2, ids, weights, b13, b2, 1.5, 1.702), ref)
    for cfg in SMALL_BLOCKS:
        assert_close_f32(moe._fused_moe_triton(x, w13, w2, ids, weights, cfg, b13, b2, 1.5, 1.702), ref)


# --- router ---------------------------------------------------------------------------------------------------
ROUTERS = {  # name: (scoring, E, k, norm_topk_prob, routed scale, bias)
    "qwen3": ("softmax", 128, 8, True, 1.0, False),
    "v2-ungrouped": ("softmax", 64, 6, False, 16.0, False),
    "sigmoid-bias": ("sigmoid", 60, 4, True, 2.5, True),
    "gpt-oss": ("topk_softmax", 32, 4, False, 1.0, False),
    "llama4": ("topk_sigmoid", 16, 1, False, 1.0, False),
    "mixtral-top1": ("softmax", 8, 1, True, 1.0, False),
}


@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_fused_router_equals_select_experts(router, t):
    """The one-launch router (ops/router.py) chooses the experts the torch reference does, with its weights, for
    every ungrouped scoring (E not a power of two, k = 1, a correction bias, scaling, renormalisation)."""
    from spruce.models.hf_config import MoEConfig
    from spruce.models.moe import select_experts

    scoring, e, k, norm, scale, has_bias = ROUTERS[router]
    cfg = MoEConfig(num_experts=e, top_k=k, intermediate_size=8, num_shared_experts=0, scoring=scoring,
                    num_groups=1, topk_groups=1, topk_method="greedy", norm_topk_prob=norm,
                    routed_scaling_factor=scale, first_k_dense_replace=0, layer_freq=1, norm_single=True)
    g = torch.Generator(device=DEVICE).manual_seed(t + e)
    logits = torch.randn(t, e, generator=g, device=DEVICE) * 3
    bias = torch.randn(e, generator=g, device=DEVICE) if has_bias else None
    F._FORCE_TRITON[0] = False
    want_w, want_ids = select_experts(logits, bias, cfg)
    F._FORCE_TRITON[0] = True
    got_w, got_ids = select_experts(logits, bias, cfg)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32 and got_ids.shape == (t, k)
    want_order, got_order = want_ids.argsort(dim=-1), got_ids.argsort(dim=-1)  # the same experts, any order
    assert torch.equal(want_ids.gather(1, want_order), got_ids.gather(1, got_order))
    torch.testing.assert_close(got_w.gather(1, got_order), want_w.gather(1, want_order), rtol=1e-5, atol=1e-6)


def test_grouped_routers_keep_the_reference():
    """DeepSeek-V3's group-limited routing is not fused: `route` is never asked (the reference's groups decide)."""
    from spruce.models.hf_config import MoEConfig
    from spruce.models.moe import select_experts

    cfg = MoEConfig(num_experts=16, top_k=4, intermediate_size=8, num_shared_experts=0, scoring="sigmoid",
                    num_groups=4, topk_groups=1, topk_method="noaux_tc", norm_topk_prob=True,
                    routed_scaling_factor=1.0, first_k_dense_replace=0, layer_freq=1)
    logits = torch.randn(3, 16, generator=torch.Generator(device=DEVICE).manual_seed(0), device=DEVICE)
    _, ids = select_experts(logits, torch.zeros(16, device=DEVICE), cfg)
    assert (ids // 4 == ids[:, :1] // 4).all()  # one group per token, as topk_groups = 1 says


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
def test_fused_router_keeps_ids_in_range_on_a_nan_row():
    """A row of NaN logits (a broken request's hidden state) still routes to experts that exist: an id past E
    would send the fused MoE kernel reading outside the expert weights."""
    from spruce.ops.router import route

    logits = torch.randn(3, 60, generator=torch.Generator(device=DEVICE).manual_seed(1), device=DEVICE)
    logits[1] = float("nan")
    weights, ids = route(logits, None, "softmax", 4, True, 1.0)
    assert ((ids >= 0) & (ids < 60)).all() and torch.isfinite(weights[0]).all()
