"""Attention backend interface and registry."""

from __future__ import annotations

from typing import Callable

import torch

from spruce.attention.metadata import ForwardBatch
from spruce.errors import ConfigError


class AttentionBackend:
    """Stores the new tokens' K/V and computes attention per the contract in `spruce.attention.metadata`.

    Implementations must accept an empty batch (T == 0) and must not synchronize with the device.
    """

    name = "base"

    def __init__(self, page_size: int):
        self.page_size = page_size

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [slots, Hkv, D] (one layer of a KVPool)
        v_cache: torch.Tensor,  # [slots, Hkv, D]
        scratch_start: int,
        batch: ForwardBatch,
        page_table: torch.Tensor,  # [rows, max_pages] int32
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        raise NotImplementedError

    def forward_latent(
        self,
        q: torch.Tensor,  # [T, Hq, Dk]: absorbed query (q_nope @ W_UK, then the rotated rope part)
        latent: torch.Tensor,  # [T, Dk]: the new tokens' latent keys (normed compressed kv, then rotated k_rope)
        cache: torch.Tensor,  # [slots, Dk] (one layer of a LatentKVPool)
        value_dim: int,  # Dv: a key's first Dv values are its value (the compressed kv)
        scratch_start: int,
        batch: ForwardBatch,
        page_table: torch.Tensor,  # [rows, max_pages] int32
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, Dv]
        """MLA in absorbed form: multi-query attention over one shared latent per token (DeepSeek-V2/V3).

        Same contract as `forward` (slots, prefix, scratch bits), with a single KV head whose value is a prefix
        of its key: stores `latent` into cache[out_slots], then attends."""
        raise NotImplementedError(f"attention backend {self.name!r} has no MLA (latent) attention")


_REGISTRY: dict[str, Callable[[], type[AttentionBackend]]] = {}


def register_backend(name: str, loader: Callable[[], type[AttentionBackend]]) -> None:
    _REGISTRY[name] = loader


def create_backend(name: str, page_size: int) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ConfigError(f"attention_backend={name!r} is not supported; expected one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]()(page_size)


def _load_torch():
    from spruce.attention.torch_backend import TorchAttention

    return TorchAttention


def _load_triton():
    from spruce.attention.triton_backend import TritonAttention
    from spruce.ops.triton_support import HAS_TRITON, missing_triton_error

    if not HAS_TRITON:
        raise missing_triton_error("attention_backend='triton'")

    return TritonAttention


register_backend("torch", _load_torch)
register_backend("triton", _load_triton)
