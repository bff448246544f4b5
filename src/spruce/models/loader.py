"""Load targets and drafts from local Hugging Face directories (single-file or sharded safetensors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from spruce.errors import ModelLoadError
from spruce.models.hf_config import ModelConfig


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's files: those named by model.safetensors.index.json, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index} names missing shard files: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {path}")
    return files


def iter_tensors(path: Path, show_progress: bool = False, desc: str = "loading") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, with a progress bar over tensors."""
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                for name in tqdm(names, desc=f"{desc} {file.name}", disable=not show_progress, leave=False):
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read safetensors file {file}: {e}") from e


def _build(module_fn, dtype: torch.dtype, device: torch.device):
    """Construct directly on `device` in `dtype` (no float32 detour for large models)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return module_fn()
    finally:
        torch.set_default_dtype(previous)


def random_init_(module: torch.nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Fill weights with N(0, std) and norms with ones (load_format='dummy': speed, not values)."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, std, generator=g)
            else:
                p.zero_()


def load_target(path, dtype: torch.dtype, device: torch.device, backend, aux_layers: tuple[int, ...] = (),
                show_progress: bool = False, load_format: str = "auto"):
    """The target model with weights from `path` (or random weights with load_format='dummy')."""
    from spruce.models.llama import LlamaForCausalLM

    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    model = _build(lambda: LlamaForCausalLM(cfg, backend, aux_layers), dtype, device)
    if load_format == "dummy":
        random_init_(model)
    else:
        with torch.no_grad():
            model.load_weights(iter_tensors(path, show_progress, "loading target"))
    return model.eval().requires_grad_(False)


def load_draft(path, target, target_config: ModelConfig, dtype: torch.dtype, device: torch.device, backend,
               show_progress: bool = False, load_format: str = "auto"):
    """An EAGLE or EAGLE-3 draft; embeddings (and EAGLE's lm_head) are shared from the target if absent."""
    from spruce.models.eagle import DraftConfig, EagleDraft

    path = Path(path)
    cfg = DraftConfig.from_dir(path, target_config)
    model = _build(lambda: EagleDraft(cfg, backend), dtype, device)
    if load_format == "dummy":
        random_init_(model, seed=1)
        model.d2t.zero_()
        model.share_from_target(target, embeddings=True, lm_head=cfg.shares_lm_head)
    else:
        with torch.no_grad():
            present = model.load_weights(iter_tensors(path, show_progress, "loading draft"))
        model.share_from_target(target, embeddings="embed_tokens.weight" not in present,
                                lm_head=cfg.shares_lm_head and "lm_head.weight" not in present)
    return model.eval().requires_grad_(False)
