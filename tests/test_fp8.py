"""FP8 weights on CPU (emulated: dequantized, float32 products): every published layout loads into spruce's
fused parameters and matches its float32 dequantized twin (tests/fp8_checkpoints.py) on a tiny Llama and a tiny
DeepSeek-V3 (MLA with interleaved rope, MoE, shared experts); a float checkpoint quantized at load equals its
per-channel twin; unsupported methods are refused by name; the Triton GEMM (interpreter) and the FP8 experts
equal their references; speculation (EAGLE-3 on Llama, NEXTN on DeepSeek) equals plain greedy on FP8 targets."""

from __future__ import annotations

import json
import os

import pytest
import torch

from spruce import SamplingParams
from spruce.attention.backend import create_backend
from spruce.errors import ModelLoadError
from spruce.models.loader import load_target
from checkpoints import PagedCache, write_deepseek_checkpoint, write_eagle3_checkpoint, write_llama_checkpoint
from fp8_checkpoints import LAYOUTS, write_fp8_checkpoint
from mtp_checkpoints import add_mtp_layers
from oracle_draft import install_oracle

TOKENS = [[5, 17, 42, 8, 99, 23, 61, 7, 12, 33, 71, 2], [9, 4, 120, 66, 31]]
MAX_NEW = 8
BLOCKS = {"block": (20, 32), "channel": None, "tensor": None}  # 20-row blocks straddle q/k/v and rope rows


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    llama = write_llama_checkpoint(root / "llama", layers=3, init_std=0.05)
    deepseek = add_mtp_layers(write_deepseek_checkpoint(root / "ds0", layers=2, experts=4, first_k_dense_replace=1,
                                                        init_std=0.05, rope_interleave=True), root / "deepseek",
                              num_layers=1)
    return {"llama": llama, "deepseek": deepseek, "root": root}


@pytest.fixture(scope="module")
def fp8_dirs(sources):
    """(family, layout) -> (FP8 checkpoint, its dequantized twin)."""
    out = {}
    for fam in ("llama", "deepseek"):
        for layout in LAYOUTS:
            base = sources["root"] / f"{fam}-{layout}"
            out[fam, layout] = write_fp8_checkpoint(sources[fam], base, f"{base}-twin", layout, BLOCKS[layout])
    return out


_LOGITS: dict = {}  # (path, quantization) -> (model, logits): each model runs once per module


def prompt_logits(path, quantization=None):
    """(model, float32 logits [T, V]) of TOKENS[0] run as one prefill on a hand-driven paged cache."""
    key = (str(path), quantization)
    if key not in _LOGITS:
        model = load_target(path, torch.float32, torch.device("cpu"), create_backend("torch", 4),
                            quantization=quantization)
        cache = PagedCache.for_model(model)
        row = cache.add_row(32)
        hidden, _ = model(cache.batch([row], [0], [TOKENS[0]]), cache.kv, cache.table)
        _LOGITS[key] = model, model.compute_logits(hidden)
    return _LOGITS[key]


def fp8_modules(model) -> int:
    from spruce.models.moe import RoutedExperts
    from spruce.models.quantization import Fp8Linear

    return sum(isinstance(m, Fp8Linear) or (isinstance(m, RoutedExperts) and m.is_fp8) for m in model.modules())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fam", ["llama", "deepseek"])
def test_fp8_checkpoint_matches_its_dequantized_twin(fp8_dirs, fam, layout):
    fp8, twin = fp8_dirs[fam, layout]
    model, got = prompt_logits(fp8)
    _, want = prompt_logits(twin)
    # q/k/v, o, gate/up, down per layer (MLA: q_a, q_b, kv_a, o; kv_b is dequantized at load; expert banks)
    assert fp8_modules(model) >= 4 * model.config.num_layers
    # the same float32 products in another order: far below FP8's own error (~6% per weight)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("fam", ["llama", "deepseek"])
def test_quantized_at_load_matches_the_per_channel_checkpoint(sources, fp8_dirs, fam):
    model, got = prompt_logits(sources[fam], quantization="fp8")
    assert fp8_modules(model) > 0
    _, twin = prompt_logits(fp8_dirs[fam, "channel"][1])
    _, full = prompt_logits(sources[fam])
    if fam == "llama":  # the same per-row amax / 448 scales as the test's own writer
        torch.testing.assert_close(got, twin, rtol=1e-4, atol=1e-4)
    # the format's error against the float model: a few percent of the logits' norm
    assert ((got - full).norm() / full.norm()).item() < 0.1
    assert (got.argmax(-1) == full.argmax(-1)).float().mean().item() >= 0.75


