"""KV pools: every layer's cache for the paged slots followed by the tree scratch, chosen by attention kind.

Slot layout of one pool (DESIGN §2), the same for every kind:
    [0, num_page_slots)                                 paged, committed tokens; slot = page*page_size + offset
    [num_page_slots + row*W, num_page_slots + (row+1)*W) scratch block of request row `row` (W = scratch width)
The target pool's W is N (verify tree); the draft pool's W is K*S (draft steps). Pools share slot ids in the
paged region, so one page table addresses both, and commit is one slot copy whatever a slot holds:
    KVPool        (MHA / GQA)  k and v, [L, slots, Hkv, D] each
    LatentKVPool  (MLA)        one latent per token, [L, slots, C + R] (compressed kv, then the rope key)

A latent row starts on a CACHE_ROW_ALIGN_BYTES boundary (the backends' contract, attention/backend.py): its storage
is padded past C + R where the row is not a multiple of it.
"""

from __future__ import annotations

import torch

from spruce.attention.backend import CACHE_ROW_ALIGN_BYTES
from spruce.limits import Limits


def latent_rows(num_layers: int, num_slots: int, latent_dim: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Zeros [L, slots, latent_dim] whose rows (and so every layer) start on CACHE_ROW_ALIGN_BYTES boundaries: a view of
    [L, slots, padded] storage, padded = latent_dim rounded up to a whole number of boundaries; e.g. FP8, 56 ->
    64 (a stride of 64 bytes), bf16 576 -> 576 (1152 bytes already are)."""
    return torch.zeros(num_layers, num_slots, padded_latent_dim(latent_dim, dtype), dtype=dtype,
                       device=device)[..., :latent_dim]


def padded_latent_dim(latent_dim: int, dtype: torch.dtype) -> int:
    """Elements a latent row takes in storage: latent_dim rounded up to a multiple of CACHE_ROW_ALIGN_BYTES bytes."""
    per = max(CACHE_ROW_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size(), 1)
    return -(-latent_dim // per) * per


class SlotPool:
    """The slot space shared by every pool kind; subclasses hold the per-slot tensors (`tensors`)."""

    def __init__(self, limits: Limits, num_layers: int, scratch_width: int):
        self.limits = limits
        self.num_layers = num_layers
        self.scratch_width = scratch_width
        self.scratch_start = limits.num_page_slots
        self.num_slots = limits.pool_slots(scratch_width)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Per-slot tensors, each [L, slots, ...]."""
        raise NotImplementedError

    def scratch_slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Scratch slot ids of each row: [len(rows), W]."""
        w = self.scratch_width
        return self.scratch_start + rows.long()[:, None] * w + torch.arange(w, device=rows.device)[None, :]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's entries from slots `src` to slots `dst` ([n] each; used by commit)."""
        for t in self.tensors:
            t[:, dst] = t[:, src]


class KVPool(SlotPool):
    """Multi-head (and grouped-query) attention: K and V per KV head."""

    def __init__(self, limits: Limits, num_layers: int, num_kv_heads: int, head_dim: int, scratch_width: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(limits, num_layers, scratch_width)
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, D]

    @property
    def tensors(self):
        return self.k, self.v

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class LatentKVPool(SlotPool):
    """Multi-head latent attention: one latent vector per token and layer, shared by every head."""

    def __init__(self, limits: Limits, num_layers: int, latent_dim: int, scratch_width: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(limits, num_layers, scratch_width)
        self.latent = latent_rows(num_layers, self.num_slots, latent_dim, dtype, device)  # [L, slots, C+R]

    @property
    def tensors(self):
        return (self.latent,)

    def layer(self, i: int) -> torch.Tensor:
        return self.latent[i]  # [slots, C+R]

    @staticmethod
    def bytes_per_token(num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        return num_layers * padded_latent_dim(latent_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def pool_bytes_per_token(cfg, num_layers: int, dtype: torch.dtype) -> int:
    """KV bytes one token costs in a pool of `num_layers` layers of `cfg`'s attention kind (a ModelConfig)."""
    if cfg.mla is not None:
        return LatentKVPool.bytes_per_token(num_layers, cfg.mla.latent_dim, dtype)
    return KVPool.bytes_per_token(num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)


def target_pool_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    """KV bytes one token costs in the target's pool."""
    return pool_bytes_per_token(cfg, cfg.num_layers, dtype)


def make_pool(cfg, num_layers: int, scratch_width: int, limits: Limits, dtype: torch.dtype,
              device: torch.device) -> SlotPool:
    """A pool of `num_layers` layers for `cfg`'s attention kind (MLA: latent; else K/V per KV head)."""
    if cfg.mla is not None:
        return LatentKVPool(limits, num_layers, cfg.mla.latent_dim, scratch_width, dtype, device)
    return KVPool(limits, num_layers, cfg.num_kv_heads, cfg.head_dim, scratch_width, dtype, device)
