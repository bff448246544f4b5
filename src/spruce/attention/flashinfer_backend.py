"""The `flashinfer` attention backend (MHA / GQA): FlashInfer's paged kernels for the committed prefix, spruce's
Triton kernel for what only the device knows, merged by FlashInfer's `merge_state` (DESIGN §13).

Every forward is split at a length the host knows exactly:

* **EXTEND** (prefill chunks, host-built): one causal FlashInfer paged prefill over each request's whole range
  (its host lengths are exact). No tree, no merge.
* **Decode-time phases** (DECODE, VERIFY, DRAFT_DECODE, DRAFT_EXTEND): request b's tokens see the committed
  pages [0, kv_lens[t]) plus tree scratch. The host knows a floor F_b <= every kv_lens[t] of the request whose
  pages are final (the committed length as of the last resolved step, `ForwardBatch.host_kv_floor`; under
  overlap scheduling the device may be a round or two ahead of it). So:
    prefix half  [0, F_b)             FlashInfer paged attention, non-causal, planned from exact host lengths;
    tail half    [F_b, kv_lens[t])    + the ancestor-masked scratch: spruce's Triton kernel (`kv_start` = F);
    merge        log-sum-exp, base 2  (flashinfer.merge_state).
  Without a floor (a batch the engine did not describe, graph capture) F = 0: the tail kernel then does all the
  work, which is correct and merely slower. Page size and topk still never meet in FlashInfer: it sees pages
  only; the tree stays in spruce's kernel. Padding tokens (nothing seen in either half) get zeros, as the
  contract requires.

Plans (host, outside graphs): FlashInfer's `plan` reads host indptr / last-page-len arrays, which the backend
derives from the floors; the page indices are gathered from the page table on the device (no host copy of the
table). Decode-time phases use graph-mode wrappers, one per (phase, model shape, rows) since FlashInfer fixes a
graph wrapper's batch size, over Limits-sized buffers per phase, whether the batch then replays a graph or runs
eagerly: an eager batch gets the very schedule (split-kv chunks) a replay of its size gets, so graphs and eager
agree bit for bit in bf16. EXTEND uses one plain wrapper per model shape. FlashInfer's plan stages its
schedule in a pinned host buffer and copies it asynchronously: a wrapper's next plan first waits for the event
recorded after its previous plan, so the host can never overwrite a schedule the device has not read yet
(overlap scheduling plans a step while the last one runs).

Model shapes (heads, KV heads, head dim, scale) are learned from the first forward of each phase and model
(eager: graph capture warms up eagerly first); every later plan of the phase re-plans each of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import flashinfer
import flashinfer.mla
import torch

from spruce.attention.backend import AttentionBackend
from spruce.attention.metadata import ForwardBatch, Phase
from spruce.attention.triton_backend import TritonAttention
from spruce.attention.triton_kernels.mla_attention import store_latent
from spruce.attention.triton_kernels.store_kv import store_kv
from spruce.errors import InvariantError

FLOAT_WORKSPACE_BYTES = 256 << 20  # split-kv partial outputs, shared by every wrapper (they run one at a time)
# schedule buffers, one per phase on the device (each wrapper has a pinned copy): FlashInfer's default for
# prefill; a decode-time schedule of R rows x N tokens needs ~(3 x tiles + rows) ints, well under 1 MiB
# flashinfer.merge_state runs one thread block per token with (head_dim / 8) x heads threads: at most 1024 threads,
# so heads x head_dim <= 8192 per call (128 MLA heads x 512 failed with "invalid argument" on the H100)
MERGE_MAX_BLOCK_ELEMENTS = 8192
EXTEND_INT_WORKSPACE_BYTES = 8 << 20
DECODE_INT_WORKSPACE_BYTES = 1 << 20
GRAPH_KERNELS = "fa2"  # decode-time phases: FlashInfer's graph-mode schedule (split-kv) is FA2's
EXTEND_KERNELS = "auto"  # prefill: FlashInfer's choice (FA3 on Hopper)


@dataclass(frozen=True)
class Shape:
    """One model's attention as FlashInfer plans it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype


@dataclass(frozen=True)
class LatentShape:
    """One MLA model's attention as FlashInfer plans it (absorbed form: one latent of key_dim per position,
    whose first value_dim columns are the value)."""

    num_heads: int
    key_dim: int
    value_dim: int
    scale: float
    dtype: torch.dtype