def test_triton_fp8_gemm_equals_the_emulation():
    pytest.importorskip("triton")
    import spruce.ops.fp8 as fp8

    g = torch.Generator().manual_seed(0)
    old = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        for m, n, k, group in [(1, 40, 96, 32), (20, 70, 200, 128), (3, 24, 64, None)]:
            x = torch.randn(m, k, generator=g)
            w, scale = fp8.quantize_rows(torch.randn(n, k, generator=g), group)
            bias = torch.randn(n, generator=g)
            want = fp8.emulated_linear(x, w, scale, group, bias)
            fp8._FORCE_TRITON[0] = True
            try:
                got = fp8.fp8_linear(x, w, scale, group, bias)
            finally:
                fp8._FORCE_TRITON[0] = False
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            from spruce.ops.fp8_gemm import fp8_gemm

            split = fp8_gemm(x, w, scale, group, bias, splits=3)  # K split in 3 (decode), summed in order
            torch.testing.assert_close(split, want, rtol=1e-5, atol=1e-4)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)


@pytest.mark.parametrize("tokens", [1, 6])  # T*k <= E: per-assignment experts; above: dequantized banks
def test_fp8_experts_equal_the_reference_on_dequantized_banks(tokens):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import spruce.ops.fp8 as fp8
    from spruce.ops.fp8 import dequantize, fp8_moe, quantize_rows
    from spruce.ops.moe import fused_moe_reference

    g = torch.Generator().manual_seed(1)
    e, h, i, k = 8, 32, 16, 2
    w13, s13 = quantize_rows(torch.randn(e, 2 * i, h, generator=g), 16)
    w2, s2 = quantize_rows(torch.randn(e, h, i, generator=g))
    x = torch.randn(tokens, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    want = fused_moe_reference(x, dequantize(w13, s13, 16), dequantize(w2, s2, None), ids, weights)
    torch.testing.assert_close(fp8_moe(x, w13, s13, w2, s2, 16, ids, weights), want, rtol=1e-5, atol=1e-5)
    # the same banks in one scale group per 16 columns through the fused Triton kernels (interpreter on CPU)
    w2, s2 = quantize_rows(torch.randn(e, h, i, generator=g), 16)
    want = fused_moe_reference(x, dequantize(w13, s13, 16), dequantize(w2, s2, 16), ids, weights)
    for group, scales in ((16, (s13, s2)), (None, None)):
        if group is None:  # per-channel banks
            w13, s13 = quantize_rows(dequantize(w13, s13, 16))
            w2, s2 = quantize_rows(dequantize(w2, s2, 16))
            want = fused_moe_reference(x, dequantize(w13, s13, None), dequantize(w2, s2, None), ids, weights)
        fp8._FORCE_TRITON[0] = True
        try:
            got = fp8_moe(x, w13, s13, w2, s2, group, ids, weights)
        finally:
            fp8._FORCE_TRITON[0] = False
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_per_channel_group_of_each_bank_is_its_own(tmp_path):
    """Expert banks with different K (H for w13, I for w2) each get one scale per row."""
    from spruce.models.moe import RoutedExperts

    experts = RoutedExperts(4, 32, 16)
    experts.w13.data.normal_()
    experts.w2.data.normal_()
    experts.quantize_fp8()
    assert experts.w13_scale.shape == (4, 32, 1) and experts.w2_scale.shape == (4, 32, 1)


def _with_quantization_config(src, dst, quant) -> str:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("quant,words", [
    ({"quant_method": "gptq", "bits": 4}, ["'gptq'", "not supported", "fp8", "compressed-tensors"]),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {}}},
     ["'pack-quantized'", "float-quantized"]),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "channel"}}}},
     ["8-bit float"]),
    ({"quant_method": "fp8", "weight_block_size": [128, 100]}, ["[128, 100]", "power of two"]),
])
def test_unsupported_quantization_is_refused_by_name(sources, tmp_path, quant, words):
    path = _with_quantization_config(sources["llama"], tmp_path / "q", quant)
    with pytest.raises(ModelLoadError) as e:
        load_target(path, torch.float32, torch.device("cpu"), create_backend("torch", 4))
    for w in words:
        assert w in str(e.value)


def test_fp8_tensors_without_a_quantization_config_are_refused(fp8_dirs, tmp_path):
    import shutil

    src = fp8_dirs["llama", "block"][0]
    dst = tmp_path / "noconfig"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="is FP8 .*no supported quantization_config"):
        load_target(dst, torch.float32, torch.device("cpu"), create_backend("torch", 4))


