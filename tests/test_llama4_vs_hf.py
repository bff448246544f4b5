"""Llama 4 (text) targets equal transformers on tiny random checkpoints saved by transformers itself (float32):
rope layers with chunked attention (chunks shorter than the prompts) and L2-normed q/k, a no-rope layer with
full attention and query temperature tuning, top-1 MoE (sigmoid weight on the expert's input, shared expert)
interleaved with dense MLPs of intermediate_size_mlp.
- logits on the hand-driven paged cache (chunked prefill, then a decode step; every row compared);
- greedy tokens through the whole engine (overlap on and off, page 1 and 16);
- EAGLE-3 tree speculation (oracle-steered random head) equal to plain greedy, K 1 on pages of 1 and K 4 on
  pages of 16: a chunk boundary inside a tree cuts the node's ancestors before it;
- tensor parallelism (tp 2, gloo) with EAGLE-3 trees equal to tp 1;
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
from test_moe_targets_vs_hf import spec_llm, tp2_spec_equals_tp1

transformers = pytest.importorskip("transformers")

TOL = 1e-4
CHUNK = 8  # shorter than every engine prompt but the first, and than the 17- and 70-token logit prompts
# floor_scale 4: the temperature differs from 1 from position 3 on (8192 in the published models)
BASE = dict(layers=4, top_k=1, interleave_moe_layer_step=2, attention_chunk_size=CHUNK, floor_scale=4)
MAX_NEW = 8
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


@pytest.mark.parametrize("k,page", [(1, 1), (4, 16)])
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


def test_image_text_checkpoint_language_model_equals_transformers(tmp_path):
    """The published layout (Llama4ForConditionalGeneration: text_config, `language_model.` names, a vision
    tower that is skipped): the text model's logits equal transformers' on text-only input."""
    import torch

    from test_models_vs_hf import load, max_diff_vs_hf, run_paged

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=CHUNK, floor_scale=4,
                no_rope_layers=[1, 0], initializer_range=0.2, eos_token_id=1, bos_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text,
                                                                               vision_config=vision)).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.normal_(0.0, 0.2) if p.dim() == 3 else p.add_(torch.randn_like(p) * 0.1) if p.dim() == 1 else None
    hf.save_pretrained(tmp_path / "m")
    model = load(tmp_path / "m")
    assert model.config.architecture == "Llama4ForConditionalGeneration" and model.config.eos_token_ids == (1,)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17)]
    with torch.no_grad():
        ours, nxt, dec = run_paged(model, prompts)
    # its language model (the image-text model's own forward is broken on text-only input in transformers 5.24)
    assert max_diff_vs_hf(hf.language_model, prompts, ours, nxt, dec) < TOL


def test_tp2_trees_equal_tp1(make_llm, case):
    """tp 2 (gloo): each rank holds half of the heads (q/k rows permuted per head), expert, shared-expert and dense MLP columns;
    EAGLE-3 trees (K 4, page 16) give transformers' greedy tokens, whole-sequence logits equal tp 1's."""
    tp2_spec_equals_tp1(make_llm, case, k=4, page=16)
