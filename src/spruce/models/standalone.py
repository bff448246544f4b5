"""A separate small causal LM as the draft (STANDALONE; vLLM's `draft_model`): any registered target architecture
whose vocabulary is the target's, with its own layers and its own paged KV. It reads tokens only (no target
features).

`StandaloneDraft` gives such a model the draft interface `EagleWorker` drives (models/eagle.py's `EagleDraft`:
`forward`, `compute_logits`, `step_layer`, `draft_to_target`, `attention_config`, `num_layers`), so the worker's
tree, verify, scratch and commit machinery runs it unchanged; speculative/draft_model.py says where its tokens go
(the token at position p sits at p, as in the target, not at p-1 as in an EAGLE head's pairs).
"""

from __future__ import annotations

import torch
from torch import nn

from spruce.errors import ConfigError
from spruce.models.hf_config import ModelConfig


def check_same_vocabulary(draft: ModelConfig, target: ModelConfig, path) -> None:
    """A draft LM proposes target token ids as they are: its vocabulary must be the target's."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"STANDALONE draft {path} has vocab_size {draft.vocab_size}, the target has "
                          f"{target.vocab_size}: a draft model must share the target's vocabulary")


class StandaloneDraft(nn.Module):
    """A DecoderLM (models/decoder.py) as a draft. forward(input_ids [T], features, batch, kv, page_table) -> its
    final-normed hidden [T, H]; `features` are ignored (width 0 where the runner keeps a buffer of them)."""

    feature_width_first_step = 0  # reads no target features

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        cfg: ModelConfig = model.config
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_layers  # each caches in its own layer of the draft's pool
        self.draft_vocab_size = cfg.vocab_size

    @property
    def attention_config(self) -> ModelConfig:
        """The draft's attention shape (what its KV pool is made for): its own config."""
        return self.model.config

    def step_layer(self, step: int) -> int:
        """Every draft step runs the whole model."""
        return 0

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor | None, batch, kv, page_table,
                layer: int | None = None) -> torch.Tensor:
        """The model over batch.input_ids (= input_ids) at batch.positions, caching in `kv`: hidden [T, H]."""
        hidden, _ = self.model(batch, kv, page_table, aux=False)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """hidden [n, H] -> [n, V] float32."""
        return self.model.compute_logits(hidden)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """The vocabularies are one: ids as they are."""
        return ids
