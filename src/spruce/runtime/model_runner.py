"""ModelRunner: loads the target (and draft), sizes every buffer from `Limits`, runs forwards.

It owns the page table, the page allocator, both KV pools, the rows' device decode state and the metadata
builder; the scheduler and the decode strategies ask it for forwards and never size anything themselves.
"""

from __future__ import annotations

import logging

import torch

from spruce.attention.backend import create_backend
from spruce.attention.metadata import ForwardBatch
from spruce.config import EngineConfig
from spruce.limits import Limits
from spruce.memory.kv_pool import make_pool, pool_bytes_per_token, target_pool_bytes_per_token
from spruce.memory.page_allocator import PageAllocator
from spruce.memory.page_table import PageTable
from spruce.models.hf_config import ModelConfig
from spruce.models.loader import draft_aux_layers, load_draft, load_target
from spruce.runtime.batch_builder import BatchBuilder
from spruce.runtime.cuda_graph import BucketGraphs
from spruce.runtime.fixes import reverted_fixes_from_env
from spruce.runtime.row_state import RowState
from spruce.runtime.timer import PhaseTimer

logger = logging.getLogger("spruce")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.model_config = ModelConfig.from_dir(config.model)
        self.backend = create_backend(config.resolved_attention_backend, config.page_size)
        spec = config.speculative
        aux_layers = draft_aux_layers(spec, self.model_config) if spec is not None else ()
        self.target = load_target(config.model, self.dtype, self.device, self.backend, aux_layers=aux_layers,
                                  show_progress=config.show_progress, load_format=config.load_format)
        self.draft = None
        if spec is not None:
            self.draft = load_draft(spec, self.target, self.model_config, self.dtype, self.device, self.backend,
                                    show_progress=config.show_progress, load_format=config.load_format)
        mc = self.model_config
        kv_bytes = target_pool_bytes_per_token(mc, self.dtype)
        if self.draft is not None:
            kv_bytes += pool_bytes_per_token(self.draft.attention_config, self.draft.num_layers, self.dtype)
        self.limits = Limits.derive(config, mc.max_position_embeddings, kv_bytes, self._kv_budget_bytes(),
                                    reverted_fixes_from_env())
        lim = self.limits
        self.page_table = PageTable(lim, self.device)
        self.allocator = PageAllocator(lim)
        self.target_kv = make_pool(mc, mc.num_layers, lim.target_scratch_width, lim, self.dtype, self.device)
        self.draft_kv = None
        if self.draft is not None:
            self.draft_kv = make_pool(self.draft.attention_config, self.draft.num_layers, lim.draft_scratch_width,
                                      lim, self.dtype, self.device)
        self.builder = BatchBuilder(lim, self.page_table, self.device)
        self.graphs = BucketGraphs(lim, self.device, config.use_cuda_graph)
        self.timer = PhaseTimer(self.device)
        self.row_state = RowState(lim, self.device)
        logger.info("spruce limits: %s", lim)

    def _kv_budget_bytes(self) -> int | None:
        """Free device memory times mem_fraction_static (cuda); None on cpu (Limits' default applies)."""
        if self.device.type != "cuda" or self.config.max_total_tokens is not None:
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = total * (1.0 - self.config.mem_fraction_static)
        return int(max(free - reserve, 0) * 0.9)

    # --- forwards ------------------------------------------------------------------------------------------
    def target_forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [T, H] (final-normed) and aux [T, A] (EAGLE-3 features) or None."""
        return self.target(batch, self.target_kv, self.page_table.table)

    def target_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """What the draft consumes from the target: EAGLE-3's aux concatenation, else EAGLE's hidden."""
        return aux if aux is not None else hidden

    def draft_forward(self, batch: ForwardBatch, features: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Draft hidden [T, Hd] (its next-step feature) for batch.input_ids paired with `features` [T, F].

        layer: the draft layer a draft step runs (multi-layer MTP); None for a draft extend (every layer)."""
        return self.draft(batch.input_ids, features, batch, self.draft_kv, self.page_table.table, layer)
