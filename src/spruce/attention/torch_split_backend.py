"""The `torch-split` backend: every phase as paged prefix + tree scratch, merged by log-sum-exp (attention/merge.py).

It computes what a library-kernel backend (FlashInfer) computes, in float32 torch: `attend_prefix` stands for
the library's plain paged attention with LSE, `attend_scratch` for spruce's small masked kernel, `merge_states`
for the library's merge. It equals the `torch` reference (one masked softmax over both) to float32 rounding, so
the whole engine runs through it in CI (tests/test_attention_merge.py). CPU and GPU, eager only.

It also checks the plan contract (DESIGN §13) from the backend's side: `plan` records each phase's batch layout
and a forward over a batch whose layout was not planned raises, so an engine path that forgets to plan fails here
before it fails on a backend whose plan matters.
"""

from __future__ import annotations

import torch

from spruce.attention.backend import AttentionBackend
from spruce.attention.merge import attend_prefix, attend_scratch, merge_states
from spruce.attention.metadata import ForwardBatch, Phase
from spruce.errors import InvariantError


class TorchSplitAttention(AttentionBackend):
    name = "torch-split"

    def __init__(self, page_size: int, limits=None, device=None):
        super().__init__(page_size, limits, device)
        self.planned: dict[Phase, tuple] = {}  # phase -> layout of its last plan

    def plan(self, batch: ForwardBatch, page_table: torch.Tensor) -> None:
        self.planned[batch.phase] = batch.layout

    def _check_planned(self, batch: ForwardBatch) -> None:
        planned = self.planned.get(batch.phase)
        if planned != batch.layout:
            raise InvariantError(f"{batch.phase.value}: attention forward over a batch of layout {batch.layout}, "
                                 f"but the backend's last plan of this phase was {planned}")

    def forward(self, q, k, v, k_cache, v_cache, scratch_start, batch: ForwardBatch, page_table, scale):
        self._check_planned(batch)
        k_cache[batch.out_slots] = k.to(k_cache.dtype)
        v_cache[batch.out_slots] = v.to(v_cache.dtype)
        return self._attend(q, k_cache, v_cache, scratch_start, batch, page_table, scale)

    def forward_latent(self, q, latent, cache, value_dim, scratch_start, batch: ForwardBatch, page_table, scale):
        self._check_planned(batch)
        cache[batch.out_slots] = latent.to(cache.dtype)
        keys = cache[:, None, :]  # [slots, 1, Dk]: one KV head whose value is its first Dv columns
        return self._attend(q, keys, keys[..., :value_dim], scratch_start, batch, page_table, scale)

    def _attend(self, q, k_cache, v_cache, scratch_start, batch: ForwardBatch, page_table, scale) -> torch.Tensor:
        o_prefix, lse_prefix = attend_prefix(q, k_cache, v_cache, batch, page_table, self.page_size, scale)
        # EXTEND / DECODE / DRAFT_EXTEND have no scratch (zeros, lse -inf): the merge returns the prefix half
        o_scratch, lse_scratch = attend_scratch(q, k_cache, v_cache, batch, scratch_start, scale)
        out, _ = merge_states(o_prefix, lse_prefix, o_scratch, lse_scratch)
        return out.to(q.dtype)
