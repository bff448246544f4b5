"""Qwen3-MoE, Qwen2-MoE (shared expert behind its sigmoid gate) and Mixtral targets equal transformers on tiny
random checkpoints saved by transformers itself (float32):
- logits on the hand-driven paged cache (chunked prefill, then a decode step; every row compared), for the
  routing variants: norm_topk_prob on and off, top_k 1, decoder_sparse_step 2 and mlp_only_layers (dense
  layers between MoE ones), Mixtral's published block_sparse_moe names;
- greedy tokens through the whole engine (paged cache, overlap schedule on and off, page 1 and 16);
- EAGLE-3 tree speculation (a random head steered by the oracle so every accept length runs) equal to plain
  greedy, K in {1, 4} x page in {1, 16} spread over the three architectures;
- tensor parallelism (tp 2 on CPU, gloo) on Qwen2-MoE equal to transformers' greedy tokens."""

from __future__ import annotations

import pytest

from spruce import LLM, SamplingParams
from spruce.errors import ModelLoadError
from spruce.models.hf_config import ModelConfig
from moe_checkpoints import engine_case, write_moe_checkpoint
from oracle_draft import install_oracle
from test_models_vs_hf import logit_diff_vs_hf

transformers = pytest.importorskip("transformers")

TOL = 1e-4
MAX_NEW = 8
PROMPT_LENGTHS = (7, 23, 40)
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)

LOGIT_VARIANTS = [
    ("qwen3_moe", dict(top_k=1, mlp_only_layers=[0], attention_bias=True)),
    ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2, layers=3)),
    ("qwen2_moe", dict()),
    ("mixtral", dict(top_k=1)),
]


@pytest.mark.parametrize("variant,extra", LOGIT_VARIANTS, ids=lambda v: str(v)[:50])
def test_logits_equal_transformers(tmp_path, variant, extra):
    worst = logit_diff_vs_hf(write_moe_checkpoint(tmp_path / "m", variant, **extra))
    print(f"{variant} {extra}: max abs logit diff {worst:.2e}")
    assert worst < TOL


def test_moe_layers_follow_decoder_sparse_step_and_mlp_only_layers(tmp_path):
    cfg = ModelConfig.from_dir(write_moe_checkpoint(tmp_path / "m", "qwen2_moe", layers=5, decoder_sparse_step=2,
                                                    mlp_only_layers=[3]))
    assert [cfg.moe.is_moe_layer(i) for i in range(5)] == [False, True, False, False, False]
    assert cfg.moe.shared_size == 48 and cfg.moe.shared_expert_gate


def test_top_k_beyond_the_experts_is_refused(tmp_path):
    path = write_moe_checkpoint(tmp_path / "m", "mixtral", experts=4, top_k=2)
    text = (path / "config.json").read_text().replace('"num_experts_per_tok": 2', '"num_experts_per_tok": 5')
    (path / "config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok=5 .* must be in \[1, number of experts=4\]"):
        ModelConfig.from_dir(path)


# --- the whole engine --------------------------------------------------------------------------------------------
ENGINE_VARIANTS = {"qwen3_moe": dict(), "qwen2_moe": dict(decoder_sparse_step=2, layers=3), "mixtral": dict()}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """variant -> (target dir, EAGLE-3 draft dir, prompts, transformers' greedy continuations), built once."""
    built = {}

    def case(variant):
        if variant not in built:
            built[variant] = engine_case(tmp_path_factory.mktemp(variant), variant, PROMPT_LENGTHS, MAX_NEW,
                                         **ENGINE_VARIANTS[variant])
        return built[variant]

    return case


@pytest.mark.parametrize("variant,page,overlap", [("qwen3_moe", 1, False), ("qwen2_moe", 16, True),
                                                  ("mixtral", 1, True)])
def test_greedy_equals_transformers(make_llm, cases, variant, page, overlap):
    target, _, prompts, want = cases(variant)
    llm = make_llm(target, page_size=page, max_running_requests=4, chunked_prefill_size=32,
                   disable_overlap_schedule=not overlap)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == want


def spec_llm(make_llm, case, k, page, **kw):
    """An EAGLE-3 engine on `case` whose random head an oracle steers (60% of its proposals right)."""
    target, draft, prompts, want = case
    s, n = {1: (3, 4), 4: (3, 8)}[k]
    llm = make_llm(target, page_size=page, max_running_requests=4, draft_model=draft, speculative_algorithm="EAGLE3",
                   speculative_num_steps=s, speculative_eagle_topk=k, speculative_num_draft_tokens=n, **kw)
    oracle = install_oracle(llm, 0.6)
    for p, w in zip(prompts, want):
        oracle.add_reference(p, w)
    return llm


@pytest.mark.parametrize("variant,k,page", [("qwen3_moe", 1, 1), ("qwen3_moe", 4, 16), ("qwen2_moe", 4, 1),
                                            ("mixtral", 1, 16)])
def test_spec_greedy_equals_plain(make_llm, cases, variant, k, page):
    case = cases(variant)
    llm = spec_llm(make_llm, case, k, page)
    assert [o.token_ids for o in llm.generate(case[2], PARAMS)] == case[3]
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.2


def tp2_spec_equals_tp1(make_llm, case, k: int, page: int) -> None:
    """Tensor parallelism (2 ranks, gloo) with EAGLE-3 trees (K = k, oracle-steered on every rank) on `case`:
    greedy tokens equal transformers' (tp 1's), and the logits of a whole sequence equal tp 1's."""
    import functools

    import torch

    import tp_hooks
    from spruce.config import EngineConfig, make_speculative_config
    from spruce.runtime.launch import create_engine
    from spruce.speculative.registry import make_strategy

    target, draft, prompts, want = case
    s, n = {1: (3, 4), 4: (3, 8)}[k]
    spec = make_speculative_config("EAGLE3", draft, s, k, n, model=target)
    config = EngineConfig(model=target, tp_size=2, page_size=page, max_running_requests=4, chunked_prefill_size=32,
                          speculative=spec)
    setup = functools.partial(tp_hooks.install_oracle, fraction=0.6, references=list(zip(prompts, want)))
    sequence = prompts[-1] + want[-1]
    llm = LLM.from_engine(create_engine(config, setup, make_strategy=make_strategy))
    try:
        got = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        accept = llm.engine.stats()["spec"]["mean_accept_length"]
        logits = llm.engine.next_token_logits(sequence)
        llm.engine.check_no_leaks()
    finally:
        llm.shutdown()
    assert got == want
    assert accept > 1.2
    one = make_llm(target, page_size=page, max_running_requests=4, chunked_prefill_size=32)
    torch.testing.assert_close(logits, one.engine.next_token_logits(sequence), rtol=1e-4, atol=1e-4)


def test_qwen2_moe_tp2_equals_transformers(cases):
    """Tensor parallelism (2 ranks, gloo): each rank holds half of every expert's, the shared expert's and the
    dense MLP's intermediate; the shared-expert gate scales each rank's partial sum alike."""
    target, _, prompts, want = cases("qwen2_moe")
    llm = LLM(target, tp_size=2, page_size=16, max_running_requests=4)
    try:
        assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == want
        llm.engine.check_no_leaks()
    finally:
        llm.shutdown()
