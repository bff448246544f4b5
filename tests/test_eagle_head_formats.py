"""Published EAGLE-3 head layouts beyond SGLang's: speculators-format configs (as vLLM converts them),
`norm_before_residual`, and multi-layer heads run vLLM's way. Each loads and its paged forward matches a dense
reference written here from vLLM's llama_eagle3.py, over the raw checkpoint tensors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from spruce.errors import ConfigError, ModelLoadError
from spruce.models.eagle import DraftConfig
from spruce.models.hf_config import ModelConfig
from checkpoints import read_config, read_tensors, write_eagle3_checkpoint, write_llama_checkpoint
from test_eagle_models import TOL, attention, check, inputs, load_pair, mlp, naive_eagle3, paged_draft, rms

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("t") / "target", layers=6, seed=4)


# --- the reference: vLLM's llama_eagle3.py, dense over one sequence --------------------------------------------
def vllm_eagle3(w, cfg, embed, ids, feats, norm_before_residual):
    """-> (pre-norm hidden [T, H], logits [T, draft vocab]) with vLLM's tensor names (`layers.{i}`).

    Layer 0: q/k/v read [input_layernorm(embeds), hidden_norm(h)]; its residual is h, or hidden_norm(h) when
    norm_before_residual. Layers i > 0: residual += previous mlp output; attention over input_layernorm(residual);
    residual += attention; mlp over post_attention_layernorm(residual). The head's output is mlp + residual."""
    pos = torch.arange(len(ids))
    h = feats if feats.shape[-1] == cfg["hidden_size"] else feats @ w["fc.weight"].T
    normed = rms(h, w["layers.0.hidden_norm.weight"])
    x = torch.cat([rms(embed[ids], w["layers.0.input_layernorm.weight"]), normed], -1)
    residual = (normed if norm_before_residual else h) + attention(w, "layers.0.self_attn", x, pos, cfg)
    out = mlp(w, "layers.0.mlp", rms(residual, w["layers.0.post_attention_layernorm.weight"]))
    for i in range(1, cfg["num_hidden_layers"]):
        residual = residual + out
        x = rms(residual, w[f"layers.{i}.input_layernorm.weight"])
        residual = residual + attention(w, f"layers.{i}.self_attn", x, pos, cfg)
        out = mlp(w, f"layers.{i}.mlp", rms(residual, w[f"layers.{i}.post_attention_layernorm.weight"]))
    h = out + residual
    return h, rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


def sglang_names(w: dict) -> dict:
    """`layers.0.*` -> `midlayer.*`, `layers.{i}.*` -> `additional_layers.{i-1}.*` (SGLang's reference's names)."""
    out = {}
    for k, v in w.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.*)", k)
        if m:
            i = int(m.group(1))
            k = f"midlayer.{m.group(2)}" if i == 0 else f"additional_layers.{i - 1}.{m.group(2)}"
        out[k] = v
    return out


# --- checkpoints in the published layouts -------------------------------------------------------------------------
def vllm_layers(d, keep_hidden_norm: bool = False):
    """Rewrite a `layers.{k}`-named head's later layers as vLLM's: each one's input norm is `input_layernorm`
    (keep_hidden_norm: an unused `hidden_norm` stays too, as a vLLM-trained head may carry it; its values are
    the input norm's reversed, so reading one for the other shows)."""
    tensors = read_tensors(d)
    out = {}
    for k, v in tensors.items():
        m = re.fullmatch(r"layers\.([1-9]\d*)\.hidden_norm\.weight", k)
        if m:
            out[f"layers.{m.group(1)}.input_layernorm.weight"] = v
            if not keep_hidden_norm:
                continue
            v = v.flip(0).clone()
        out[k] = v
    save_file(out, str(d / "model.safetensors"))
    return d


def set_config(d, **changes):
    cfg = {**read_config(d), **changes}
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return d


def to_speculators(d, aux_ids=None, **top):
    """Rewrite a LlamaForCausalLMEagle3 config.json in the speculators layout: the decoder shape in
    transformer_layer_config, the EAGLE-3 fields and speculators_config at the top level."""
    flat = read_config(d)
    eagle3_keys = ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config")
    layer = {k: v for k, v in flat.items() if k not in eagle3_keys}
    layer["architectures"] = ["LlamaForCausalLM"]
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": layer, "draft_vocab_size": flat["draft_vocab_size"],
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]}},
           **top}
    if aux_ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = aux_ids
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def run_against(reference, target, draft, raw, cfg):
    """Max abs difference of the paged draft (two chunks, target-width then own-width features) from `reference`."""
    embed = target.embed_tokens.weight
    seqs, feats = inputs(draft.feature_width_first_step)
    ref = lambda ids, f: reference(raw, cfg, embed, ids, f)  # noqa: E731
    with torch.no_grad():
        paged = paged_draft(draft, seqs, feats)
        worst = check(paged, ref, draft, seqs, feats)
        own = [p.clone() for p in paged]
        worst = max(worst, check(paged_draft(draft, seqs, own), ref, draft, seqs, own))
    return worst, paged, seqs, feats


