"""A local checkpoint's safetensors files: which files, their tensor names (headers only), and their tensors one at
a time. Below every model and loader module: models/loader.py fills models from these, models/eagle.py reads a
head's tensor names to tell its layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from spruce.errors import ModelLoadError

READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)  # what a bad or truncated file raises


def safetensors_files(path) -> list[Path]:
    """The checkpoint's files: those named by model.safetensors.index.json, else every *.safetensors."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e!r}") from e
        files = [path / f for f in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index} names missing shard files: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {others}: convert them to safetensors)" if others else ""
        raise ModelLoadError(f"no *.safetensors files in {path}{hint}")
    return files


def open_safetensors(file: Path):
    """safe_open of `file` (a context manager over its tensors); ModelLoadError naming the file if unreadable."""
    try:
        return safe_open(str(file), framework="pt")
    except READ_ERRORS as e:
        raise ModelLoadError(f"cannot read safetensors file {file}: {e}") from e


def checkpoint_names(path) -> set[str]:
    """Names of every tensor in the checkpoint (reads the file headers only)."""
    names: set[str] = set()
    for file in safetensors_files(path):
        with open_safetensors(file) as f:
            names.update(f.keys())
    return names


def iter_tensors(path, show_progress: bool = False, desc: str = "loading") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint; one tqdm bar over all tensors when show_progress."""
    for name, part in iter_tensor_slices(path, show_progress, desc):
        yield name, part.read()


def iter_tensor_slices(path, show_progress: bool = False, desc: str = "loading"):
    """(name, CheckpointSlice) for every tensor of the checkpoint: nothing is read until the loader asks for a
    part (a tensor-parallel rank's) or the whole (distributed/checkpoint.py). Each slice is valid until the
    next one is taken."""
    from spruce.distributed.checkpoint import CheckpointSlice

    files = safetensors_files(path)
    handles = [open_safetensors(f) for f in files]
    try:
        keys = [list(h.keys()) for h in handles]
        with tqdm(total=sum(map(len, keys)), desc=desc, disable=not show_progress, unit="tensor") as bar:
            for file, handle, names in zip(files, handles, keys):
                for name in names:
                    try:
                        part = handle.get_slice(name)
                        shape = tuple(part.get_shape())
                    except READ_ERRORS as e:
                        raise ModelLoadError(f"cannot read tensor {name!r} from safetensors file {file}: {e}") from e
                    yield name, CheckpointSlice(name, shape, _box_reader(handle, part, name, file))
                    bar.update(1)
    finally:
        for h in handles:
            h.__exit__(None, None, None)


def _box_reader(handle, part, name: str, file: Path):
    """read(index): tensor[index] (a tuple of slices), or the whole tensor for ()."""
    def read(index: tuple) -> torch.Tensor:
        try:
            return part[index] if index else handle.get_tensor(name)
        except READ_ERRORS as e:
            raise ModelLoadError(f"cannot read tensor {name!r} from safetensors file {file}: {e}") from e

    return read
