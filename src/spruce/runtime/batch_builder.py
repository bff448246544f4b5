"""The one metadata builder (DESIGN §4): fills persistent, Limits-sized buffers for every phase.

Eager runs and CUDA-graph replays read the very same buffers; graph capture fills them through the same
methods with a dummy batch. Padding requests (graph buckets) and padding tokens (uniform strides) point
at the dummy row / dummy page and attend to nothing. Host-side checks run before every fill and name
every quantity; they never read device memory.
"""

from __future__ import annotations

import torch

from spruce.attention.metadata import ForwardBatch, Phase
from spruce.errors import InvariantError
from spruce.limits import Limits
from spruce.memory.page_table import PageTable


def paged_slots(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot of each position in its row's pages (same shapes as `positions`, rows broadcast against it)."""
    pages = table[rows, torch.div(positions, page_size, rounding_mode="floor")].long()
    return pages * page_size + positions % page_size


class BatchBuilder:
    def __init__(self, limits: Limits, page_table: PageTable, device: torch.device):
        self.limits = limits
        self.table = page_table.table
        self.device = device
        t, r = limits.max_tokens_per_forward, limits.max_running_requests
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(t, **i64)  # [T]
        self.positions = torch.zeros(t, **i64)  # [T]
        self.out_slots = torch.zeros(t, **i64)  # [T]
        self.token_rows = torch.zeros(t, **i64)  # [T]
        self.kv_lens = torch.zeros(t, dtype=torch.int32, device=device)  # [T]
        self.tree_mask = torch.zeros(t, limits.mask_words, **i64)  # [T, words]
        self.req_rows = torch.zeros(r, **i64)  # [R]
        self.qo_indptr = torch.zeros(r + 1, dtype=torch.int32, device=device)  # [R+1]

    # --- checks -------------------------------------------------------------------------------------------
    def _check(self, phase: Phase, bs: int, num_tokens: int, max_kv_len: int) -> None:
        lim = self.limits
        if bs > lim.max_running_requests:
            raise InvariantError(f"{phase.value}: batch size {bs} > max_running_requests {lim.max_running_requests}")
        if num_tokens > lim.max_tokens_per_forward:
            raise InvariantError(
                f"{phase.value}: {num_tokens} tokens > max_tokens_per_forward {lim.max_tokens_per_forward} (bs={bs})"
            )
        cap = lim.max_pages_per_request * lim.page_size
        if max_kv_len > cap:
            raise InvariantError(
                f"{phase.value}: kv length {max_kv_len} > pages per request {lim.max_pages_per_request} x "
                f"page_size {lim.page_size} = {cap}"
            )

    def _view(self, phase, bs, num_tokens, max_kv_len, scratch_width) -> ForwardBatch:
        return ForwardBatch(
            phase=phase, batch_size=bs, num_tokens=num_tokens,
            input_ids=self.input_ids[:num_tokens], positions=self.positions[:num_tokens],
            out_slots=self.out_slots[:num_tokens], token_rows=self.token_rows[:num_tokens],
            kv_lens=self.kv_lens[:num_tokens], tree_mask=self.tree_mask[:num_tokens],
            req_rows=self.req_rows[:bs], qo_indptr=self.qo_indptr[: bs + 1],
            max_kv_len=max_kv_len, scratch_width=scratch_width,
        )

    # --- EXTEND (prefill chunks; variable length per request) ---------------------------------------------
    def extend(self, rows: list[int], starts: list[int], tokens: list[list[int]]) -> ForwardBatch:
        """Tokens[i] go to positions starts[i].. of row rows[i]; causal over the paged cache."""
        bs = len(rows)
        lens = [len(t) for t in tokens]
        n = sum(lens)
        max_kv = max((s + m for s, m in zip(starts, lens)), default=0)
        self._check(Phase.EXTEND, bs, n, max_kv)
        flat_ids = [tok for seq in tokens for tok in seq]
        flat_pos = [s + j for s, m in zip(starts, lens) for j in range(m)]
        flat_rows = [r for r, m in zip(rows, lens) for _ in range(m)]
        indptr = [0]
        for m in lens:
            indptr.append(indptr[-1] + m)
        host = torch.tensor([flat_ids, flat_pos, flat_rows], dtype=torch.int64).reshape(3, n)
        self.input_ids[:n].copy_(host[0])
        self.positions[:n].copy_(host[1])
        self.token_rows[:n].copy_(host[2])
        self.req_rows[:bs].copy_(torch.tensor(rows, dtype=torch.int64))
        self.qo_indptr[: bs + 1].copy_(torch.tensor(indptr, dtype=torch.int32))
        self._fill_paged(n)
        return self._view(Phase.EXTEND, bs, n, max_kv, 0)

    def _fill_paged(self, n: int) -> None:
        """out_slots = the token's own page slot; kv_lens = position + 1 (causal); no scratch."""
        pos = self.positions[:n]
        self.out_slots[:n] = paged_slots(self.table, self.token_rows[:n], pos, self.limits.page_size)
        self.kv_lens[:n] = (pos + 1).to(torch.int32)
        self.tree_mask[:n] = 0

    # --- uniform-stride phases ------------------------------------------------------------------------------
    def _fill_uniform(self, phase: Phase, rows: torch.Tensor, padded_bs: int, stride: int,
                      input_ids: torch.Tensor, positions: torch.Tensor, max_kv_len: int) -> int:
        """Write [bs, stride] tokens of the real requests, then padding up to padded_bs; returns T."""
        bs = rows.shape[0]
        if padded_bs < bs:
            raise InvariantError(f"{phase.value}: padded batch {padded_bs} < real batch {bs}")
        n, n_real = padded_bs * stride, bs * stride
        self._check(phase, padded_bs, n, max_kv_len)
        self.req_rows[:bs] = rows
        self.req_rows[bs:padded_bs] = self.limits.dummy_row
        self.qo_indptr[: padded_bs + 1] = torch.arange(0, n + 1, stride, dtype=torch.int32, device=self.device)
        self.token_rows[:n_real] = rows.repeat_interleave(stride)
        self.token_rows[n_real:n] = self.limits.dummy_row
        self.input_ids[:n_real] = input_ids.reshape(-1)
        self.positions[:n_real] = positions.reshape(-1)
        self.input_ids[n_real:n] = 0
        self.positions[n_real:n] = 0
        self.out_slots[n_real:n] = 0  # the dummy page
        self.kv_lens[n_real:n] = 0
        self.tree_mask[n_real:n] = 0
        return n

    def decode(self, rows: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor,
               padded_bs: int, max_kv_len: int) -> ForwardBatch:
        """One token per request at `positions` (written to its page slot, attends to 0..position)."""
        n = self._fill_uniform(Phase.DECODE, rows, padded_bs, 1, input_ids, positions, max_kv_len)
        n_real = rows.shape[0]
        self._fill_paged(n_real)
        return self._view(Phase.DECODE, padded_bs, n, max_kv_len, 0)

    def scratch_phase(self, phase: Phase, rows: torch.Tensor, committed: torch.Tensor, input_ids: torch.Tensor,
                      depths: torch.Tensor, masks: torch.Tensor, scratch_offset: int, scratch_start: int,
                      scratch_width: int, padded_bs: int, max_kv_len: int) -> ForwardBatch:
        """VERIFY / DRAFT_DECODE: tokens [bs, n] at positions committed + depths [bs, n]; token i of a row
        writes its K/V into scratch entry scratch_offset + i and attends to the committed pages
        (kv_len = committed) and to the scratch entries set in `masks` [bs, n, words]."""
        bs, n_per = input_ids.shape
        if scratch_offset + n_per > scratch_width:
            raise InvariantError(
                f"{phase.value}: scratch entries [{scratch_offset}, {scratch_offset + n_per}) exceed scratch width "
                f"{scratch_width} (N={self.limits.num_draft_tokens}, K={self.limits.eagle_topk}, "
                f"S={self.limits.num_steps}, bs={bs})"
            )
        if masks.shape[-1] > self.limits.mask_words:
            raise InvariantError(f"{phase.value}: {masks.shape[-1]} mask words > {self.limits.mask_words}")
        positions = committed[:, None] + depths  # [bs, n]
        n = self._fill_uniform(phase, rows, padded_bs, n_per, input_ids, positions, max_kv_len)
        n_real = bs * n_per
        entry = scratch_offset + torch.arange(n_per, device=self.device)[None, :]  # [1, n]
        self.out_slots[:n_real] = (scratch_start + rows[:, None] * scratch_width + entry).reshape(-1)
        self.kv_lens[:n_real] = committed.to(torch.int32).repeat_interleave(n_per)
        words = masks.shape[-1]
        self.tree_mask[:n_real, :words] = masks.reshape(n_real, words)
        self.tree_mask[:n_real, words:] = 0
        return self._view(phase, padded_bs, n, max_kv_len, scratch_width)

    def draft_extend(self, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                     input_ids: torch.Tensor, padded_bs: int, max_kv_len: int) -> ForwardBatch:
        """Uniform stride S+1 per request: tokens [bs, S+1] at positions starts+i for i < counts, padding after.

        Used for the draft's extend after verify (counts = accepted + 1); capture and replay use the same
        stride, so a graph never sees a different layout from the eager path.
        """
        stride = self.limits.draft_extend_stride
        bs = rows.shape[0]
        if input_ids.shape[1] != stride:
            raise InvariantError(f"draft_extend: token stride {input_ids.shape[1]} != S+1 = {stride}")
        i = torch.arange(stride, device=self.device)[None, :]
        positions = starts[:, None] + i  # [bs, S+1]
        n = self._fill_uniform(Phase.DRAFT_EXTEND, rows, padded_bs, stride, input_ids, positions, max_kv_len)
        n_real = bs * stride
        real = (i < counts[:, None]).reshape(-1)  # [bs*(S+1)]
        self._fill_paged(n_real)
        self.out_slots[:n_real] = torch.where(real, self.out_slots[:n_real], 0)
        self.kv_lens[:n_real] = torch.where(real, self.kv_lens[:n_real], 0)
        return self._view(Phase.DRAFT_EXTEND, padded_bs, n, max_kv_len, 0)
