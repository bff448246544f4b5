"""KV pools: one tensor per K and V holding every layer's paged slots followed by the tree scratch.

Slot layout of one pool (DESIGN §2):
    [0, num_page_slots)                                 paged, committed tokens; slot = page*page_size + offset
    [num_page_slots + row*W, num_page_slots + (row+1)*W) scratch block of request row `row` (W = scratch width)
The target pool's W is N (verify tree); the draft pool's W is K*S (draft steps). Both pools share slot ids
in the paged region, so one page table addresses both.
"""

from __future__ import annotations

import torch

from spruce.limits import Limits


class KVPool:
    def __init__(self, limits: Limits, num_layers: int, num_kv_heads: int, head_dim: int, scratch_width: int,
                 dtype: torch.dtype, device: torch.device):
        self.limits = limits
        self.num_layers = num_layers
        self.scratch_width = scratch_width
        self.scratch_start = limits.num_page_slots
        self.num_slots = limits.pool_slots(scratch_width)
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, D]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def scratch_slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Scratch slot ids of each row: [len(rows), W]."""
        w = self.scratch_width
        return self.scratch_start + rows.long()[:, None] * w + torch.arange(w, device=rows.device)[None, :]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's KV from slots `src` to slots `dst` ([n] each; used by commit)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