# --- forward passes against the references ----------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("nbr", [False, True], ids=["residual=feature", "norm_before_residual"])
def test_speculators_head_matches_vllm_reference(tmp_path, target_dir, n, nbr):
    """A speculators-format head (vLLM's way for its later layers, norm_before_residual as the config says)."""
    d = write_eagle3_checkpoint(tmp_path / "d", target_dir, seed=11, num_layers=n, midlayer_name="layers.0",
                                draft_vocab_size=100)
    d = to_speculators(vllm_layers(d), aux_ids=[1, 3, 5], norm_before_residual=nbr)
    target, draft = load_pair(target_dir, d)
    assert draft.config.target_aux_layers == (1, 3, 5)  # vLLM's ids are layer inputs, used as they are
    assert draft.config.norm_before_residual is nbr and draft.num_layers == n
    raw, cfg = read_tensors(d), read_config(d)["transformer_layer_config"]
    worst, paged, seqs, feats = run_against(
        lambda w, c, e, i, f: vllm_eagle3(w, c, e, i, f, nbr), target, draft, raw, cfg)
    print(f"speculators EAGLE-3, {n} layers, norm_before_residual={nbr}: max abs diff {worst:.2e}")
    assert worst < TOL
    # the options matter: the other residual convention is another head
    other, _ = vllm_eagle3(raw, cfg, target.embed_tokens.weight, torch.tensor(seqs[0]), feats[0], not nbr)
    assert (paged[0] - other).abs().max() > 1000 * TOL


def test_speculators_norm_before_residual_defaults_on(tmp_path, target_dir):
    """vLLM's conversion reads a missing norm_before_residual as True; a LlamaForCausalLMEagle3 config as False."""
    d = to_speculators(write_eagle3_checkpoint(tmp_path / "d", target_dir, midlayer_name="layers.0"))
    tcfg = ModelConfig.from_dir(target_dir)
    assert DraftConfig.from_dir(d, tcfg).norm_before_residual is True
    flat = write_eagle3_checkpoint(tmp_path / "f", target_dir)
    assert DraftConfig.from_dir(flat, tcfg).norm_before_residual is False
    assert DraftConfig.from_dir(flat, tcfg).target_aux_layers == (2, 3, 3)  # defaults: [2, L//2, L-3]
    assert DraftConfig.from_dir(d, tcfg).target_aux_layers == (2, 3, 3)


def test_norm_before_residual_on_an_eagle3_config(tmp_path, target_dir):
    """vLLM honours norm_before_residual on a LlamaForCausalLMEagle3 config too (single layer: both ways agree)."""
    d = set_config(write_eagle3_checkpoint(tmp_path / "d", target_dir, seed=12, midlayer_name="layers.0"),
                   norm_before_residual=True)
    target, draft = load_pair(target_dir, d)
    worst, *_ = run_against(lambda w, c, e, i, f: vllm_eagle3(w, c, e, i, f, True), target, draft,
                            read_tensors(d), read_config(d))
    assert worst < TOL


@pytest.mark.parametrize("how", ["inferred", "key", "key_with_unused_hidden_norm"])
def test_multilayer_head_vllm_way(tmp_path, target_dir, how):
    """A LlamaForCausalLMEagle3 head whose later layers carry `input_layernorm` runs vLLM's way: inferred from
    the names, or said by eagle3_layer_style (then a later layer's unused hidden_norm is skipped, as vLLM does)."""
    d = write_eagle3_checkpoint(tmp_path / "d", target_dir, seed=13, num_layers=3, midlayer_name="layers.0")
    vllm_layers(d, keep_hidden_norm=how == "key_with_unused_hidden_norm")
    if how != "inferred":
        set_config(d, eagle3_layer_style="vllm")
    target, draft = load_pair(target_dir, d)
    assert draft.config.layer_style == "vllm"
    raw, cfg = read_tensors(d), read_config(d)
    worst, paged, seqs, feats = run_against(
        lambda w, c, e, i, f: vllm_eagle3(w, c, e, i, f, False), target, draft, raw, cfg)
    assert worst < TOL
    # SGLang's way over the same layer weights is another head
    sg = {k.replace("input_layernorm", "hidden_norm") if k.startswith(("layers.1.", "layers.2.")) else k: v
          for k, v in raw.items()}
    sglang, _ = naive_eagle3(sglang_names(sg), cfg, target.embed_tokens.weight, torch.tensor(seqs[0]), feats[0])
    assert (paged[0] - sglang).abs().max() > 1000 * TOL


