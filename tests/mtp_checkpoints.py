"""Test helper: give a checkpoint random MTP layers in DeepSeek's published layout (model.layers.{L+j}.*)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from spruce.attention.backend import create_backend
from spruce.models.hf_config import ModelConfig
from spruce.models.loader import _build
from spruce.models.mtp import MTPDraft, mtp_checkpoint_tensors


def random_init_(module: torch.nn.Module, std: float, seed: int) -> None:
    """Weights N(0, std), norms one, biases zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, std, generator=g)
            else:
                p.zero_()


def add_mtp_layers(target_dir, out_dir, num_layers: int = 2, seed: int = 0, std: float = 0.2) -> Path:
    """A copy of `target_dir` whose config says num_nextn_predict_layers = num_layers, plus a model-mtp.safetensors
    of random MTP layers (norm weights perturbed away from one so a mis-loaded one shows)."""
    out = Path(out_dir)
    shutil.copytree(target_dir, out)
    raw = json.loads((out / "config.json").read_text())
    raw["num_nextn_predict_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    cfg = ModelConfig.from_dir(out)
    draft = _build(lambda: MTPDraft(cfg, create_backend("torch", 1), num_layers, cfg.num_layers), torch.float32,
                   torch.device("cpu"))
    random_init_(draft, std=std, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    index = out / "model.safetensors.index.json"
    tensors = mtp_checkpoint_tensors(draft)
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(out / "model-mtp.safetensors"))
    if index.exists():  # sharded: the index must name the new file too
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
        index.write_text(json.dumps(data, indent=2))
    return out
