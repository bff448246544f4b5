"""FP8 KV cache (kv_cache_dtype="fp8_e4m3"): the cache holds k / k_scale and v / v_scale in float8_e4m3fn
(MLA: latent / k_scale), on the torch backend and the triton backend (its kernels widen the FP8 tiles; CPU:
Triton's interpreter, against the torch backend on the same FP8 cache); logits within FP8's error of the float32
cache; checkpoint scales loaded and applied; speculation == plain with the FP8 cache; unsupported settings
refused by name."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spruce import SamplingParams
from spruce.attention.backend import create_backend
from spruce.attention.metadata import Phase
from spruce.errors import ConfigError, InvariantError
from spruce.memory.kv_pool import LatentKVPool, latent_rows
from spruce.models.loader import load_target
from spruce.ops.fp8 import FP8_DTYPE
from checkpoints import PagedCache, write_deepseek_checkpoint, write_eagle3_checkpoint, write_llama_checkpoint
from oracle_draft import install_oracle

TOKENS = [[5, 17, 42, 8, 99, 23, 61, 7, 12, 33, 71, 2], [9, 4, 120, 66, 31]]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv8")
    return {"llama": write_llama_checkpoint(root / "llama", layers=3, init_std=0.05),
            "deepseek": write_deepseek_checkpoint(root / "ds", layers=3, experts=4, first_k_dense_replace=1,
                                                  init_std=0.02, rope_interleave=True)}


_MODELS: dict = {}  # checkpoint path -> loaded model (each loads once per module)


def run_logits(path, kv_dtype, page_size=4):
    """(model, cache, logits [T, V]) of a prefill of TOKENS[0] then two decode steps reading the cache."""
    if str(path) not in _MODELS:
        _MODELS[str(path)] = load_target(path, torch.float32, torch.device("cpu"), create_backend("torch", page_size))
    model = _MODELS[str(path)]
    cache = PagedCache.for_model(model, page_size=page_size)
    cache.kv = type(cache.kv)(*_pool_args(cache, model), kv_dtype, torch.device("cpu"))
    row = cache.add_row(32)
    outs = []
    tokens = TOKENS[0]
    hidden, _ = model(cache.batch([row], [0], [tokens[:-2]]), cache.kv, cache.table)
    outs.append(model.compute_logits(hidden))
    for i in (len(tokens) - 2, len(tokens) - 1):  # decode: one token each, over the cached prefix
        hidden, _ = model(cache.batch([row], [i], [[tokens[i]]]), cache.kv, cache.table)
        outs.append(model.compute_logits(hidden))
    return model, cache, torch.cat(outs)


def _pool_args(cache, model):
    c = model.config
    if c.mla is not None:
        return cache.limits, c.num_layers, c.mla.latent_dim, 0
    return cache.limits, c.num_layers, c.num_kv_heads, c.head_dim, 0


@pytest.mark.parametrize("fam", ["llama", "deepseek"])
def test_fp8_cache_is_within_fp8_error_of_the_float_cache(targets, fam):
    _, cache, got = run_logits(targets[fam], FP8_DTYPE)
    assert cache.kv.tensors[0].dtype == FP8_DTYPE
    _, _, want = run_logits(targets[fam], torch.float32)
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 0.05, rel  # e4m3 rounds each cached value by at most 2^-4 relative
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75


def _with_kv_scales(src, dst, scale: float, mla: bool) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(scale)
        if not mla:
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(2 * scale)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("fam", ["llama", "deepseek"])
def test_checkpoint_kv_scales_divide_what_the_cache_holds(targets, tmp_path, fam):
    scaled = _with_kv_scales(targets[fam], tmp_path / "s", 0.03, fam == "deepseek")
    model, cache, got = run_logits(scaled, FP8_DTYPE)
    attn = model.layers[0].self_attn
    assert attn.k_scale == pytest.approx(0.03)
    _, plain, want = run_logits(targets[fam], FP8_DTYPE)
    # the scaled cache holds the unit-scale cache's values / k_scale (up to FP8 rounding of each)
    scaled_k = cache.kv.tensors[0].float() * 0.03
    unit_k = plain.kv.tensors[0].float()
    used = unit_k.abs().sum(dim=tuple(range(2, unit_k.dim()))) > 0  # [L, slots] written slots
    rel = ((scaled_k - unit_k)[used].norm() / unit_k[used].norm()).item()
    assert rel < 0.08, rel
    assert scaled_k[used].abs().max() != unit_k[used].abs().max()  # really stored at another scale
    assert ((got - want).norm() / want.norm()).item() < 0.1  # each within 0.05 of the float cache (above)


def test_triton_kernels_read_the_fp8_cache_like_torch():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from test_triton_attention import SMALL, make_case
    from test_triton_mla import SMALL as MLA_SMALL
    from test_triton_mla import uniform_case

    from spruce.attention.torch_backend import TorchAttention
    from spruce.attention.triton_backend import TritonAttention

    def fp8(t):
        return t.clamp(-448, 448).to(FP8_DTYPE)

    for phase, q_len, width, kv in [(Phase.EXTEND, 5, 0, [0, 7]), (Phase.VERIFY, 6, 8, [9, 30]),
                                    (Phase.DECODE, 1, 0, [40, 75])]:
        q, k, v, kc, vc, start, batch, table = make_case(phase, 2, q_len, kv, 4, width, **SMALL, seed=5)
        kc, vc = fp8(kc * 3), fp8(vc * 3)
        rk, rv = kc.clone(), vc.clone()
        want = TorchAttention(4).forward(q, k, v, rk, rv, start, batch, table, 0.25)
        got = TritonAttention(4).forward(q, k, v, kc, vc, start, batch, table, 0.25)
        assert torch.equal(kc.float(), rk.float()) and torch.equal(vc.float(), rv.float())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        q, latent, cache, value_dim, start, batch, table = uniform_case(phase, 2, q_len, kv, 4, width, **MLA_SMALL,
                                                                        seed=6)
        cache = fp8(cache)
        ref = cache.clone()
        want = TorchAttention(4).forward_latent(q, latent, ref, value_dim, start, batch, table, 0.25)
        got = TritonAttention(4).forward_latent(q, latent, cache, value_dim, start, batch, table, 0.25)
        assert torch.equal(cache.float(), ref.float())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_grouped_decode_reads_the_fp8_cache_like_torch_across_kv_splits():
    """Decode runs each kv head's query heads as one tile (grouped_decode_kernel); long contexts split the kv
    range (here 2 splits: 600 keys on a 4-SM stand-in) and merge."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from test_triton_attention import SMALL, make_case

    from spruce.attention.torch_backend import TorchAttention
    from spruce.attention.triton_backend import TritonAttention

    q, k, v, kc, vc, start, batch, table = make_case(Phase.DECODE, 2, 1, [600, 90], 16, 0, **SMALL, seed=7)
    kc, vc = (kc * 3).clamp(-448, 448).to(FP8_DTYPE), (vc * 3).clamp(-448, 448).to(FP8_DTYPE)
    want = TorchAttention(16).forward(q, k, v, kc.clone(), vc.clone(), start, batch, table, 0.25)
    backend = TritonAttention(16)
    backend._sms = 4
    got = backend.forward(q, k, v, kc, vc, start, batch, table, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def fp8_cache_plain(targets):
    """family -> plain greedy outputs with the FP8 cache."""
    from spruce import LLM

    out = {}
    for fam in ("llama", "deepseek"):
        llm = LLM(targets[fam], page_size=16, kv_cache_dtype="fp8_e4m3")
        assert all(t.dtype == FP8_DTYPE for t in llm.engine.runner.target_kv.tensors)
        assert llm.engine.info()["kv_cache_dtype"] == "float8_e4m3fn"
        out[fam] = [o.token_ids for o in llm.generate(TOKENS, PARAMS)]
    return out


@pytest.mark.parametrize("fam,k,page", [("llama", 4, 1), ("deepseek", 1, 16)])
def test_eagle3_with_an_fp8_cache_equals_plain(make_llm, targets, fp8_cache_plain, tmp_path, fam, k, page):
    target = targets[fam]
    plain = fp8_cache_plain[fam]
    draft = write_eagle3_checkpoint(tmp_path / "e3", target, seed=2)
    s, n = {1: (3, 4), 4: (3, 8)}[k]
    llm = make_llm(target, page_size=page, kv_cache_dtype="fp8_e4m3", draft_model=str(draft),
                   speculative_algorithm="EAGLE3", speculative_num_steps=s, speculative_eagle_topk=k,
                   speculative_num_draft_tokens=n, cuda_graph=False)  # the oracle runs on the host
    oracle = install_oracle(llm, 0.6)
    for p, w in zip(TOKENS, plain):
        oracle.add_reference(p, w)
    assert [o.token_ids for o in llm.generate(TOKENS, PARAMS)] == plain
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.2


def test_kv_cache_dtype_is_checked(targets):
    from spruce import LLM

    with pytest.raises(ConfigError, match="kv_cache_dtype='int8' is not supported; expected one of"):
        LLM(targets["llama"], kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="quantization='awq' is not supported"):
        LLM(targets["llama"], quantization="awq")
    with pytest.raises(ConfigError, match="not supported by attention_backend='torch-split'"):
        LLM(targets["llama"], kv_cache_dtype="fp8", attention_backend="torch-split")


def test_an_attention_with_its_own_forward_refuses_the_fp8_cache(tmp_path):
    from spruce import LLM
    from moe_checkpoints import write_moe_checkpoint

    path = write_moe_checkpoint(tmp_path / "gptoss", "gpt_oss", layers=1)
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8_e4m3' is not supported for this model's attention"):
        LLM(path, kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("value", [[0.5, 0.5], -1.0])
def test_a_kv_scale_must_be_one_positive_value(targets, tmp_path, value):
    from spruce.errors import ModelLoadError

    dst = tmp_path / "bad"
    shutil.copytree(targets["llama"], dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(value)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="KV cache scale .*k_scale.* must be one positive finite value"):
        load_target(dst, torch.float32, torch.device("cpu"), create_backend("torch", 4))


def test_every_grouped_decode_candidate_reads_the_fp8_cache_like_torch():
    """Each launch configuration the decode-attention benchmark measures (keys per tile, prefetch or pipeliner)
    gives the torch backend's output on an FP8 cache across kv splits, for a float32 query and, with float16
    widening, a bfloat16 one (the interpreter's bfloat16 widening of FP8 is not the GPU's: not compared here)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from test_triton_attention import make_case

    from spruce.attention.torch_backend import TorchAttention
    from spruce.attention.triton_backend import GROUPED_CANDIDATES, TritonAttention

    shape = dict(heads=4, kv_heads=2, head_dim=16, dtype=torch.float32)
    q, k, v, kc, vc, start, batch, table = make_case(Phase.DECODE, 2, 1, [260, 40], 16, 0, **shape, seed=8)
    kc, vc = (kc * 3).clamp(-448, 448).to(FP8_DTYPE), (vc * 3).clamp(-448, 448).to(FP8_DTYPE)
    want = TorchAttention(16).forward(q, k, v, kc.clone(), vc.clone(), start, batch, table, 0.25)
    backend = TritonAttention(16)
    backend._sms = 4  # 2 requests x 2 kv heads on 4 stand-in SMs: the 260 keys split in 2
    assert backend.grouped_decode_config(FP8_DTYPE, torch.bfloat16).fp16_dot
    assert not backend.grouped_decode_config(FP8_DTYPE, torch.float32).fp16_dot
    backend.grouped_config = GROUPED_CANDIDATES[2]  # a float16-widening candidate: FP8 caches only
    assert backend.grouped_config.fp16_dot
    assert not backend.grouped_decode_config(torch.bfloat16, torch.bfloat16).fp16_dot
    h200 = TritonAttention(16)
    h200._sms = 132  # bs 8 x 8 kv heads at 32k: 2 programs per SM -> 8 splits, 4 per SM -> 16
    assert [h200.grouped_splits(64, 32768, c, torch.device("cpu")) for c in (GROUPED_CANDIDATES[0],
                                                                            GROUPED_CANDIDATES[-1])] == [8, 16]
    seen = set()  # the interpreter ignores warps and stages: one run per tile shape, loop and split count
    for cfg in GROUPED_CANDIDATES:
        shape_key = (cfg.block_n, cfg.prefetch, cfg.fp16_dot, cfg.per_sm)
        if not torch.cuda.is_available() and shape_key in seen:
            continue
        seen.add(shape_key)
        backend.grouped_config = cfg
        if not cfg.fp16_dot or torch.cuda.is_available():  # a float32 query drops FP16_DOT: as without it
            got = backend.forward(q, k, v, kc.clone(), vc.clone(), start, batch, table, 0.25)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=str(cfg))
        if cfg.fp16_dot:
            got = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), kc.clone(), vc.clone(), start, batch,
                                  table, 0.25)
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=4e-2, msg=str(cfg))


def test_float16_widening_clamps_a_query_past_float16s_range():
    """FP16_DOT casts q to float16 (largest 65504): a bfloat16 query entry of 1e5 saturates instead of becoming
    inf (whose scores would make the output NaN); the softmax it dominates picks the same key as float32 does."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from test_triton_attention import make_case

    from spruce.attention.torch_backend import TorchAttention
    from spruce.attention.triton_backend import GROUPED_CONFIG_FP8, TritonAttention

    shape = dict(heads=4, kv_heads=2, head_dim=16, dtype=torch.float32)
    q, k, v, kc, vc, start, batch, table = make_case(Phase.DECODE, 1, 1, [30], 16, 0, **shape, seed=9)
    kc, vc = (kc * 3).clamp(-448, 448).to(FP8_DTYPE), (vc * 3).clamp(-448, 448).to(FP8_DTYPE)
    q = q.clone()
    q[0, 0, 0] = 1e5
    want = TorchAttention(16).forward(q, k, v, kc.clone(), vc.clone(), start, batch, table, 0.25)
    backend = TritonAttention(16)
    assert GROUPED_CONFIG_FP8.fp16_dot
    got = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), kc.clone(), vc.clone(), start, batch, table,
                          0.25)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=4e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("key_dim,value_dim,heads", [(56, 48, 4), (576, 512, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("phase,q_len,width,kv", [(Phase.EXTEND, 1, 0, [448]), (Phase.DECODE, 1, 0, [449, 30]),
                                                  (Phase.VERIFY, 4, 8, [200, 9])])
def test_gpu_mla_kernel_reads_an_fp8_cache_like_torch(key_dim, value_dim, heads, dtype, layer, phase, q_len, width,
                                                      kv):
    """The MLA kernel over an FP8 latent cache on the device, at the tiny DeepSeek fixture's row of 56 bytes (not a
    multiple of 16: the pool pads its rows to 64) and DeepSeek's 576, with the cache a layer of a pool of an odd
    number of slots, as the engine passes it."""
    from test_triton_mla import uniform_case

    from spruce.attention.torch_backend import TorchAttention
    from spruce.attention.triton_backend import TritonAttention

    q, latent, cache, dv, start, batch, table = uniform_case(phase, len(kv), q_len, kv, 16, width, heads=heads,
                                                             key_dim=key_dim, value_dim=value_dim, dtype=dtype,
                                                             seed=11)
    slots = cache.shape[0] | 1  # odd: unpadded, layer 1 of the pool would start off a 16-byte boundary at Dk = 56
    pool = latent_rows(2, slots, key_dim, FP8_DTYPE, cache.device)
    pool[layer, :cache.shape[0]] = (cache.float() * 3).clamp(-448, 448).to(FP8_DTYPE)
    fp8_cache = pool[layer]
    want = TorchAttention(16).forward_latent(q, latent, fp8_cache.clone(), dv, start, batch, table, key_dim ** -0.5)
    got = TritonAttention(16).forward_latent(q, latent, fp8_cache, dv, start, batch, table, key_dim ** -0.5)
    torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("cache_dtype,want", [(FP8_DTYPE, "tf32"), (torch.float32, "ieee")])
def test_mla_kernel_over_an_fp8_cache_takes_tf32_dots_with_a_float32_query(cache_dtype, want):
    """A float32 query over an FP8 latent cache launches the MLA kernel with tf32 dots (exact for FP8 tiles): the
    float32 ("ieee") dot over widened FP8 tiles at Dv = 512 returned NaN in a quarter of the value columns on an
    H200 (test_gpu_mla_kernel_reads_an_fp8_cache_like_torch); a float32 cache keeps ieee."""
    from device_compile import record_launches
    from test_triton_mla import uniform_case

    import spruce.attention.triton_backend as tb

    q, latent, cache, dv, start, batch, table = uniform_case(Phase.VERIFY, 2, 4, [200, 9], 16, 8, heads=16,
                                                             key_dim=576, value_dim=512, dtype=torch.float32, seed=11)
    with record_launches(tb, ("mla_attention_kernel", "merge_latent_splits_kernel")) as launches:
        tb.TritonAttention(16).forward_latent(q, latent, cache.to(cache_dtype), dv, start, batch, table, 576 ** -0.5)
    (mla,) = [launch for launch in launches if launch["kernel"].endswith("mla_attention_kernel")]
    assert mla["kwargs"]["DOT_PRECISION"] == ["value", want]


@pytest.mark.parametrize("dtype,key_dim,stride", [(FP8_DTYPE, 56, 64), (FP8_DTYPE, 576, 576), (torch.bfloat16, 56, 56),
                                                  (torch.float32, 57, 60)])
def test_latent_pool_rows_start_on_16_byte_boundaries(dtype, key_dim, stride):
    """Every row of every layer of an MLA pool starts on a 16-byte boundary, whatever Dk and dtype (the MLA kernel's
    pipelined copies move 16 bytes: an FP8 row of 56 bytes faulted on the device), and the padding is counted in
    the pool's bytes per token."""
    from spruce.limits import Limits

    lim = Limits(max_running_requests=2, page_size=16, context_length=48, num_pages=3, chunked_prefill_size=48)
    pool = LatentKVPool(lim, 3, key_dim, 4, dtype, torch.device("cpu"))
    for i in range(3):
        layer = pool.layer(i)
        assert layer.shape[1] == key_dim and layer.stride(0) == stride
        assert layer.data_ptr() % 16 == 0 and layer.stride(0) * layer.element_size() % 16 == 0
    assert LatentKVPool.bytes_per_token(3, key_dim, dtype) == 3 * stride * layer.element_size()


def test_the_triton_mla_backend_refuses_a_misaligned_latent_cache():
    """A cache whose rows are off 16-byte boundaries is refused by name before any kernel runs (on the device it
    is a misaligned-address fault that poisons the CUDA context)."""
    from test_triton_mla import uniform_case

    from spruce.attention.triton_backend import TritonAttention, check_row_alignment

    q, latent, cache, dv, start, batch, table = uniform_case(Phase.DECODE, 1, 1, [20], 16, 0, heads=4, key_dim=56,
                                                             value_dim=48, dtype=torch.float32, seed=3)
    unpadded = torch.zeros(2, cache.shape[0] | 1, 56, dtype=FP8_DTYPE)[1]  # rows of 56 bytes
    with pytest.raises(InvariantError, match="56 bytes.*16-byte boundary"):
        TritonAttention(16).attend_latent(q, unpadded, dv, start, batch, table, 56 ** -0.5)
    check_row_alignment(latent_rows(2, cache.shape[0] | 1, 56, FP8_DTYPE, torch.device("cpu"))[1])  # the pool's


@pytest.mark.parametrize("cache_dtype,block_m", [(FP8_DTYPE, 16), (torch.float32, 64)])
def test_the_triton_mla_backend_runs_an_fp8_cache_in_16_row_blocks(monkeypatch, cache_dtype, block_m):
    """Over an FP8 latent cache the MLA kernel runs in 16-row blocks even where a request has 64 rows or more (the
    64-row kernel over FP8 tiles runs out of shared memory or returns NaN on the device:
    TritonAttention.latent_block); other caches keep 64."""
    import spruce.attention.triton_backend as tb
    from test_triton_mla import uniform_case

    q, latent, cache, dv, start, batch, table = uniform_case(Phase.DECODE, 2, 1, [20, 9], 16, 0, heads=128,
                                                             key_dim=56, value_dim=48, dtype=torch.float32, seed=3)
    launched = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.update(kw, grid=grid)

    monkeypatch.setattr(tb, "mla_attention_kernel", Recorder())
    monkeypatch.setattr(tb, "merge_latent_splits_kernel", Recorder())
    pool = latent_rows(1, cache.shape[0], 56, cache_dtype, torch.device("cpu"))[0]
    tb.TritonAttention(16).attend_latent(q, pool, dv, start, batch, table, 56 ** -0.5)
    assert launched["BLOCK_M"] == block_m and launched["num_warps"] == {16: 4, 64: 8}[block_m]
