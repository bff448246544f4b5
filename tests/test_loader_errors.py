"""Every broken checkpoint raises one clear error naming what is wrong (spruce.models' loaders, no engine)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spruce.attention.backend import create_backend
from spruce.config import builtin_model_path
from spruce.errors import ConfigError, ModelLoadError
from spruce.models.eagle import DraftConfig
from spruce.models.hf_config import ModelConfig
from spruce.models.loader import load_eagle_draft, load_target
from checkpoints import write_eagle3_checkpoint, write_eagle_checkpoint

DEMO = builtin_model_path()  # pycode-6m: 7 layers, hidden 256, vocab 4096, tied, one safetensors file
CPU = torch.device("cpu")


def load(path, **kw):
    return load_target(path, torch.float32, CPU, create_backend("torch", 4), **kw)


def draft(path):
    target = load(DEMO)
    return load_eagle_draft(path, target, target.config, torch.float32, CPU, create_backend("torch", 4))


@pytest.fixture
def model_copy(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(DEMO, dst)
    return dst


def edit_config(path, drop=(), **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for k in drop:
        cfg.pop(k)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found: .*nowhere"):
        load(tmp_path / "nowhere")


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="not found: .*m/config.json"):
        load(model_copy)


def test_bad_json(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        load(model_copy)


@pytest.mark.parametrize("change, match", [
    (dict(architectures=["GPT2LMHeadModel"]),
     r"\['GPT2LMHeadModel'\].*supported: \['DeepseekV2ForCausalLM', 'DeepseekV3ForCausalLM', 'GptOssForCausalLM', "
     r"'Llama4ForCausalLM', 'Llama4ForConditionalGeneration', 'LlamaForCausalLM'"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}), "rope_type='longrope'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "low_freq_factor"),
    (dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_size="wide"), "malformed field"),
])
def test_unsupported_config(model_copy, change, match):
    edit_config(model_copy, **change)
    with pytest.raises(ModelLoadError, match=match):
        load(model_copy)


def test_missing_config_field(model_copy):
    edit_config(model_copy, drop=["num_hidden_layers"])
    with pytest.raises(ModelLoadError, match="lacks required field 'num_hidden_layers'"):
        ModelConfig.from_dir(model_copy)


def test_no_weights(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors files in .*pytorch_model.bin.*convert"):
        load(model_copy)


def test_corrupt_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ModelLoadError, match="cannot read safetensors file .*model.safetensors"):
        load(model_copy)


def test_truncated_safetensors(model_copy):
    f = model_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="cannot read safetensors file .*model.safetensors"):
        load(model_copy)


def test_sharded_index_errors(model_copy):
    tensors = load_file(model_copy / "model.safetensors")
    names = sorted(tensors)
    (model_copy / "model.safetensors").unlink()
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, model_copy / file)
    index = model_copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    assert load(model_copy).config.num_layers == 7  # the sharded copy loads
    (model_copy / "b.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="names missing shard files: .*b.safetensors"):
        load(model_copy)
    index.write_text("{}")
    with pytest.raises(ModelLoadError, match="not a valid safetensors index"):
        load(model_copy)


def test_missing_tensor(model_copy):
    edit_tensors(model_copy, lambda t: t.pop("model.layers.3.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensor\(s\).*'layers.3.mlp.up_proj.weight'"):
        load(model_copy)


def test_wrong_shape(model_copy):
    edit_tensors(model_copy, lambda t: t.update({"model.layers.2.self_attn.k_proj.weight": torch.ones(7, 256)}))
    with pytest.raises(ModelLoadError, match=r"'model.layers.2.self_attn.k_proj.weight' has shape \(7, 256\), "
                                             r"expected \(128, 256\)"):
        load(model_copy)


def test_unknown_tensor(model_copy):
    edit_tensors(model_copy, lambda t: t.update({"model.layers.0.mlp.gate_proj.bias": torch.ones(768)}))
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.gate_proj.bias' has no place"):
        load(model_copy)


def test_aux_layers_out_of_range():
    with pytest.raises(ModelLoadError, match="aux hidden-state layer input 9 is outside \\[0, 7\\]"):
        load(DEMO, aux_layers=(2, 9))


# --- drafts ---------------------------------------------------------------------------------------------------
def test_draft_architecture_and_aux_ids(tmp_path):
    d = write_eagle3_checkpoint(tmp_path / "d", DEMO, draft_vocab_size=300)
    tcfg = ModelConfig.from_dir(DEMO)
    edit_config(d, architectures=["MedusaModel"])
    with pytest.raises(ModelLoadError, match="MedusaModel.*LlamaForCausalLMEagle3"):
        DraftConfig.from_dir(d, tcfg)
    edit_config(d, architectures=["LlamaForCausalLMEagle3"], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 40]})
    with pytest.raises(ConfigError, match=r"\(2, 41\) do not fit a 7-layer target"):
        DraftConfig.from_dir(d, tcfg)
    edit_config(d, eagle_config={}, num_hidden_layers=0)  # multi-layer heads load (test_eagle_models); none does not
    with pytest.raises(ModelLoadError, match="num_hidden_layers=0; it needs at least 1"):
        DraftConfig.from_dir(d, tcfg)


def test_draft_d2t_errors(tmp_path):
    d = write_eagle3_checkpoint(tmp_path / "d", DEMO, draft_vocab_size=300)
    edit_tensors(d, lambda t: t.update(d2t=t["d2t"] + 5000))
    with pytest.raises(ConfigError, match=r"d2t maps to target ids in \[\d+, \d+\], outside the target vocab 4096"):
        draft(d)
    edit_tensors(d, lambda t: t.update(d2t=t["d2t"][:299]))
    with pytest.raises(ConfigError, match=r"d2t has shape \(299,\); expected \(300,\)"):
        draft(d)
    edit_tensors(d, lambda t: t.pop("d2t"))
    with pytest.raises(ModelLoadError, match="draft_vocab_size 300 < vocab_size 4096 lacks its d2t"):
        draft(d)
    edit_config(d, draft_vocab_size=5000)
    with pytest.raises(ConfigError, match="draft_vocab_size 5000 must be in \\[1, target vocab_size 4096\\]"):
        draft(d)


def test_draft_hidden_mismatch(tmp_path):
    wide = write_eagle3_checkpoint(tmp_path / "w", DEMO, target_hidden=320)
    with pytest.raises(ConfigError, match="target hidden size 320, the target has 256"):
        draft(wide)
    no_embed = write_eagle3_checkpoint(tmp_path / "n", DEMO, hidden=128)
    with pytest.raises(ConfigError, match="hidden size 128 differs from the target's 256"):
        draft(no_embed)
    e1 = write_eagle_checkpoint(tmp_path / "e1", DEMO)
    edit_config(e1, hidden_size=128)
    with pytest.raises(ConfigError, match="EAGLE draft hidden size 128 must equal the target's hidden size 256"):
        draft(e1)


def test_draft_missing_tensor(tmp_path):
    d = write_eagle3_checkpoint(tmp_path / "d", DEMO, draft_vocab_size=300)
    edit_tensors(d, lambda t: t.pop("midlayer.self_attn.v_proj.weight"))
    with pytest.raises(ModelLoadError, match="'midlayer.self_attn.v_proj.weight'"):
        draft(d)
    d = write_eagle3_checkpoint(tmp_path / "e", DEMO, draft_vocab_size=300, with_lm_head=False)
    with pytest.raises(ModelLoadError, match="'lm_head.weight'"):
        draft(d)