@dataclass
class PrefixPlan:
    """The host side of one phase's plan: what FlashInfer's `plan` takes, and the Triton tail's start."""

    rows: int  # batch rows (padding included)
    extend: bool  # EXTEND: causal, one plain wrapper; else a decode-time phase: graph-mode wrappers (fixed rows)
    qo_indptr: torch.Tensor  # [rows+1] int32, host
    kv_indptr: torch.Tensor  # [rows+1] int32, host (pages)
    last_page_len: torch.Tensor  # [rows] int32, host
    kv_lens: torch.Tensor  # [rows] int32, host (tokens: FlashInfer MLA's kv_len_arr)
    kv_indices: torch.Tensor  # [nnz pages] int32, device
    kv_start: torch.Tensor | None  # [rows] int32, device: the floors (decode-time phases)
    q_stride: int = 0  # query tokens per request of a decode-time phase (VERIFY: the tree's width), 0 for EXTEND


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, page_size: int, limits=None, device=None):
        self.tail = TritonAttention(page_size)  # the tail + scratch half
        self._shapes: dict[Phase, list[Shape]] = {}
        self._plans: dict[Phase, PrefixPlan] = {}
        self._wrappers: dict[tuple, flashinfer.BatchPrefillWithPagedKVCacheWrapper] = {}
        self._planned: dict[tuple, PrefixPlan] = {}  # wrapper key -> the plan it was last planned with
        self._fences: dict[tuple, torch.cuda.Event] = {}
        super().__init__(page_size, limits, device)

    def allocate(self, limits, device) -> None:
        super().allocate(limits, device)
        self.tail.allocate(limits, device)
        rows = limits.num_rows
        i32 = dict(dtype=torch.int32, device=self.device)
        self.float_workspace = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._int_workspace: dict[Phase, torch.Tensor] = {}
        # per phase: graph-mode wrappers' fixed buffers (views of these for each bucket), and the gathered indices
        max_pages = rows * limits.max_pages_per_request
        self._buffers = {phase: dict(qo_indptr=torch.zeros(rows + 1, **i32), kv_indptr=torch.zeros(rows + 1, **i32),
                                     last_page_len=torch.zeros(rows, **i32), kv_lens=torch.zeros(rows, **i32),
                                     kv_indices=torch.zeros(max_pages, **i32),
                                     kv_start=torch.zeros(rows, **i32), staged=torch.zeros(max_pages + 1, **i32))
                         for phase in Phase}

    # --- plan (host, outside graphs) ---------------------------------------------------------------------------
    def plan(self, batch: ForwardBatch, page_table: torch.Tensor) -> None:
        plan = self._prefix_plan(batch, page_table)
        self._plans[batch.phase] = plan
        for shape in self._shapes.get(batch.phase, ()):
            self._plan_wrapper(batch.phase, shape, plan)

    def _prefix_plan(self, batch: ForwardBatch, page_table: torch.Tensor) -> PrefixPlan:
        bs, ps = batch.batch_size, self.page_size
        bufs = self._buffers[batch.phase]
        if batch.phase == Phase.EXTEND:
            if batch.host_rows is None or batch.host_q_lens is None:
                raise InvariantError("extend: the flashinfer backend plans from the batch's host rows and lengths")
            rows, lengths, q_lens = batch.host_rows, batch.host_kv_lens, batch.host_q_lens
        else:
            rows = batch.host_rows if batch.host_rows is not None else (self.limits.dummy_row,) * bs
            lengths = batch.host_kv_floor if batch.host_kv_floor is not None else (0,) * bs
            q_lens = (batch.max_q_len,) * bs
        pages = [-(-n // ps) for n in lengths]  # ceil
        qo_indptr = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kv_indptr = torch.tensor([0, *pages], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * ps if p else 0 for n, p in zip(lengths, pages)], dtype=torch.int32)
        nnz = int(kv_indptr[-1])
        indices = self._gather_indices(bufs, page_table, rows, pages, kv_indptr, nnz)
        kv_start = None
        if batch.phase != Phase.EXTEND:
            kv_start = bufs["kv_start"][:bs]
            kv_start.copy_(torch.tensor(lengths, dtype=torch.int32), non_blocking=True)
        return PrefixPlan(bs, batch.phase == Phase.EXTEND, qo_indptr, kv_indptr, last,
                          torch.tensor(lengths, dtype=torch.int32), indices, kv_start,
                          0 if batch.phase == Phase.EXTEND else batch.max_q_len)

    def _gather_indices(self, bufs, page_table, rows, pages, kv_indptr, nnz: int) -> torch.Tensor:
        """The page ids of rows[b]'s first pages[b] pages, concatenated: [nnz] on the device (enqueued, no sync).

        Invalid (row, column) pairs scatter into one trash entry past the end."""
        staged = bufs["staged"]
        width = max(pages, default=0)
        if nnz == 0 or width == 0:
            return staged[:0]
        dev = self.device
        rows_t = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
        counts = torch.tensor(pages, dtype=torch.int64).to(dev, non_blocking=True)
        starts = kv_indptr[:-1].to(torch.int64).to(dev, non_blocking=True)
        cols = torch.arange(width, device=dev)[None, :]  # [1, width]
        dest = torch.where(cols < counts[:, None], starts[:, None] + cols, staged.shape[0] - 1)  # [bs, width]
        staged.scatter_(0, dest.reshape(-1), page_table[rows_t, :width].reshape(-1))
        return staged[:nnz]

    @staticmethod
    def _key(phase: Phase, shape, plan: PrefixPlan) -> tuple:
        """A wrapper's identity: graph-mode wrappers fix their rows and query stride (a graph's kernels keep the
        schedule of the plan they were captured with: adaptive rounds verify trees of several widths at one
        bucket), EXTEND's plain wrapper does not."""
        return phase, shape, None if plan.extend else (plan.rows, plan.q_stride)

    def _wrapper(self, phase: Phase, shape, plan: PrefixPlan):
        key = self._key(phase, shape, plan)
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            bufs, n = self._buffers[phase], plan.rows
            if isinstance(shape, LatentShape):
                graph = dict(use_cuda_graph=True, qo_indptr=bufs["qo_indptr"][:n + 1],
                             kv_indptr=bufs["kv_indptr"][:n + 1], kv_indices=bufs["kv_indices"],
                             kv_len_arr=bufs["kv_lens"][:n]) if not plan.extend else {}
                wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self.float_workspace, **graph)
            elif not plan.extend:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self.float_workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=bufs["qo_indptr"][:n + 1],
                    paged_kv_indptr_buf=bufs["kv_indptr"][:n + 1], paged_kv_indices_buf=bufs["kv_indices"],
                    paged_kv_last_page_len_buf=bufs["last_page_len"][:n], backend=GRAPH_KERNELS)
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.float_workspace, "NHD",
                                                                         backend=EXTEND_KERNELS)
            if not isinstance(shape, LatentShape):  # the MLA wrapper keeps its own int workspace (8 MB)
                if phase not in self._int_workspace:
                    size = EXTEND_INT_WORKSPACE_BYTES if phase == Phase.EXTEND else DECODE_INT_WORKSPACE_BYTES
                    self._int_workspace[phase] = torch.empty(size, dtype=torch.uint8, device=self.device)
                wrapper.reset_workspace_buffer(self.float_workspace, self._int_workspace[phase])
            self._wrappers[key] = wrapper
        return key, wrapper

    def _plan_wrapper(self, phase: Phase, shape, plan: PrefixPlan):
        key, wrapper = self._wrapper(phase, shape, plan)
        fence = self._fences.get(key)
        if fence is not None:
            fence.synchronize()  # the device has read this wrapper's previous schedule from its pinned buffer
        if isinstance(shape, LatentShape):
            wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_lens, shape.num_heads,
                         shape.value_dim, shape.key_dim - shape.value_dim, self.page_size, plan.extend, shape.scale,
                         shape.dtype, shape.dtype)
        else:
            wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len, shape.num_heads,
                         shape.num_kv_heads, shape.head_dim, self.page_size, causal=plan.extend,
                         sm_scale=shape.scale, q_data_type=shape.dtype, kv_data_type=shape.dtype)
        fence = fence or torch.cuda.Event()
        fence.record()
        self._fences[key] = fence
        self._planned[key] = plan
        return wrapper

    def _planned_wrapper(self, batch: ForwardBatch, shape):
        """The wrapper planned for this phase and shape; a shape seen for the first time is planned here, which
        must be outside graph capture (capture warms every phase up eagerly first)."""
        plan = self._plans.get(batch.phase)
        if plan is None or plan.rows != batch.batch_size:
            raise InvariantError(f"{batch.phase.value}: flashinfer forward over {batch.batch_size} rows, but the "
                                 f"phase was planned for {plan.rows if plan else 'nothing'}")
        shapes = self._shapes.setdefault(batch.phase, [])
        key = self._key(batch.phase, shape, plan)
        if shape not in shapes or self._planned.get(key) is not plan:
            if torch.cuda.is_current_stream_capturing():
                raise InvariantError(f"{batch.phase.value}: attention shape {shape} first seen inside a CUDA graph "
                                     f"capture (it must be planned before: warm-up runs eagerly)")
            if shape not in shapes:
                shapes.append(shape)
            return self._plan_wrapper(batch.phase, shape, plan), plan
        return self._wrappers[key], plan

    # --- forward -------------------------------------------------------------------------------------------------
    def forward(self, q, k, v, k_cache, v_cache, scratch_start, batch: ForwardBatch, page_table, scale):
        if batch.num_tokens == 0:
            return torch.empty_like(q)
        store_kv(k, v, k_cache, v_cache, batch.out_slots)
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        shape = Shape(q.shape[1], num_kv_heads, head_dim, float(scale), q.dtype)
        wrapper, plan = self._planned_wrapper(batch, shape)
        paged = (k_cache[:scratch_start].view(-1, self.page_size, num_kv_heads, head_dim),
                 v_cache[:scratch_start].view(-1, self.page_size, num_kv_heads, head_dim))
        q = q.contiguous()
        if batch.phase == Phase.EXTEND:
            return wrapper.run(q, paged)
        o_prefix, lse_prefix = wrapper.run(q, paged, return_lse=True)  # [T, Hq, D], [T, Hq] (log2)
        o_tail, lse_tail = self.tail.attend(q, k_cache, v_cache, scratch_start, batch, page_table, scale,
                                            kv_start=plan.kv_start, return_lse=True)
        return self._merge(batch, o_prefix, lse_prefix, o_tail, lse_tail, q.dtype)

    def forward_latent(self, q, latent, cache, value_dim, scratch_start, batch: ForwardBatch, page_table, scale):
        t, num_heads, key_dim = q.shape
        if t == 0:
            return q.new_empty(0, num_heads, value_dim)
        store_latent(latent, cache, batch.out_slots)
        wrapper, plan = self._planned_wrapper(batch, LatentShape(num_heads, key_dim, value_dim, float(scale), q.dtype))
        pages = cache[:scratch_start].unflatten(0, (-1, self.page_size))  # [pages, page_size, Dk]
        q_nope, q_pe = q[..., :value_dim].contiguous(), q[..., value_dim:].contiguous()
        ckv, kpe = pages[..., :value_dim], pages[..., value_dim:]
        if batch.phase == Phase.EXTEND:
            return wrapper.run(q_nope, q_pe, ckv, kpe)
        o_prefix, lse_prefix = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)  # [T, Hq, Dv], [T, Hq] (log2)
        o_tail, lse_tail = self.tail.attend_latent(q, cache, value_dim, scratch_start, batch, page_table, scale,
                                                   kv_start=plan.kv_start, return_lse=True)
        return self._merge(batch, o_prefix, lse_prefix, o_tail, lse_tail, q.dtype)

    @staticmethod
    def _merge(batch: ForwardBatch, o_prefix, lse_prefix, o_tail, lse_tail, dtype) -> torch.Tensor:
        """The two halves by log-sum-exp; padding tokens get zeros, as the contract says: without scratch (DECODE,
        DRAFT_EXTEND) they are the tokens of kv length 0, which the prefix half (one floor per request) does not
        know; tree phases have padding rows only, whose floor is 0, so both halves are empty (-inf / NaN)."""
        t, heads, dim = o_prefix.shape
        group = _heads_per_merge_row(heads, dim)
        rows = t * heads // group  # merge_state is per (token, head): fold heads into rows to fit its thread block
        out, lse = flashinfer.merge_state(o_prefix.reshape(rows, group, dim), lse_prefix.reshape(rows, group),
                                          o_tail.reshape(rows, group, dim), lse_tail.reshape(rows, group))
        out, lse = out.view(t, heads, dim), lse.view(t, heads)
        if batch.scratch_width == 0:
            seen = (batch.kv_lens > 0)[:, None, None]  # [T, 1, 1]
        else:
            seen = torch.isfinite(lse)[..., None]  # [T, Hq, 1]
        return torch.where(seen, out, 0.0).to(dtype)


@functools.lru_cache(maxsize=None)
def _heads_per_merge_row(heads: int, dim: int) -> int:
    """The most heads one merge_state row may hold: the largest divisor g of `heads` with g x dim within one
    thread block (MERGE_MAX_BLOCK_ELEMENTS). Cached: every layer's forward asks with the same shape."""
    return max(g for g in range(1, heads + 1) if heads % g == 0 and g * dim <= MERGE_MAX_BLOCK_ELEMENTS)
