"""GPU-only FP8: torch's scaled matmul (per-channel, per-token activation scales) and the Triton block-scaled
GEMM against the float32 emulation at real shapes in bf16; FP8 experts on the device; the triton backend on an
FP8 KV cache against the torch backend; speculation == plain greedy on FP8 targets and with an FP8 cache, CUDA
graphs on."""

from __future__ import annotations

import pytest
import torch

from spruce import SamplingParams
from checkpoints import write_deepseek_checkpoint, write_eagle3_checkpoint, write_llama_checkpoint
from fp8_checkpoints import write_fp8_checkpoint
from mtp_checkpoints import add_mtp_layers

pytestmark = pytest.mark.gpu

TOKENS = [[5, 17, 42, 8, 99, 23, 61, 7, 12, 33, 71, 2], [9, 4, 120, 66, 31]]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336)])
def test_scaled_mm_and_triton_gemm_equal_the_emulation(m, n, k):
    from spruce.ops import fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    for group in (None, 128):
        q, scale = fp8.quantize_rows(w, group)
        want = fp8.emulated_linear(x.float(), q, scale, group)
        got = fp8.fp8_linear(x, q, scale, group)
        assert got.dtype == torch.bfloat16
        # Triton (block, decode-sized M): weight-only, bf16 output rounding; scaled matmul: x quantized per token
        # too (e4m3, ~3% per value)
        assert rel(got, want) < (0.01 if group else 0.05), (group, rel(got, want))
        assert fp8.scaled_mm_fits(x, q, group) == (group is None)
        if m < fp8.SCALED_MM_MIN_TOKENS:  # decode-sized: the Triton GEMM, weight-only, whatever the layout
            assert rel(got, want) < 0.01


@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_every_decode_gemm_candidate_runs_and_equals_the_emulation(m):
    """ops/fp8_select's candidates at the 8B o_proj shape and a ragged one: each Triton one runs and matches the
    float32 emulation (measure() records 'wrong' / 'failed' otherwise); torch's matmuls may be unavailable."""
    from spruce.ops import fp8
    from spruce.ops.fp8_select import measure, pick

    w = torch.randn(4096, 4096, device="cuda") * 0.02
    q, blocks = fp8.quantize_blocks(w)
    for (weight, scale), group in (((q, fp8.block_scale_rows(blocks, 4096)), 128), (fp8.quantize_rows(w), None),
                                   (fp8.quantize_rows(w[:1000, :1040]), None)):
        times = measure(weight, scale, group, None, m)
        bad = {c: t for c, t in times.items() if isinstance(t, str) and not t.startswith("skipped")
               and not c.startswith("scaled_mm")}
        assert not bad, bad
        assert pick(times) is not None, times


def test_fp8_experts_on_the_device_equal_the_reference():
    from spruce.ops.fp8 import dequantize, fp8_moe, quantize_rows
    from spruce.ops.moe import fused_moe_reference

    g = torch.Generator(device="cuda").manual_seed(1)
    e, h, i, k = 16, 512, 256, 4
    w13, s13 = quantize_rows(torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.05, 128)
    w2, s2 = quantize_rows(torch.randn(e, h, i, device="cuda", generator=g) * 0.05, 128)
    for t in (1, 64):
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        weights = torch.rand(t, k, device="cuda", generator=g)
        want = fused_moe_reference(x.float(), dequantize(w13, s13, 128), dequantize(w2, s2, 128), ids, weights)
        assert rel(fp8_moe(x, w13, s13, w2, s2, 128, ids, weights), want) < 0.02


@pytest.fixture(scope="module")
def fp8_targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpufp8")
    llama = write_llama_checkpoint(root / "llama", hidden=256, heads=8, kv_heads=2, intermediate=512, init_std=0.05)
    ds = add_mtp_layers(write_deepseek_checkpoint(root / "ds0", first_k_dense_replace=1, init_std=0.05,
                                                  rope_interleave=True), root / "ds", num_layers=1)
    return {"llama": write_fp8_checkpoint(llama, root / "llama8", root / "llama8-twin", "block")[0],
            "deepseek": write_fp8_checkpoint(ds, root / "ds8", root / "ds8-twin", "block", (16, 16))[0],
            "llama-bf16": llama}


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("k", [1, 4])
def test_spec_equals_plain_on_fp8_targets_with_graphs(make_llm, fp8_targets, tmp_path, kv, k):
    """float32 activations: a verify step and a decode step run different FP8 GEMM kernels (by M), whose bf16
    roundings differ enough to flip the random tiny target's near-ties."""
    for fam in ("llama", "deepseek"):
        target = fp8_targets[fam]
        common = dict(device="cuda", dtype="float32", page_size=16, kv_cache_dtype=kv)
        plain_llm = make_llm(target, **common)
        if kv != "auto":  # auto runs triton, which reads an FP8 cache in every phase
            assert plain_llm.engine.info()["attention_backend"] == "triton"
        plain = [o.token_ids for o in plain_llm.generate(TOKENS, PARAMS)]
        s, n = {1: (3, 4), 4: (3, 8)}[k]
        spec = dict(speculative_algorithm="NEXTN") if fam == "deepseek" else dict(
            speculative_algorithm="EAGLE3", draft_model=str(write_eagle3_checkpoint(tmp_path / f"e3{kv}{k}",
                                                                                  target, seed=2)))
        # no oracle draft here: captured graphs replay the draft they captured, not a wrapper installed later
        llm = make_llm(target, speculative_num_steps=s, speculative_eagle_topk=k, speculative_num_draft_tokens=n,
                       **spec, **common)
        assert [o.token_ids for o in llm.generate(TOKENS, PARAMS)] == plain, (fam, kv, k)


def test_per_channel_at_load_equals_the_per_channel_checkpoint(make_llm, fp8_targets, tmp_path):
    """The same weights and per-row scales either way (the test writer's amax / 448 of the float32 weights), so
    the same tokens; in float32, since quantizing at load from bf16 weights rounds them first."""
    src = fp8_targets["llama-bf16"]
    channel = write_fp8_checkpoint(src, tmp_path / "c", tmp_path / "c-twin", "channel")[0]
    common = dict(device="cuda", dtype="float32", page_size=16)
    at_load = [o.token_ids for o in make_llm(src, quantization="fp8", **common).generate(TOKENS, PARAMS)]
    assert at_load == [o.token_ids for o in make_llm(channel, **common).generate(TOKENS, PARAMS)]
