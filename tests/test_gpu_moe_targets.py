"""GPU-only: the MoE targets (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss with a window shorter than the prompts,
Llama 4 with chunks shorter than the prompts) on tiny random checkpoints through the CUDA path: Triton attention
(windows, sinks, chunks) and the fused MoE kernels (biases, clamped SwiGLU, input-weighted top-1), float32,
eager and in CUDA graphs, greedy equal to transformers' (computed on the CPU), and EAGLE-3 trees (K 4, pages of
16, graphs) equal to plain greedy, on one GPU and (2 GPUs) tensor-parallel over NCCL; bf16 plain and speculative
greedy run and are reported side by side."""

from __future__ import annotations

import pytest
import torch

from spruce import LLM, SamplingParams
from moe_checkpoints import engine_case
from test_gpu import generate

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")

YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
            truncate=False, rope_theta=150000.0)
VARIANTS = {
    "qwen3_moe": dict(),
    "qwen2_moe": dict(decoder_sparse_step=2, layers=3),
    "mixtral": dict(),
    "gpt_oss": dict(sliding_window=8, rope_parameters=YARN),
    "llama4": dict(layers=4, top_k=1, interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4),
}
MAX_NEW = 24
SPEC = dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=4,
            speculative_num_draft_tokens=8)


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    return engine_case(tmp_path_factory.mktemp(request.param), request.param, (5, 23, 40, 70), MAX_NEW,
                       **VARIANTS[request.param])


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_float32_greedy_equals_transformers(case, cuda_graph):
    target, _, prompts, want = case
    got, _ = generate(target, prompts, MAX_NEW, dtype="float32", page_size=16, max_running_requests=4,
                      cuda_graph=cuda_graph)
    assert got == want


def test_float32_spec_in_graphs_equals_plain(case):
    target, draft, prompts, want = case
    got, _ = generate(target, prompts, MAX_NEW, dtype="float32", page_size=16, max_running_requests=4,
                      draft_model=draft, **SPEC)
    assert got == want


def test_bf16_spec_runs_beside_plain(case):
    target, draft, prompts, _ = case
    plain, _ = generate(target, prompts, MAX_NEW, dtype="bfloat16", page_size=16, max_running_requests=4)
    spec, _ = generate(target, prompts, MAX_NEW, dtype="bfloat16", page_size=16, max_running_requests=4,
                       draft_model=draft, **SPEC)
    same = sum(a == b for p, s in zip(plain, spec) for a, b in zip(p, s)) / sum(map(len, plain))
    print(f"{target}: bf16 spec tokens equal to plain: {same:.1%}")
    assert all(len(s) == MAX_NEW for s in spec)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_float32_tp2_spec_in_graphs_equals_transformers(case):
    """tp 2 over NCCL, the collectives captured in CUDA graphs, EAGLE-3 trees: transformers' greedy tokens."""
    target, draft, prompts, want = case
    llm = LLM(target, device="cuda", attention_backend="triton", dtype="float32", page_size=16,
              max_running_requests=4, cuda_graph=True, tp_size=2, draft_model=draft, **SPEC)
    try:
        assert llm.engine.runner.graphs.enabled
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))]
        llm.engine.check_no_leaks()
    finally:
        llm.shutdown()
    assert got == want