def test_an_fp8_lm_head_is_refused(fp8_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    src = fp8_dirs["llama", "channel"][0]
    dst = tmp_path / "head"
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    head = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = head.to(torch.float8_e4m3fn)
    tensors["lm_head.weight_scale"] = torch.ones(head.shape[0], 1)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lm_head.weight cannot hold FP8"):
        load_target(dst, torch.float32, torch.device("cpu"), create_backend("torch", 4))


# --- speculation on FP8 targets ----------------------------------------------------------------------------

PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_fp8_plain(fp8_dirs):
    from spruce import LLM

    llm = LLM(fp8_dirs["llama", "block"][0], page_size=16)
    assert llm.engine.info()["weights"] == "fp8 (block-wise 20x32)"
    return [o.token_ids for o in llm.generate(TOKENS, PARAMS)]


@pytest.fixture(scope="module")
def llama_draft(fp8_dirs, tmp_path_factory):
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("d") / "e3", fp8_dirs["llama", "block"][1], seed=2))


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("page", [1, 16])
def test_eagle3_on_an_fp8_llama_equals_plain(make_llm, fp8_dirs, llama_draft, llama_fp8_plain, k, page):
    s, n = {1: (3, 4), 4: (3, 8)}[k]
    llm = make_llm(fp8_dirs["llama", "block"][0], page_size=page, draft_model=llama_draft,
                   speculative_algorithm="EAGLE3", speculative_num_steps=s, speculative_eagle_topk=k,
                   speculative_num_draft_tokens=n)
    oracle = install_oracle(llm, 0.6)
    for p, w in zip(TOKENS, llama_fp8_plain):
        oracle.add_reference(p, w)
    assert [o.token_ids for o in llm.generate(TOKENS, PARAMS)] == llama_fp8_plain
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.2


@pytest.fixture(scope="module")
def deepseek_fp8_plain(fp8_dirs):
    from spruce import LLM

    path = fp8_dirs["deepseek", "block"][0]
    return [o.token_ids for o in LLM(path, page_size=16).generate(TOKENS, PARAMS)]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("page", [1, 16])
def test_nextn_on_an_fp8_deepseek_equals_plain(make_llm, fp8_dirs, deepseek_fp8_plain, k, page):
    s, n = {1: (3, 4), 4: (3, 8)}[k]
    llm = make_llm(fp8_dirs["deepseek", "block"][0], page_size=page, speculative_algorithm="NEXTN",
                   speculative_num_steps=s, speculative_eagle_topk=k, speculative_num_draft_tokens=n)
    draft = llm.engine.runner.draft
    assert fp8_modules(draft) > 0  # the MTP layers run in FP8 too
    oracle = install_oracle(llm, 0.6)
    for p, w in zip(TOKENS, deepseek_fp8_plain):
        oracle.add_reference(p, w)
    assert [o.token_ids for o in llm.generate(TOKENS, PARAMS)] == deepseek_fp8_plain
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.2


