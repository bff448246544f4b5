"""The frozen target, run through spruce's own paged forward, yielding what a draft head trains on."""

from __future__ import annotations

import torch

from spruce.attention.backend import create_backend
from spruce.config import EngineConfig
from spruce.limits import Limits
from spruce.memory import KVPool, PageAllocator, PageTable
from spruce.models.hf_config import ModelConfig
from spruce.models.loader import load_target
from spruce.runtime.batch_builder import BatchBuilder


def default_aux_layers(cfg: ModelConfig) -> tuple[int, int, int]:
    """EAGLE-3's default: the residual-stream inputs of target layers [2, L//2, L-3]."""
    n = cfg.num_layers
    return (2, n // 2, n - 3)


class TargetFeatures:
    """features(batch of token lists) -> (aux [B, L, 3H], logits [B, L, V]) for equal-length sequences."""

    def __init__(self, path, device: str, dtype: torch.dtype, batch_size: int, max_length: int):
        self.config = ModelConfig.from_dir(path)
        self.device = torch.device(device)
        ec = EngineConfig(model=str(path), page_size=16, max_running_requests=batch_size,
                          max_total_tokens=batch_size * (max_length + 16), chunked_prefill_size=batch_size * max_length)
        self.limits = Limits.derive(ec, self.config.max_position_embeddings, 1, None)
        backend = create_backend("torch" if self.device.type == "cpu" else "triton", 16)
        self.model = load_target(path, dtype, self.device, backend, aux_layers=default_aux_layers(self.config))
        self.table = PageTable(self.limits, self.device)
        self.allocator = PageAllocator(self.limits)
        c = self.config
        self.kv = KVPool(self.limits, c.num_layers, c.num_kv_heads, c.head_dim, 0, dtype, self.device)
        self.builder = BatchBuilder(self.limits, self.table, self.device)

    @torch.no_grad()
    def __call__(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        try:
            for s in seqs:
                row = self.table.alloc_row()
                self.table.append_pages(row, self.allocator.alloc(self.limits.pages_for(len(s))))
                rows.append(row)
            batch = self.builder.extend(rows, [0] * len(seqs), seqs)
            hidden, aux = self.model(batch, self.kv, self.table.table)
            logits = self.model.compute_logits(hidden)
        finally:
            for row in rows:
                self.allocator.free(self.table.release_row(row))
        b, length = len(seqs), len(seqs[0])
        return aux.view(b, length, -1), logits.view(b, length, -1)
