"""ModelRunner: loads the target (and draft), sizes every buffer from `Limits`, runs forwards.

It owns the page table, the page allocator, both KV pools, the rows' device decode state and the metadata
builder; the scheduler and the decode strategies ask it for forwards and never size anything themselves.
It also plans the attention backend (DESIGN §13): a decode-time phase plans through `planner`, a callback that
BucketGraphs runs before the phase (eager or replay); any other forward is planned right before it.

Tensor-parallel (a `tp` group, DESIGN §18): the runner holds this rank's slice of the target, a KV pool of its
KV heads (MLA: the whole latent, replicated), the whole draft, and sizes the cache from the smallest free
memory of any rank, so every rank derives the same Limits.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from spruce.attention import registry as attention_registry
from spruce.attention.backend import create_backend
from spruce.attention.metadata import ForwardBatch, Phase
from spruce.config import EngineConfig
from spruce.errors import ConfigError, InvariantError
from spruce.limits import Limits
from spruce.memory.kv_pool import make_pool, pool_bytes_per_token, target_pool_bytes_per_token
from spruce.models.quantization import check_fp8_kv_cache
from spruce.ops.fp8 import FP8_DTYPE
from spruce.memory.page_allocator import PageAllocator
from spruce.memory.page_table import PageTable
from spruce.memory.window import WindowReach
from spruce.models.layers import Attention
from spruce.models.hf_config import ModelConfig
from spruce.models.loader import draft_aux_layers, load_draft, load_target
from spruce.models.rope import Rotary
from spruce.runtime.batch_builder import BatchBuilder
from spruce.runtime.cuda_graph import BucketGraphs
from spruce.runtime.device import device_name
from spruce.runtime.fixes import reverted_fixes_from_env
from spruce.runtime.penalties import PenaltyState
from spruce.runtime.row_state import RowState
from spruce.runtime.timer import PhaseTimer
from spruce.runtime.token_restrictions import OutputTails

logger = logging.getLogger("spruce")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_tree_fits_window(spec, cfg: ModelConfig, what: str = "the target") -> None:
    """A tree node at depth d (<= speculative_num_steps) sees its ancestors, the d positions before it, whole
    (attention/torch_backend.key_mask): exact only if they all lie in every sliding window, so S < window."""
    window = cfg.sliding_window
    if spec is None or window is None or not cfg.needs_windows or spec.num_steps < window:
        return
    raise ConfigError(f"speculative_num_steps={spec.num_steps} must be below {what}'s sliding_window={window} "
                      f"(a draft tree's ancestors must lie inside every window)")


def hold_to_window(model, window: int) -> None:
    """Every attention layer of `model` reads at most its last `window` positions (its own window where
    narrower)."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.window = window if m.window is None else min(m.window, window)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp=None):
        self.config = config
        self.tp = tp
        self.device = tp.device if tp is not None else torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.model_config = ModelConfig.from_dir(config.model)
        self.backend = self._build_backend(config)  # allocated once the Limits exist
        self.backend.check_model(head_dim=self.model_config.head_dim, mla=self.model_config.mla is not None,
                                 window=self.model_config.needs_windows, chunk=self.model_config.needs_chunks,
                                 what="the target")
        spec = config.speculative
        check_tree_fits_window(spec, self.model_config)
        loads_draft = spec is not None and spec.loads_draft  # NGRAM drafts from the context: no draft model
        aux_layers = draft_aux_layers(spec, self.model_config) if loads_draft else ()
        self.target = load_target(config.model, self.dtype, self.device, self.backend, aux_layers=aux_layers,
                                  show_progress=config.show_progress, load_format=config.load_format, tp=tp,
                                  quantization=config.quantization)
        self.draft = None
        if loads_draft:
            self.draft = load_draft(spec, self.target, self.model_config, self.dtype, self.device, self.backend,
                                    show_progress=config.show_progress, load_format=config.load_format)
            dc = self.draft.attention_config
            self.backend.check_model(head_dim=dc.head_dim, mla=dc.mla is not None, window=dc.needs_windows,
                                     chunk=dc.needs_chunks, what="the draft")
            check_tree_fits_window(spec, dc, "the draft")
        # every target layer windowed: pages behind the windows are freed (Scheduler.free_behind_windows), and the
        # draft, whose KV shares those pages, reads no further back than the widest target layer
        self.window_reach = WindowReach.of_model(self.model_config)
        if self.draft is not None and self.window_reach.frees:
            self.window_reach = self.window_reach.with_draft()
            hold_to_window(self.draft, self.window_reach.draft_window)
            self.backend.check_model(window=True, what="the draft (held to the target's window)")
        mc = self.model_config
        self.target_pool_config = self._rank_attention_config(mc)
        # the target's KV cache dtype: the model's, or FP8 (models scale what they store, ops/fp8.py)
        self.kv_dtype = FP8_DTYPE if config.fp8_kv_cache else self.dtype
        if config.fp8_kv_cache:
            check_fp8_kv_cache(self.target, config.kv_cache_dtype)
        kv_bytes = target_pool_bytes_per_token(self.target_pool_config, self.kv_dtype)
        if self.draft is not None:
            kv_bytes += pool_bytes_per_token(self.draft.attention_config, self.draft.num_layers, self.dtype)
        self.limits = Limits.derive(config, mc.max_position_embeddings, kv_bytes, self._kv_budget_bytes(),
                                    reverted_fixes_from_env())
        lim = self.limits
        self._cover_positions(lim.rope_positions)
        self.page_table = PageTable(lim, self.device)
        self.allocator = PageAllocator(lim)
        self.target_kv = make_pool(self.target_pool_config, mc.num_layers, lim.target_scratch_width, lim, self.kv_dtype,
                                   self.device)
        self.draft_kv = None
        if self.draft is not None:
            self.draft_kv = make_pool(self.draft.attention_config, self.draft.num_layers, lim.draft_scratch_width,
                                      lim, self.dtype, self.device)
        self.builder = BatchBuilder(lim, self.page_table, self.device)
        self._prefilled: int | None = None  # tokens of the last prefill_forward (`prefilled_tokens`)
        self.graphs = BucketGraphs(lim, self.device, config.use_cuda_graph)
        self.backend.allocate(lim, self.device)
        self.prefill_graphs = BucketGraphs.for_prefill(lim, self.device,
                                                       config.use_cuda_graph and self.backend.captures_prefill)
        self._draft_features: torch.Tensor | None = None  # draft prefill graphs' static input (_draft_feature_buffer)
        self._planned: dict[Phase, tuple] = {}  # phase -> layout planned by the running decode-time phase
        self._planners: dict[tuple, Callable[[int, int], None]] = {}  # (phases, tree width) -> plan callback
        self.timer = PhaseTimer(self.device)
        self.row_state = RowState(lim, self.device)
        self.penalties = PenaltyState(lim, mc.vocab_size, self.device)  # allocated when first used
        self.output_tails = OutputTails(lim, self.device)  # bad words' recent tokens, allocated when first used
        logger.info("spruce limits: %s", lim)

    def _build_backend(self, config: EngineConfig):
        """The configured attention backend; `auto` on CUDA: the per-phase composite for this device (DESIGN §13),
        or with an FP8 KV cache its fallback, triton, which reads one in every phase."""
        if attention_registry.is_auto(config.attention_backend, config.device) and not config.fp8_kv_cache:
            from spruce.attention.auto_backend import auto_attention

            return auto_attention(config.page_size, str(self.device), device_name(str(self.device)), config.dtype,
                                  config.use_cuda_graph)
        return create_backend(config.resolved_attention_backend, config.page_size)

    def _rank_attention_config(self, cfg: ModelConfig) -> ModelConfig:
        """The attention shape this rank's target pool holds: its KV heads (MLA: the latent, replicated)."""
        if self.tp is None or cfg.mla is not None:
            return cfg
        return dataclasses.replace(cfg, num_kv_heads=self.tp.shard(cfg.num_kv_heads, "num_key_value_heads"))

    def _cover_positions(self, num_positions: int) -> None:
        """Size every rope table of the target and the draft to `num_positions` (Limits.rope_positions)."""
        models = [self.target] + ([self.draft] if self.draft is not None else [])
        for rotary in {id(m): m for model in models for m in model.modules() if isinstance(m, Rotary)}.values():
            rotary.cover(num_positions)

    def _kv_budget_bytes(self) -> int | None:
        """Free device memory times mem_fraction_static (cuda; tensor-parallel: the smallest of any rank's, so
        that every rank sizes its cache alike); None on cpu (Limits' default applies)."""
        if self.device.type != "cuda" or self.config.max_total_tokens is not None:
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = total * (1.0 - self.config.mem_fraction_static)
        budget = int(max(free - reserve, 0) * 0.9)
        return budget if self.tp is None else self.tp.min_over_ranks(budget)

    # --- attention plans (DESIGN §13) -------------------------------------------------------------------------
    def plan(self, batch: ForwardBatch) -> None:
        """Plan the attention backend for forwards over `batch` (host side, outside any CUDA graph)."""
        self.page_table.check_written("an attention plan")
        self.backend.plan(batch, self.page_table.table)
        self._planned[batch.phase] = batch.layout

    def set_known_prefix(self, rows: list[int] | None, floors: list[int] | None) -> None:
        """Before a decode step: its requests' page-table rows and the committed length of each that the host
        knows (final pages; a lower bound of the device's under overlap). Backends whose library kernels plan
        from host lengths read them from the batches (`ForwardBatch.host_kv_floor`); None after the step."""
        self.builder.set_known_prefix(rows, floors)

    def phase_layout(self, phase: Phase, tree_width: int | None = None) -> tuple[int, int]:
        """(tokens per request, scratch width) of a uniform-stride phase, from the Limits; VERIFY's tokens are the
        tree's `tree_width` (None: N; adaptive rounds may verify a narrower tree, Limits.tree_widths)."""
        lim = self.limits
        layouts = {Phase.DECODE: (1, 0), Phase.VERIFY: (tree_width or lim.num_draft_tokens, lim.target_scratch_width),
                   Phase.DRAFT_DECODE: (lim.eagle_topk, lim.draft_scratch_width),
                   Phase.DRAFT_EXTEND: (lim.draft_extend_stride, 0)}
        return layouts[phase]

    def planner(self, *phases: Phase, tree_width: int | None = None) -> Callable[[int, int], None]:
        """The plan callback of a decode-time phase whose forwards are `phases` (BucketGraphs.run / capture call
        it with the rows and max_kv_len the phase runs with): plans each from the batch the builder will build
        (`tree_width`: a VERIFY's tree, `phase_layout`)."""
        key = (phases, tree_width)
        if key not in self._planners:
            layouts = [(phase, *self.phase_layout(phase, tree_width)) for phase in phases]  # (phase, stride, width)

            def plan(rows: int, max_kv_len: int) -> None:
                self._planned = {}  # only this phase's plans count for its forwards
                for phase, stride, width in layouts:
                    self.plan(self.builder.describe(phase, rows, stride, max_kv_len, width))

            self._planners[key] = plan
        return self._planners[key]

    def _ensure_planned(self, batch: ForwardBatch) -> None:
        """Inside a decode-time phase the batch must be one its plan callback planned; elsewhere (prefill,
        scoring: eager, host-built batches) it is planned right here, before its forward."""
        phase = self.graphs.phase or self.prefill_graphs.phase
        if phase is None:
            self.plan(batch)
            return
        planned = self._planned.get(batch.phase)
        if planned != batch.layout:
            raise InvariantError(
                f"phase {phase!r}: {batch.phase.value} forward over a batch of layout {batch.layout}, but the "
                f"phase planned {planned} (its plan callback must describe every forward it runs: "
                f"ModelRunner.planner)"
            )

    # --- forwards ------------------------------------------------------------------------------------------
    def target_forward(self, batch: ForwardBatch, aux: bool = True) -> tuple[torch.Tensor, object]:
        """hidden [T, H] (final-normed) and aux [T, A] (EAGLE-3 features) or None; `aux` False: none kept, aux
        None (DecoderLM.forward)."""
        self._ensure_planned(batch)
        self.page_table.check_written("a target forward")
        return self.target(batch, self.target_kv, self.page_table.table, aux=aux)

    def prefill_forward(self, rows: list[int], starts: list[int], tokens: list[list[int]],
                        aux: bool = True, set_ids: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, object]:
        """The target over prompt chunks (EXTEND): tokens[i] at positions starts[i].. of page-table row rows[i].
        Returns hidden [n, H] and aux [n, A] or None for the n tokens, in order (`aux` False: None, and an eager
        forward keeps no aux features). `set_ids` = (index [k], ids [k]) on the device overwrites those tokens' ids
        first (as `draft_extend_forward`'s: a mixed step's decode rows, whose tokens the host does not know yet).

        A batch of at most the largest prefill bucket's tokens replays that bucket's graph (`capture_prefill_graphs`)
        over the batch padded up to it (its outputs are views of the graph's static buffers, valid until the next
        prefill); a larger one, or any before the graphs are captured, runs eagerly over the batch itself."""
        graphs = self.prefill_graphs
        num_tokens = sum(len(t) for t in tokens)
        self._prefilled = num_tokens
        bucket = graphs.bucket(num_tokens)
        if bucket is None or not graphs.captured("prefill", bucket):
            batch = self.builder.extend(rows, starts, tokens)
            if set_ids is not None:
                batch.input_ids[set_ids[0]] = set_ids[1]
            return self.target_forward(batch, aux=aux)
        self.builder.extend(rows, starts, tokens, pad_to=bucket)
        if set_ids is not None:  # the padded batch's first tokens are the batch's own, in order
            self.builder.input_ids[set_ids[0]] = set_ids[1]
        hidden, kept = graphs.run("prefill", self.prefill_phase, bucket, graphs.kv_bound, plan=self._plan_prefill)
        return hidden[:num_tokens], (kept[:num_tokens] if aux and kept is not None else None)

    def prefilled_tokens(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The page-table row and the position [num_tokens] each (device) of the last `prefill_forward`'s tokens, in
        its order: views of the batch builder's buffers, which that prefill filled (no host work, no copy), valid
        until the next forward fills them again. Always on: `num_tokens` must be that prefill's."""
        if num_tokens != self._prefilled:
            raise InvariantError(f"prefilled_tokens({num_tokens}): the last prefill_forward ran {self._prefilled} "
                                 f"tokens")
        return self.builder.token_rows[:num_tokens], self.builder.positions[:num_tokens]

    def prefill_phase(self, num_tokens: int, max_kv_len: int) -> tuple[torch.Tensor, object]:
        """What a prefill graph captures: the target over the padded batch of `num_tokens` tokens that
        `BatchBuilder.extend(pad_to=num_tokens)` filled (hidden [num_tokens, H], aux or None)."""
        return self.target_forward(self.builder.padded_extend(num_tokens, max_kv_len))

    def draft_extend_forward(self, rows: list[int], starts: list[int], tokens: list[list[int]], features: torch.Tensor,
                             set_ids: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The draft over ragged chunks (EXTEND): tokens[i] at positions starts[i].. of row rows[i], each token paired
        with its row of `features` [n, F]; `set_ids` = (index [k], ids [k]) on the device overwrites those tokens'
        ids first (tokens the host does not know yet: one sampled after a prompt, a row's last token). Returns the
        draft's hidden [n, Hd] (a view of a graph's static output when replayed, valid until the next one).

        Like `prefill_forward`: a batch that fits a prefill bucket replays that bucket's draft graph over the batch
        padded up to it (the features copied into the graph's static input first), a larger one runs eagerly."""
        graphs = self.prefill_graphs
        num_tokens = sum(len(t) for t in tokens)
        bucket = graphs.bucket(num_tokens)
        if bucket is None or not graphs.captured("draft_prefill", bucket):
            batch = self.builder.extend(rows, starts, tokens)
            if set_ids is not None:
                batch.input_ids[set_ids[0]] = set_ids[1]
            return self.draft_forward(batch, features)
        self.builder.extend(rows, starts, tokens, pad_to=bucket)
        if set_ids is not None:  # the padded batch's first tokens are the batch's own, in order
            self.builder.input_ids[set_ids[0]] = set_ids[1]
        self._draft_feature_buffer()[:num_tokens].copy_(features)
        hidden = graphs.run("draft_prefill", self.draft_prefill_phase, bucket, graphs.kv_bound, plan=self._plan_prefill)
        return hidden[:num_tokens]

    def draft_prefill_phase(self, num_tokens: int, max_kv_len: int) -> torch.Tensor:
        """What a draft prefill graph captures: the draft over the padded batch of `num_tokens` tokens that
        `BatchBuilder.extend(pad_to=num_tokens)` filled, with the features of the static input (hidden [T, Hd])."""
        batch = self.builder.padded_extend(num_tokens, max_kv_len)
        return self.draft_forward(batch, self._draft_feature_buffer()[:num_tokens])

    def _draft_feature_buffer(self) -> torch.Tensor:
        """[largest prefill bucket, F]: the features every draft prefill graph reads (made on first use)."""
        if self._draft_features is None:
            self._draft_features = torch.zeros(self.prefill_graphs.buckets[-1], self.draft.feature_width_first_step,
                                               dtype=self.dtype, device=self.device)
        return self._draft_features

    def _plan_prefill(self, num_tokens: int, max_kv_len: int) -> None:
        self._planned = {}
        self.plan(self.builder.padded_extend(num_tokens, max_kv_len))

    def capture_prefill_graphs(self, show_progress: bool) -> None:
        """Capture the prefill graphs of every token bucket (Limits.prefill_graph_tokens): the target's and, with a
        draft, the draft's extend, over batches of padding alone. The engine calls this after its eager warm-up,
        which must compile the eager prefill's kernels (prompts past the largest bucket run them)."""
        if not self.prefill_graphs.enabled:
            return
        phases = [("prefill", self.prefill_phase, self._plan_prefill)]
        if self.draft is not None:
            phases.append(("draft_prefill", self.draft_prefill_phase, self._plan_prefill))
        for phase in phases:  # each its own chain: the draft's reads no output of the target's graph
            self.prefill_graphs.capture([phase], lambda tokens: self.builder.extend([], [], [], pad_to=tokens),
                                        f"capturing {phase[0]} graphs", show_progress)

    def release_graphs(self) -> None:
        """Free every captured graph (BucketGraphs.release); later forwards run eagerly."""
        self.graphs.release()
        self.prefill_graphs.release()

    def target_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """What the draft consumes from the target: EAGLE-3's aux concatenation, else EAGLE's hidden."""
        return aux if aux is not None else hidden

    def draft_forward(self, batch: ForwardBatch, features: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Draft hidden [T, Hd] (its next-step feature) for batch.input_ids paired with `features` [T, F].

        layer: the draft layer a draft step runs (multi-layer MTP); None for a draft extend (every layer)."""
        self._ensure_planned(batch)
        self.page_table.check_written("a draft forward")
        return self.draft(batch.input_ids, features, batch, self.draft_kv, self.page_table.table, layer)