def test_a_block_scale_of_the_wrong_shape_is_refused(fp8_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    dst = tmp_path / "badscale"
    shutil.copytree(fp8_dirs["llama", "block"][0], dst)
    tensors = load_file(dst / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"scale 'model.layers.0.mlp.down_proj.weight_scale_inv' has shape"):
        load_target(dst, torch.float32, torch.device("cpu"), create_backend("torch", 4))


def test_fp8_weights_with_tensor_parallelism_are_refused():
    from spruce.models.quantization import Fp8Scheme, make_fp8

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    model[0].weight.tp_shard = (0, 2, 0)  # a rank's rows (distributed/layers.mark_shard)
    with pytest.raises(ModelLoadError, match="tensor parallelism"):
        make_fp8(model, "0.weight", Fp8Scheme("fp8"), "layers.0.o_proj.weight")


def _add_tensors(src, dst, extra: dict) -> str:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors.update(extra)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_static_activation_scales_quantize_the_linear_inputs(fp8_dirs, tmp_path):
    from spruce.ops.fp8 import emulated_linear, fake_quantize

    src = fp8_dirs["llama", "tensor"][0]
    scales = {f"model.layers.0.self_attn.{p}_proj.input_scale": torch.tensor(v)
              for p, v in (("q", 0.01), ("k", 0.03), ("v", 0.02))}
    model, got = prompt_logits(_add_tensors(src, tmp_path / "static", scales))
    _, dynamic = prompt_logits(src)
    qkv = model.layers[0].self_attn.qkv
    assert qkv.input_scale.item() == pytest.approx(0.03)  # the fused shards share the largest
    x = torch.randn(3, qkv.in_features)
    want = emulated_linear(fake_quantize(x, qkv.input_scale), qkv.weight, qkv.weight_scale, None)
    torch.testing.assert_close(qkv(x), want)
    assert not torch.equal(got, dynamic)  # the inputs of layer 0's q/k/v went through FP8
    assert ((got - dynamic).norm() / dynamic.norm()).item() < 0.1


def test_static_activation_scales_of_experts_are_refused(fp8_dirs, tmp_path):
    src = fp8_dirs["deepseek", "tensor"][0]
    path = _add_tensors(src, tmp_path / "moe", {"model.layers.1.mlp.experts.0.gate_proj.input_scale":
                                                torch.tensor(0.1)})
    with pytest.raises(ModelLoadError, match="routed experts with static FP8 activation scales are not supported"):
        load_target(path, torch.float32, torch.device("cpu"), create_backend("torch", 4))


def test_fp8_gemv_equals_the_emulation():
    """The decode-sized GEMV, CUDA-core (M <= 4) and tensor-core tiles, one K range or several (the last program
    of a column block sums the partials in order), per-channel and grouped scales, ragged N and K, with and without
    loading the next weight tile ahead (prefetch: K ranges of whole steps; ragged ones run the plain loop)."""
    pytest.importorskip("triton")
    from spruce.ops.fp8_gemm import fp8_gemv

    import spruce.ops.fp8 as fp8

    g = torch.Generator().manual_seed(3)
    for m, n, k, group in [(1, 40, 96, 32), (3, 70, 256, 128), (1, 64, 500, None), (7, 48, 200, None)]:
        x = torch.randn(m, k + 16, generator=g)[:, :k]  # values past K: a read past a row's end shows
        w, scale = fp8.quantize_rows(torch.randn(n, k, generator=g), group)
        bias = torch.randn(n, generator=g)
        want = fp8.emulated_linear(x, w, scale, group, bias)
        for dot in ([False, True] if m <= 4 else [True]):
            # prefetch (the CUDA-core candidates'): K 256 in 2 ranges of whole steps; K 500's last step is ragged
            for splits, prefetch in [(1, False), (3, False)] + ([] if dot else [(2, True)]):
                got = fp8_gemv(x, w, scale, group, bias, block_n=16, block_k=32, use_dot=dot, splits=splits,
                               prefetch=prefetch)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=f"{m, n, k, dot, splits, prefetch}")
    with pytest.raises(ValueError, match="at most 4 rows"):
        fp8_gemv(torch.randn(5, 32), w[:, :32], scale, None)
    with pytest.raises(ValueError, match="must divide the scale group"):
        fp8_gemv(torch.randn(1, 256), *fp8.quantize_rows(torch.randn(8, 256), 64), 64, block_k=128)
    import spruce.ops.fp8_gemm as fp8_gemm

    old_slots = fp8_gemm._COUNT_SLOTS
    fp8_gemm._COUNT_SLOTS = 4  # fewer split-K arrival counts than the 8 column blocks of 16 rows in 2-row tiles
    try:
        with pytest.raises(ValueError, match="8 column blocks"):
            fp8_gemv(torch.randn(1, 32), *fp8.quantize_rows(torch.randn(16, 32)), None, block_n=2, block_k=16,
                     splits=2)
    finally:
        fp8_gemm._COUNT_SLOTS = old_slots


def test_fused_activation_quantization_equals_the_reference():
    """One launch: per-token (the reference quantize_per_token) and per-token-and-group scales (quantize_rows), the
    padded rows zero, the scales column-major when asked."""
    pytest.importorskip("triton")
    from spruce.ops.fp8_gemm import quantize_activations

    import spruce.ops.fp8 as fp8

    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))

    def same_codes(got, want):  # Triton's interpreter rounds some values just below a power of two down to half
        got, want = got.float(), want.float()
        off = got != want
        assert torch.equal(got[off] * 2, want[off]) and off.float().mean() < 0.05
        return True

    q, s = quantize_activations(x)
    rq, rs = fp8.quantize_per_token(x)
    assert torch.equal(s, rs) and same_codes(q, rq)
    q, s = quantize_activations(x, 128, rows=4, scale_major="col")
    rq, rs = fp8.quantize_rows(x, 128)
    assert s.shape == (4, 3) and s.stride() == (1, 4) and torch.equal(s[:3], rs) and same_codes(q[:3], rq)
    assert not q[3].float().any()


