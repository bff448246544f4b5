"""Reading a tensor-parallel rank's part of a checkpoint tensor straight from the safetensors file.

A `CheckpointSlice` is a checkpoint tensor not read yet: its shape (from the file header) and a reader that
reads any box of it (safetensors' `get_slice`, memory-mapped). The weight loader (models/weights.py) asks a
sharded parameter for its part (`take_shard`) and only those bytes are read: no rank ever holds a full copy
of a sharded weight. Replicated parameters read the whole tensor.
"""

from __future__ import annotations

from typing import Callable

import torch

from spruce.errors import ModelLoadError


class CheckpointSlice:
    """A checkpoint tensor of `shape`, read on demand. `read_box(index)` reads `tensor[index]` (a tuple of
    slices); `transforms` run on what is read, in order (e.g. the MLA rope-row permutation, which acts per
    head and so commutes with a cut into whole heads)."""

    def __init__(self, name: str, shape: tuple[int, ...], read_box: Callable[[tuple], torch.Tensor],
                 transforms: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()):
        self.name = name
        self.shape = tuple(shape)
        self._read_box = read_box
        self._transforms = transforms

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "CheckpointSlice":
        """The same tensor with `fn` applied to whatever part of it is read."""
        return CheckpointSlice(self.name, self.shape, self._read_box, self._transforms + (fn,))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read only [start, start + length) along `dim` (like torch.Tensor.narrow, but from the file)."""
        return self._apply(self._read_box((slice(None),) * dim + (slice(start, start + length),)))

    def read(self) -> torch.Tensor:
        """Read the whole tensor."""
        return self._apply(self._read_box(()))

    def _apply(self, tensor: torch.Tensor) -> torch.Tensor:
        for fn in self._transforms:
            tensor = fn(tensor)
        return tensor


def take_shard(tensor, local_shape: tuple[int, ...], shard: tuple[int, int, int], name: str) -> torch.Tensor:
    """Part `rank` of `size` of `tensor` (a CheckpointSlice or a whole tensor) along `dim`, shard =
    (dim, rank, size), which must fill `local_shape`; ModelLoadError naming both shapes otherwise."""
    dim, rank, size = shard
    full = list(local_shape)
    full[dim] *= size
    if tuple(tensor.shape) != tuple(full):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(full)} (cut "
                             f"{size} ways along dimension {dim} for tensor parallelism: rank {rank} holds "
                             f"{tuple(local_shape)})")
    n = local_shape[dim]
    return tensor.narrow(dim, rank * n, n)


def whole(tensor) -> torch.Tensor:
    """A tensor as it is, a CheckpointSlice read whole."""
    return tensor.read() if isinstance(tensor, CheckpointSlice) else tensor
