"""Every broken checkpoint raises one clear error naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from spruce import LLM
from spruce.config import builtin_model_path
from spruce.errors import ConfigError, ModelLoadError
from checkpoints import write_eagle3_checkpoint

DEMO = builtin_model_path()


@pytest.fixture
def model_copy(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(DEMO, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere"):
        LLM(tmp_path / "nowhere")


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(model_copy)


def test_bad_json(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        LLM(model_copy)


def test_unsupported_architecture(model_copy):
    edit_config(model_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*supported: \\['LlamaForCausalLM'"):
        LLM(model_copy)


def test_unsupported_rope(model_copy):
    edit_config(model_copy, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope_type='yarn'"):
        LLM(model_copy)


def test_no_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(model_copy)


def test_corrupt_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ModelLoadError, match="cannot read safetensors file .*model.safetensors"):
        LLM(model_copy)


def test_missing_tensor(model_copy):
    from safetensors.torch import load_file

    tensors = load_file(model_copy / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, model_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match="layers.3.mlp.gate_up.weight"):
        LLM(model_copy)


def test_wrong_shape(model_copy):
    from safetensors.torch import load_file

    tensors = load_file(model_copy / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, model_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.norm.weight.*\(7,\), expected \(256,\)"):
        LLM(model_copy)


def test_draft_errors(tmp_path):
    d = write_eagle3_checkpoint(tmp_path / "d", DEMO, draft_vocab_size=300)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["MedusaModel"]}))
    with pytest.raises(ModelLoadError, match="MedusaModel"):
        LLM(DEMO, draft_model=str(d), speculative_algorithm="EAGLE3")
    (d / "config.json").write_text(json.dumps({**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 40, 2]}}))
    with pytest.raises(ConfigError, match="aux hidden-state layers"):
        LLM(DEMO, draft_model=str(d), speculative_algorithm="EAGLE3")
    from safetensors.torch import load_file

    (d / "config.json").write_text(json.dumps(cfg))
    t = load_file(d / "model.safetensors")
    t["d2t"] = t["d2t"] + 5000
    save_file(t, d / "model.safetensors")
    with pytest.raises(ConfigError, match="outside the target vocab 4096"):
        LLM(DEMO, draft_model=str(d), speculative_algorithm="EAGLE3")