def test_kernel_choice_is_the_fastest_fitting_candidate_in_a_fixed_order():
    from spruce.ops import fp8_select as sel

    first, second = sel.CANDIDATES[0].name, sel.CANDIDATES[1].name
    assert sel.pick({first: 1.0, second: 0.98}) == first  # within MARGIN: the earlier candidate
    assert sel.pick({first: 1.0, second: 0.9}) == second
    assert sel.pick({first: "failed: x", second: 2.0}) == second
    assert sel.pick({first: "wrong: x"}) is None
    rowwise, block = sel.BY_NAME["scaled_mm-rowwise"], sel.BY_NAME["scaled_mm-block"]
    assert rowwise.fits(1, 4096, 4096, None, False) is None
    assert rowwise.fits(1, 4096, 4096, 128, False) and rowwise.fits(1, 4096, 4096, None, True)
    assert block.fits(1, 4096, 4096, 128, False) is None and block.fits(1, 4096, 4000, 128, False)
    fma = sel.BY_NAME["gemv-fma-32x512-w8-c"]
    assert fma.fits(4, 4096, 4096, None, False) is None and fma.fits(8, 4096, 4096, None, False)
    assert fma.fits(1, 4096, 4096, 128, False)  # a K step of 512 crosses the 128-wide groups
    assert [sel.bucket(m) for m in (1, 2, 3, 5, 16)] == [1, 2, 4, 8, 16]


def test_block_scales_for_the_block_scaled_matmul():
    """128x128 block scales become torch's [G padded to 4, N / 128] view; per-row group scales are refused."""
    from spruce.ops import fp8
    from spruce.ops.fp8_select import block_scales_t

    w = torch.randn(256, 640)
    _, blocks = fp8.quantize_blocks(w)  # [2, 5]
    t = block_scales_t(fp8.block_scale_rows(blocks, 256), 128)
    assert t.shape == (8, 2) and torch.equal(t[:5], blocks.t()) and not t[5:].any()
    assert block_scales_t(fp8.quantize_rows(w, 128)[1], 128) is None
    assert block_scales_t(fp8.block_scale_rows(blocks, 256), None) is None


def test_the_kernel_table_reads_back_what_the_bench_writes(tmp_path, monkeypatch):
    """--write-table writes this process's choices; ops/fp8_select reads them as (bucket, N, K, layout, static
    input, dtype) -> kernel, and ignores a kernel it does not know."""
    import json

    from spruce.ops import fp8_select as sel

    monkeypatch.setattr(sel, "TABLES_DIR", tmp_path)
    monkeypatch.setattr(sel, "_CHOICES", {("GPU X", 4, 4096, 14336, "group128", False, torch.bfloat16):
                                          sel.BY_NAME["gemv-dot-32x128-w8"]})
    rows = sel.table_rows("GPU X") + [dict(m=1, n=8, k=8, layout="channel", kernel="gone")]
    sel.table_path("GPU X").write_text(json.dumps({"device": "GPU X", "choices": rows}))
    assert sel.table_path("GPU X").name == "fp8_gemm-gpu-x.json"
    assert sel.load_table("GPU X") == {(4, 4096, 14336, "group128", False, torch.bfloat16): "gemv-dot-32x128-w8"}
    assert sel.load_table("GPU Y") == {}


def test_every_packaged_kernel_table_is_read_whole():
    """Each packaged table (tables/fp8_gemm-<device>.json, installed with the package) names its device, and every
    row is a known weight-only kernel at an M bucket, so `load_table` drops none of it."""
    import json

    from spruce.ops import fp8_select as sel

    tables = sorted(sel.TABLES_DIR.glob("fp8_gemm-*.json"))
    assert tables, f"no packaged FP8 kernel table in {sel.TABLES_DIR}"
    for path in tables:
        data = json.loads(path.read_text())
        assert sel.table_path(data["device"]) == path
        assert data["choices"] and len(sel.load_table(data["device"])) == len(data["choices"]), path
        assert all(r["m"] in sel.BUCKETS and not sel.BY_NAME[r["kernel"]].name.startswith("scaled_mm")
                   for r in data["choices"]), path


def test_load_time_choice_keeps_decode_weight_only():
    """At load only weight-only kernels are candidates (decode and verify share one numerics); the bench measures
    the W8A8 ones too."""
    from spruce.ops import fp8
    from spruce.ops.fp8_select import measure

    w, scale = fp8.quantize_rows(torch.randn(32, 64))
    times = measure(w, scale, None, None, 1, only=("scaled_mm-rowwise",), dtype=torch.float32, weight_only=True)
    assert times["scaled_mm-rowwise"].startswith("skipped: W8A8")
