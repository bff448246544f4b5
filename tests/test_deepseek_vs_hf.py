"""DeepSeek-V2/V3 targets (MLA over the latent cache, absorbed form; MoE) equal transformers' on the same
checkpoint, float32, on the hand-driven paged cache: a chunked prefill then a decode step, every logit row
compared (max abs diff printed). Variants cover q_lora or not, YaRN with mscale, softmax and sigmoid gating,
group-limited routing, first_k_dense_replace > 1, routed_scaling_factor != 1, rotate-half rope."""

from __future__ import annotations

import pytest

from checkpoints import write_deepseek_checkpoint
from test_models_vs_hf import logit_diff_vs_hf

transformers = pytest.importorskip("transformers")

TOL = 1e-4
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32, beta_slow=1,
            mscale=0.707, mscale_all_dim=0.707)
VARIANTS = [
    dict(version=3),  # sigmoid + bias, group-limited (noaux_tc), q_lora, interleaved rope
    dict(version=3, q_lora_rank=None, routed_scaling_factor=2.5, first_k_dense_replace=2, layers=4),
    dict(version=3, rope_scaling=YARN, n_group=4, topk_group=2, top_k=3),
    dict(version=3, rope_interleave=False, rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=0.8)),
    dict(version=2, q_lora_rank=None),  # softmax, greedy, complex (interleaved) rope
    dict(version=2, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0),
    dict(version=2, rope_scaling=YARN, first_k_dense_replace=0),
]


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items())[:70])
def test_logits_equal_transformers(tmp_path, spec):
    worst = logit_diff_vs_hf(write_deepseek_checkpoint(tmp_path / "m", **spec))
    print(f"{spec}: max abs logit diff {worst:.2e}")
    assert worst < TOL
