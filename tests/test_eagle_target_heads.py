"""EAGLE-3 heads in the layouts published for the MoE targets, each a random head built here, saved, loaded and run
by the engine (spec == plain greedy, an oracle steering its proposals so every accept length runs):
- Llama 4: a head saved from a Llama 4 text config (model_type 'llama4_text', `intermediate_size` the target's
  expert width, `intermediate_size_mlp` its MLP's), its own hidden size and embedding (`target_hidden_size`) and a
  draft vocabulary (`draft_vocab_size`, d2t / t2d);
- gpt-oss: model_type 'gpt_oss' with head_dim * heads != hidden and no rope keys (transformers' defaults: YaRN),
  the target's whole vocabulary;
- Qwen3-MoE: a Llama-typed head with head_dim * heads != hidden, a hidden size other than the target's and a draft
  vocabulary.
The config rules themselves: the MLP width by the weights, by model_type, or refused naming the keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spruce import SamplingParams
from spruce.errors import ModelLoadError
from spruce.models.eagle import DraftConfig
from spruce.models.hf_config import ModelConfig
from checkpoints import read_config, write_eagle3_checkpoint
from moe_checkpoints import write_moe_checkpoint
from test_moe_targets_vs_hf import spec_llm

pytest.importorskip("transformers")

MAX_NEW = 6
PROMPT_LENGTHS = (6, 21)
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
TARGETS = {
    "llama4": dict(layers=4, top_k=1, interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4),
    "gpt_oss": dict(sliding_window=8),
    "qwen3_moe": dict(),
}


def write_head(path, target, variant: str) -> Path:
    """A random EAGLE-3 head for `target` in the layout published for `variant`."""
    if variant == "llama4":  # the target's experts are 64 wide, its dense MLPs 96 (intermediate_size_mlp)
        return write_eagle3_checkpoint(
            path, target, seed=5, hidden=48, with_embed=True, target_hidden=64, draft_vocab_size=128,
            intermediate=96, aux_layer_ids=[0, 1, 2],
            config=dict(model_type="llama4_text", intermediate_size=64, intermediate_size_mlp=96, rope_theta=None))
    if variant == "gpt_oss":
        return write_eagle3_checkpoint(
            path, target, seed=6, head_dim=32, aux_layer_ids=[0, 0, 1],
            config=dict(model_type="gpt_oss", rope_theta=None, num_local_experts=8, experts_per_token=2))
    return write_eagle3_checkpoint(path, target, seed=7, head_dim=32, hidden=96, with_embed=True, target_hidden=64,
                                   draft_vocab_size=128, aux_layer_ids=[0, 1, 1], config=dict(rope_theta=1e6))


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """variant -> (target dir, head dir, prompts, plain greedy continuations), built once."""
    import torch

    from spruce import LLM

    built = {}

    def case(variant):
        if variant not in built:
            root = tmp_path_factory.mktemp(variant)
            target = write_moe_checkpoint(root / "target", variant, **TARGETS[variant])
            head = write_head(root / "head", target, variant)
            g = torch.Generator().manual_seed(7)
            prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
            with LLM(str(target), page_size=16, max_running_requests=4) as llm:
                want = [o.token_ids for o in llm.generate(prompts, PARAMS)]
            built[variant] = (str(target), str(head), prompts, want)
        return built[variant]

    return case


@pytest.mark.parametrize("variant,k,page", [("llama4", 4, 16), ("gpt_oss", 1, 1), ("qwen3_moe", 4, 1)])
def test_spec_greedy_equals_plain(make_llm, cases, variant, k, page):
    case = cases(variant)
    llm = spec_llm(make_llm, case, k, page)
    assert [o.token_ids for o in llm.generate(case[2], PARAMS)] == case[3]
    accept = llm.engine.stats()["spec"]["mean_accept_length"]
    print(f"{variant} K={k} page={page}: mean accept length {accept}")
    assert accept > 1.0
    draft = llm.engine.runner.draft.draft  # the head under the oracle
    assert draft.draft_vocab_size == (256 if variant == "gpt_oss" else 128)


def test_llama4_head_mlp_width(tmp_path, cases):
    """intermediate_size_mlp: by the checkpoint's MLP, else by model_type 'llama4_text', else refused naming both
    keys; a head whose config names only one width uses it."""
    target, head, _, _ = cases("llama4")
    tcfg = ModelConfig.from_dir(target)
    cfg = DraftConfig.from_dir(head, tcfg)
    assert cfg.layer.intermediate_size == 96 and cfg.layer.hidden_size == 48 and cfg.target_hidden_size == 64
    assert cfg.layer.rope_theta == 500000.0  # Llama4TextConfig's default theta
    bare = tmp_path / "bare"  # the config alone (a dummy load): model_type says intermediate_size_mlp
    bare.mkdir()
    (bare / "config.json").write_text(Path(head, "config.json").read_text())
    assert DraftConfig.from_dir(bare, tcfg).layer.intermediate_size == 96
    llama_typed = {**read_config(bare), "model_type": "llama"}
    (bare / "config.json").write_text(json.dumps(llama_typed))
    with pytest.raises(ModelLoadError, match=r"intermediate_size=64 and intermediate_size_mlp=96 .*no MLP weights: "
                                             r"ambiguous"):
        DraftConfig.from_dir(bare, tcfg)
    (Path(head) / "config.json").write_text(json.dumps(llama_typed))  # weights 96 wide tell, whatever the type
    assert DraftConfig.from_dir(head, tcfg).layer.intermediate_size == 96
    del llama_typed["intermediate_size_mlp"]
    (bare / "config.json").write_text(json.dumps(llama_typed))
    assert DraftConfig.from_dir(bare, tcfg).layer.intermediate_size == 64


def test_gpt_oss_head_rope_defaults(tmp_path, cases):
    """A gpt_oss-typed head without rope keys rotates as GptOssConfig's defaults say (YaRN, theta 150000); keys
    it names win."""
    target, head, _, _ = cases("gpt_oss")
    tcfg = ModelConfig.from_dir(target)
    cfg = DraftConfig.from_dir(head, tcfg)
    assert cfg.layer.rope_theta == 150000.0 and cfg.layer.head_dim == 32
    assert cfg.layer.rope_scaling["rope_type"] == "yarn" and cfg.layer.rope_scaling["factor"] == 32.0
    d = tmp_path / "plain_rope"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**read_config(head), "rope_scaling": None, "rope_theta": 10000.0}))
    cfg = DraftConfig.from_dir(d, tcfg)
    assert cfg.layer.rope_scaling is None and cfg.layer.rope_theta == 10000.0


@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm"])
def test_target_feature_norms(tmp_path, cases, flag):
    """norm_before_fc (said in eagle_config, as NVIDIA's gpt-oss heads do: `input_norm` over the concatenated
    target features) and fc_norm (`fc_norm.{i}` over each): the head's paged forward equals the same head without
    the flag fed the normed features; both flags at once are refused."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from checkpoints import read_tensors
    from test_eagle_models import load_pair, paged_draft, rms

    target = cases("gpt_oss")[0]
    plain = write_head(tmp_path / "plain", target, "gpt_oss")
    normed = tmp_path / "normed"
    shutil.copytree(plain, normed)
    tensors, cfg = read_tensors(plain), read_config(plain)
    g = torch.Generator().manual_seed(1)
    if flag == "norm_before_fc":
        weights = [1.0 + 0.3 * torch.randn(3 * 64, generator=g)]
        tensors["input_norm.weight"] = weights[0]
        cfg["eagle_config"] = {**cfg["eagle_config"], flag: True}
    else:
        weights = [1.0 + 0.3 * torch.randn(64, generator=g) for _ in range(3)]
        tensors.update({f"fc_norm.{i}.weight": w for i, w in enumerate(weights)})
        cfg[flag] = True
    save_file(tensors, str(normed / "model.safetensors"))
    (normed / "config.json").write_text(json.dumps(cfg))
    (_, with_norm), (_, without) = load_pair(target, normed), load_pair(target, plain)
    seqs = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (17, 9)]
    feats = [3.0 * torch.randn(len(s), 3 * 64, generator=g) for s in seqs]

    def norm(f):  # [T, 3H] as the head's norms see it
        return rms(f, weights[0]) if len(weights) == 1 else torch.cat(
            [rms(part, w) for part, w in zip(f.split(64, dim=-1), weights)], dim=-1)

    with torch.no_grad():
        got = paged_draft(with_norm, seqs, feats)
        want = paged_draft(without, seqs, [norm(f) for f in feats])
        unnormed = paged_draft(without, seqs, feats)
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-4
    assert max((a - b).abs().max().item() for a, b in zip(got, unnormed)) > 1e-2  # the norm is applied
    tcfg = ModelConfig.from_dir(target)
    if flag == "norm_before_fc":  # a speculators-format head (RedHat's gpt-oss heads) says it at its top level
        from test_eagle_head_formats import to_speculators

        speculators = tmp_path / "speculators"
        shutil.copytree(plain, speculators)
        assert DraftConfig.from_dir(to_speculators(speculators, [0, 0, 1], norm_before_fc=True), tcfg).norm_before_fc
    (normed / "config.json").write_text(json.dumps({**cfg, "norm_before_fc": True, "fc_norm": True}))
    with pytest.raises(ModelLoadError, match="sets both norm_before_fc and fc_norm"):
        DraftConfig.from_dir(normed, tcfg)
