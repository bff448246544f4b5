"""gpt-oss targets equal transformers on tiny random checkpoints saved by transformers itself (float32):
attention sinks, layers alternating sliding-window / full attention with a window shorter than the prompts,
YaRN rope, every layer MoE with a biased router, biased experts and the clamped SwiGLU.
- logits on the hand-driven paged cache (chunked prefill, then a decode step; every row compared);
- greedy tokens through the whole engine (overlap on and off, page 1 and 16);
- EAGLE-3 tree speculation (oracle-steered random head) equal to plain greedy, K 1 on pages of 16 and K 4 on
  pages of 1: tree nodes see their ancestors plus the window of committed tokens;
- MXFP4 expert weights dequantized at load, equal to transformers' own dequantization;
- tensor parallelism (tp 2, gloo) with EAGLE-3 trees equal to tp 1;
- refusals: a backend without windows / sinks, a tree as deep as the window, other quantizations."""

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
WINDOW = 8  # shorter than every engine prompt and than the 17- and 70-token logit prompts
YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
            truncate=False, rope_theta=150000.0)
MAX_NEW = 8
PROMPT_LENGTHS = (5, 23, 40)
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)

LOGIT_VARIANTS = [
    dict(sliding_window=WINDOW, rope_parameters=YARN),
    # the clamp at work (limit 0.5), top-1 routing, sliding layers 0 and 2 around a full one
    dict(sliding_window=WINDOW, swiglu_limit=0.5, top_k=1, layers=3,
         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
]


@pytest.mark.parametrize("extra", LOGIT_VARIANTS, ids=lambda v: str(v)[:60])
def test_logits_equal_transformers(tmp_path, extra):
    worst = logit_diff_vs_hf(write_moe_checkpoint(tmp_path / "m", "gpt_oss", **extra))
    print(f"gpt-oss {extra}: max abs logit diff {worst:.2e}")
    assert worst < TOL


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return engine_case(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", PROMPT_LENGTHS, MAX_NEW,
                       sliding_window=WINDOW, rope_parameters=YARN)


def test_context_is_not_capped_by_the_window(case):
    cfg = ModelConfig.from_dir(case[0])
    assert cfg.sliding_window == WINDOW and cfg.max_position_embeddings == 512
    assert [cfg.layer_window(i) for i in range(2)] == [WINDOW, None]


@pytest.mark.parametrize("page,overlap", [(1, False), (16, True)])
def test_greedy_equals_transformers(make_llm, case, page, overlap):
    target, _, prompts, want = case
    llm = make_llm(target, page_size=page, max_running_requests=4, chunked_prefill_size=32,
                   disable_overlap_schedule=not overlap)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == want


@pytest.mark.parametrize("k,page", [(1, 16), (4, 1)])
def test_spec_greedy_equals_plain(make_llm, case, k, page):
    llm = spec_llm(make_llm, case, k, page)
    assert [o.token_ids for o in llm.generate(case[2], PARAMS)] == case[3]
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.2


def test_backend_without_windows_is_refused(case):
    with pytest.raises(ConfigError, match=r"attention_backend='torch-split' has no sliding-window attention or "
                                          r"attention sinks, which the target needs; backends with them: 'torch'"):
        LLM(case[0], attention_backend="torch-split")


def test_tree_as_deep_as_the_window_is_refused(case):
    with pytest.raises(ConfigError, match=rf"speculative_num_steps={WINDOW} must be below the target's "
                                          rf"sliding_window={WINDOW}"):
        LLM(case[0], draft_model=case[1], speculative_algorithm="EAGLE3", speculative_num_steps=WINDOW,
            speculative_eagle_topk=1, speculative_num_draft_tokens=WINDOW + 1)


def test_other_quantization_is_refused(tmp_path, case):
    cfg = json.loads((Path(case[0]) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"quantization_config 'bitsandbytes': not supported for "
                                             r"GptOssForCausalLM \(only 'mxfp4', dequantized at load\)"):
        ModelConfig.from_dir(tmp_path)


def test_mxfp4_experts_equal_transformers_dequantized(tmp_path, case):
    """The published MXFP4 layout (expert tensors as uint8 `_blocks` / `_scales`, random here) loads dequantized:
    logits equal transformers' model holding its own dequantizer's (convert_moe_packed_tensors) experts."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from test_models_vs_hf import load, max_diff_vs_hf, run_paged

    src, dst = Path(case[0]), tmp_path / "mxfp4"
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = tensors.pop(name).shape  # [E, in, out]: blocks hold [E, out, in / 32, 16]
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(122, 126, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            hf.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    model = load(dst)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    with torch.no_grad():
        ours, nxt, dec = run_paged(model, prompts)
    assert max_diff_vs_hf(hf, prompts, ours, nxt, dec) < TOL
    from spruce.models.quantization import fp8_scheme

    with pytest.raises(ModelLoadError, match=r"quantization='fp8' cannot run on the MXFP4 checkpoint"):
        fp8_scheme(dst, "fp8")


def test_tp2_trees_equal_tp1(make_llm, case):
    """tp 2 (gloo): each rank holds half of the heads and their sinks, expert columns and biases (b2 added once);
    EAGLE-3 trees (K 4, page 1) give transformers' greedy tokens, whole-sequence logits equal tp 1's."""
    tp2_spec_equals_tp1(make_llm, case, k=4, page=1)