def test_multilayer_head_sglang_way_by_key(tmp_path, target_dir):
    """eagle3_layer_style 'sglang' on a head carrying both later-layer norms: SGLang's way, and the unused
    input_layernorm has no place (SGLang's later layers have none)."""
    d = write_eagle3_checkpoint(tmp_path / "d", target_dir, seed=14, num_layers=2, midlayer_name="layers.0")
    set_config(d, eagle3_layer_style="sglang")
    target, draft = load_pair(target_dir, d)
    assert draft.config.layer_style == "sglang"
    raw, cfg = read_tensors(d), read_config(d)
    worst, *_ = run_against(lambda w, c, e, i, f: naive_eagle3(sglang_names(w), c, e, i, f), target, draft, raw,
                            cfg)
    assert worst < TOL
    vllm_layers(d, keep_hidden_norm=True)
    with pytest.raises(ModelLoadError, match="input_layernorm"):
        load_pair(target_dir, d)


# --- refusals -------------------------------------------------------------------------------------------------------
def test_ambiguous_multilayer_head_refused(tmp_path, target_dir):
    """Later layers carrying both norms (or neither) and no eagle3_layer_style: refused, naming the key."""
    d = write_eagle3_checkpoint(tmp_path / "d", target_dir, num_layers=2, midlayer_name="layers.0")
    vllm_layers(d, keep_hidden_norm=True)
    tcfg = ModelConfig.from_dir(target_dir)
    with pytest.raises(ModelLoadError, match=r"ambiguous \(\['hidden_norm', 'input_layernorm'\]\).*eagle3_layer_style"):
        DraftConfig.from_dir(d, tcfg)
    (d / "model.safetensors").unlink()  # no weights to tell (a dummy load)
    with pytest.raises(ModelLoadError, match="no later-layer norm tensors.*eagle3_layer_style"):
        DraftConfig.from_dir(d, tcfg)
    assert DraftConfig.from_dir(set_config(d, eagle3_layer_style="vllm"), tcfg).layer_style == "vllm"


@pytest.mark.parametrize("change, error, match", [
    (dict(eagle3_layer_style="textbook"), ModelLoadError, r"eagle3_layer_style='textbook'.*\['sglang', 'vllm'\]"),
    (dict(speculators_model_type="medusa"), ModelLoadError, r"speculators_model_type='medusa'.*\['eagle3'\]"),
    (dict(transformer_layer_config=None), ModelLoadError, "needs a transformer_layer_config object, got NoneType"),
    (dict(norm_output=True), ModelLoadError, r"sets \['norm_output'\]"),
    (dict(eagle_aux_hidden_state_layer_ids=[1, 3, 6]), ConfigError,
     r"\(1, 3, 6\) do not fit a 6-layer target.*\[0, 5\]"),
], ids=["layer_style", "model_type", "layer_config", "norm_output", "aux_id_past_last_input"])
def test_speculators_config_refusals(tmp_path, target_dir, change, error, match):
    d = to_speculators(write_eagle3_checkpoint(tmp_path / "d", target_dir, num_layers=2, midlayer_name="layers.0"))
    vllm_layers(d)
    tcfg = ModelConfig.from_dir(target_dir)
    assert DraftConfig.from_dir(d, tcfg).layer_style == "vllm"  # the format's own way
    (d / "config.json").write_text(json.dumps({**read_config(d), **change}))
    with pytest.raises(error, match=match):
        DraftConfig.from_dir(d, tcfg)


def test_speculators_copy_of_the_bundled_head_runs_the_same(tmp_path, make_llm):
    """The bundled EAGLE-3 head rewritten in the speculators layout (SGLang's default aux inputs [2, 3, 4] given as
    vLLM's ids, norm_before_residual false) drafts exactly as the original in the engine: the same tokens and the
    same accept lengths."""
    import shutil

    from spruce import SamplingParams
    from spruce.config import builtin_draft_path, builtin_model_path

    target, head = builtin_model_path(), builtin_draft_path()
    d = tmp_path / "speculators"
    d.mkdir()
    shutil.copy(head / "model.safetensors", d / "model.safetensors")
    (d / "config.json").write_text((head / "config.json").read_text())
    to_speculators(d, aux_ids=[2, 3, 4], norm_before_residual=False,
                   target_hidden_size=read_config(head)["hidden_size"])
    assert ModelConfig.from_dir(target).num_layers == 7  # the default inputs [2, L//2, L-3] are [2, 3, 4]
    prompts = ["def fib(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = []
    for draft in (head, d):
        llm = make_llm(target, page_size=16, max_running_requests=2, context_length=256, draft_model=str(draft),
                       speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=2,
                       speculative_num_draft_tokens=6)
        runs.append(([o.token_ids for o in llm.generate(prompts, params)],
                     llm.engine.stats()["spec"]["accept_length_counts"]))
    assert runs[0] == runs[1]
    assert any(runs[1][1][1:])  # some drafts were accepted: the aux inputs and the residual convention matter
