"""Llama 4 (text) targets equal transformers on tiny random checkpoints saved by transformers itself (float32):
rope layers with chunked attention (chunks shorter than the prompts) and L2-normed q/k, a no-rope layer with
full attention and query temperature tuning, top-1 MoE (sigmoid weight on the expert's input, shared expert)
interleaved with dense MLPs of intermediate_size_mlp.
- logits on the hand-driven paged cache (chunked prefill, then a decode step; every row compared);
- greedy tokens through the whole engine (overlap on and off, page 1 and 16);
- EAGLE-3 tree speculation (oracle-steered random head) equal to plain greedy for K in {1, 4} x page {1, 16}:
  a chunk boundary inside a tree cuts the node's ancestors before it;
- refusals: a backend without chunked attention, top-k above 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spruce import LLM, SamplingParams
from spruce.errors import ConfigError, ModelLoadError
from spruce.models.hf_config import ModelConfig
from moe_checkpoints import engine_case, write_moe_checkpoint
from test_models_vs_hf import logit_diff_vs_hf
from test_moe_targets_vs_hf import spec_llm

transformers = pytest.importorskip("transformers")

TOL = 1e-4
CHUNK = 8  # shorter than every engine prompt but the first, and than the 17- and 70-token logit prompts
# floor_scale 4: the temperature differs from 1 from position 3 on (8192 in the published models)
BASE = dict(layers=4, top_k=1, interleave_moe_layer_step=2, attention_chunk_size=CHUNK, floor_scale=4)
MAX_NEW = 10
PROMPT_LENGTHS = (5, 23, 40)
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)

LOGIT_VARIANTS = [
    BASE,
    dict(BASE, interleave_moe_layer_step=1, use_qk_norm=False, attn_temperature_tuning=False,
         rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64, rope_theta=500000.0)),
]


@pytest.mark.parametrize("extra", LOGIT_VARIANTS, ids=lambda v: str(v)[:60])
def test_logits_equal_transformers(tmp_path, extra):
    worst = logit_diff_vs_hf(write_moe_checkpoint(tmp_path / "m", "llama4", **extra))
    print(f"llama4 {extra}: max abs logit diff {worst:.2e}")
    assert worst < TOL


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return engine_case(tmp_path_factory.mktemp("llama4"), "llama4", PROMPT_LENGTHS, MAX_NEW, **BASE)


def test_layer_kinds(case):
    cfg = ModelConfig.from_dir(case[0])
    assert [cfg.layer_chunk(i) for i in range(4)] == [CHUNK, CHUNK, CHUNK, None]
    assert cfg.rope_layers == (True, True, True, False)
    assert [cfg.moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


@pytest.mark.parametrize("page,overlap", [(1, False), (16, True)])
def test_greedy_equals_transformers(make_llm, case, page, overlap):
    target, _, prompts, want = case
    llm = make_llm(target, page_size=page, max_running_requests=4, chunked_prefill_size=32,
                   disable_overlap_schedule=not overlap)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == want


@pytest.mark.parametrize("k,page", [(1, 1), (4, 16), (4, 1), (1, 16)])
def test_spec_greedy_equals_plain(make_llm, case, k, page):
    llm = spec_llm(make_llm, case, k, page)
    assert [o.token_ids for o in llm.generate(case[2], PARAMS)] == case[3]
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.2


def test_backend_without_chunks_is_refused(case):
    with pytest.raises(ConfigError, match=r"attention_backend='torch-split' has no chunked attention, which the "
                                          r"target needs; backends with it: 'torch'"):
        LLM(case[0], attention_backend="torch-split")


def test_top_k_above_one_is_refused(tmp_path, case):
    cfg = json.loads((Path(case[0]) / "config.json").read_text())
    cfg["num_experts_per_tok"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok=2 .* is not supported for Llama4ForCausalLM"):
        ModelConfig.from_dir(tmp_path)
