"""The Triton attention kernels that multiply tiles (tl.dot) compile for an H200 (sm_90) at the launches the backend
makes for a tiny draft's heads, gpt-oss's windows and sinks, and MLA at the fixture's and DeepSeek-V3's sizes, over
bf16 and FP8 caches, and fit its shared memory: what Triton's interpreter, which runs them in CI, does not check (a
tl.dot over fewer than 16 values compiles there and nowhere else). The MoE align kernels likewise (histograms,
cumulative sums over 2-D tiles)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

import spruce.attention.triton_backend as tb  # noqa: E402
from device_compile import H200_SHARED_BYTES, compile_for, record_launches  # noqa: E402
from spruce.attention.metadata import Phase  # noqa: E402
from spruce.memory.kv_pool import latent_rows  # noqa: E402
from test_triton_attention import make_case  # noqa: E402
from test_triton_mla import uniform_case  # noqa: E402

pytestmark = pytest.mark.slow  # ~30 s of compiling with a cold Triton cache: scheduled first (conftest)

DOT_KERNELS = ("paged_attention_kernel", "grouped_decode_kernel", "mla_attention_kernel")
KERNELS = (*DOT_KERNELS, "merge_splits_kernel", "merge_latent_splits_kernel")  # recorded, none run
PHASES = [(Phase.DECODE, 1, 0, [40, 300]), (Phase.VERIFY, 4, 8, [40, 9])]  # extend: the paged kernel as verify
MHA = [dict(heads=4, kv_heads=2, head_dim=8), dict(heads=64, kv_heads=8, head_dim=64)]  # a tiny draft; gpt-oss
MLA = [dict(heads=4, key_dim=56, value_dim=48), dict(heads=128, key_dim=576, value_dim=512)]  # the fixture; V3


def mha_launches(shape: dict, cache_dtype: torch.dtype, q_dtype: torch.dtype) -> list[dict]:
    backend = tb.TritonAttention(16)
    backend._sms = 132
    gpt_oss = shape["head_dim"] == 64  # its sliding-window layers, with sinks
    with record_launches(tb, KERNELS) as launches:
        for phase, q_len, width, kv in PHASES:
            q, k, v, kc, vc, start, batch, table = make_case(phase, 2, q_len, kv, 16, width, **shape,
                                                             dtype=torch.float32)
            kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
            extra = dict(window=128, sinks=torch.zeros(shape["heads"], dtype=q_dtype)) if gpt_oss else {}
            backend.attend(q.to(q_dtype), kc, vc, start, batch, table, 0.1, **extra)
    return launches


def mla_launches(shape: dict, cache_dtype: torch.dtype, q_dtype: torch.dtype) -> list[dict]:
    backend = tb.TritonAttention(16)
    backend._sms = 132
    with record_launches(tb, KERNELS) as launches:
        for phase, q_len, width, kv in PHASES:
            q, _, cache, dv, start, batch, table = uniform_case(phase, 2, q_len, kv, 16, width, dtype=torch.float32,
                                                                **shape)
            pool = latent_rows(1, cache.shape[0], shape["key_dim"], cache_dtype, torch.device("cpu"))[0]
            backend.attend_latent(q.to(q_dtype), pool, dv, start, batch, table, 0.1)
    return launches


def align_launches() -> list[dict]:
    """Both Triton MoE aligns at DeepSeek-V3's verify-sized batches (256 experts, top 8: the largest tiles)."""
    from spruce.ops import moe

    ids = torch.zeros(1024, 8, dtype=torch.long)
    with record_launches(moe, ALIGN_KERNELS) as launches:
        moe._align_triton(ids[:16], 256, 16)
        moe._align_chunked(ids, 256, 16)
    return launches


ALIGN_KERNELS = ("_align_kernel", "_align_count_kernel", "_align_offsets_kernel", "_align_scatter_kernel")


def test_kernels_compile_for_an_h200():
    launches = []
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for shape in MHA:
            launches += mha_launches(shape, cache_dtype, torch.bfloat16)
        for shape in MLA:
            launches += mla_launches(shape, cache_dtype, torch.bfloat16)
    launches = [x for x in launches if x["kernel"].rsplit(".", 1)[1] in DOT_KERNELS] + align_launches()
    assert {x["kernel"].rsplit(".", 1)[1] for x in launches} == {*DOT_KERNELS, *ALIGN_KERNELS}
    results = compile_for(launches)  # one subprocess: Triton and torch imported once
    bad = [(x["kernel"], x["kwargs"], r) for x, r in results
           if "error" in r or r["shared"] > H200_SHARED_BYTES]
    assert not bad, bad
