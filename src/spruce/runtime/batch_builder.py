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
from spruce.ops.metadata import fill_scratch_metadata, fill_uniform_metadata
from spruce.ops.triton_support import HAS_TRITON


def paged_slots(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot of each position in its row's pages (same shapes as `positions`, rows broadcast against it)."""
    pages = table[rows, torch.div(positions, page_size, rounding_mode="floor")].long()
    return pages * page_size + positions % page_size


class BatchBuilder:
    def __init__(self, limits: Limits, page_table: PageTable, device: torch.device):
        self.limits = limits
        self.page_table = page_table  # its device table (uniform fills' slots) and its host pages (`extend`'s)
        self.device = device
        t, r = limits.max_tokens_per_forward, limits.max_running_requests
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(t, **i64)  # [T]
        self.positions = torch.zeros(t, **i64)  # [T]
        self.out_slots = torch.zeros(t, **i64)  # [T]
        self.token_rows = torch.zeros(t, **i64)  # [T]
        self.kv_lens = torch.zeros(t, dtype=torch.int32, device=device)  # [T]
        self.tree_mask = torch.zeros(t, limits.mask_words, **i64)  # [T, words]
        # one more request than rows: a padded prefill's padding request (Limits.prefill_graph_rows)
        self.req_rows = torch.zeros(r + 1, **i64)  # [R+1]
        self.qo_indptr = torch.zeros(r + 2, dtype=torch.int32, device=device)  # [R+2]
        # one-launch Triton fill of scratch phases (same values as torch) where Triton can run it
        self.fused = device.type == "cuda" and HAS_TRITON
        self._known: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # set_known_prefix
        self._uniform_views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (T, bs) -> _slices (_view)

    def set_known_prefix(self, rows: list[int] | None, floors: list[int] | None) -> None:
        """The host's view of the next decode step's requests: page-table rows and, per request, a committed
        length whose pages are final (<= what the device holds). Every uniform-phase batch carries them (padded
        with the dummy row and 0) as `host_rows` / `host_kv_floor` until the next call; None forgets them."""
        if rows is None:
            self._known = None
            return
        if floors is None or len(floors) != len(rows):
            raise InvariantError(f"set_known_prefix: {len(rows)} rows but floors {floors!r}")
        self._known = (tuple(rows), tuple(floors))

    def _known_for(self, phase: Phase, bs: int) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        if self._known is None:
            return None, None
        rows, floors = self._known
        if len(rows) > bs:
            raise InvariantError(f"{phase.value}: batch of {bs} rows, but the step's known prefix lists "
                                 f"{len(rows)} requests")
        pad = bs - len(rows)
        return rows + (self.limits.dummy_row,) * pad, floors + (0,) * pad

    # --- checks -------------------------------------------------------------------------------------------
    def _check(self, phase: Phase, bs: int, num_tokens: int, max_kv_len: int) -> None:
        lim = self.limits
        if bs > lim.max_running_requests:
            raise InvariantError(f"{phase.value}: batch size {bs} > max_running_requests {lim.max_running_requests}")
        if num_tokens > lim.max_tokens_per_forward:
            raise InvariantError(
                f"{phase.value}: {num_tokens} tokens > max_tokens_per_forward {lim.max_tokens_per_forward} (bs={bs})"
            )
        if max_kv_len > lim.kv_capacity:
            raise InvariantError(
                f"{phase.value}: kv length {max_kv_len} > pages per request {lim.max_pages_per_request} x "
                f"page_size {lim.page_size} = {lim.kv_capacity}"
            )

    def _slices(self, num_tokens: int, bs: int) -> dict[str, torch.Tensor]:
        """The buffers' leading views a batch of `num_tokens` tokens over `bs` requests reads, by ForwardBatch
        field."""
        return dict(input_ids=self.input_ids[:num_tokens], positions=self.positions[:num_tokens],
                    out_slots=self.out_slots[:num_tokens], token_rows=self.token_rows[:num_tokens],
                    kv_lens=self.kv_lens[:num_tokens], tree_mask=self.tree_mask[:num_tokens],
                    req_rows=self.req_rows[:bs], qo_indptr=self.qo_indptr[: bs + 1])

    def _view(self, phase, bs, num_tokens, max_kv_len, scratch_width, max_q_len=None,
              host_lens=None) -> ForwardBatch:
        q_lens, kv_lens, rows = host_lens if host_lens is not None else (None, None, None)
        floors = None  # EXTEND: host_kv_lens are its exact lengths
        if phase == Phase.EXTEND:
            views = self._slices(num_tokens, bs)
        else:  # a uniform phase: few (T, bs) pairs, each step's; eight slices cost ~25 us of host a batch (H200)
            rows, floors = self._known_for(phase, bs)
            views = self._uniform_views.get((num_tokens, bs))
            if views is None:
                views = self._uniform_views[(num_tokens, bs)] = self._slices(num_tokens, bs)
        return ForwardBatch(
            phase=phase, batch_size=bs, num_tokens=num_tokens, **views,
            max_kv_len=max_kv_len, scratch_width=scratch_width,
            max_q_len=max_q_len if max_q_len is not None else (num_tokens // bs if bs else 0),
            host_q_lens=q_lens, host_kv_lens=kv_lens, host_rows=rows, host_kv_floor=floors,
        )

    def describe(self, phase: Phase, bs: int, stride: int, max_kv_len: int, scratch_width: int) -> ForwardBatch:
        """The batch a uniform-stride phase of `bs` rows will build, as a backend's plan sees it before the
        phase runs (DESIGN §13): its host fields are final, its device buffers not yet filled."""
        return self._view(phase, bs, bs * stride, max_kv_len, scratch_width)

    # --- EXTEND (prefill chunks; variable length per request) ---------------------------------------------
    def extend(self, rows: list[int], starts: list[int], tokens: list[list[int]],
               pad_to: int | None = None) -> ForwardBatch:
        """Tokens[i] go to positions starts[i].. of row rows[i]; causal over the paged cache.

        pad_to: fill a padded batch of that many tokens instead (a prefill graph's bucket: `padded_extend`),
        whose last request (the dummy row) owns the padding tokens; they write the dummy page and attend to
        nothing. Returns the batch to run (the padded one when padding)."""
        bs = len(rows)
        lens = [len(t) for t in tokens]
        n = sum(lens)
        max_kv = max((s + m for s, m in zip(starts, lens)), default=0)
        self._check(Phase.EXTEND, bs, n, max_kv)
        dummy = self.limits.dummy_row
        flat_ids = [tok for seq in tokens for tok in seq]
        flat_pos = [s + j for s, m in zip(starts, lens) for j in range(m)]
        flat_rows = [r for r, m in zip(rows, lens) for _ in range(m)]
        # each token's page slot and kv length (causal: position + 1), made on the host, where the pages are known:
        # as device work (`_fill_paged`, `_mask_padding`) they were a dozen small launches a prefill
        flat_slots, flat_kv = [], []
        masked = pad_to is not None  # a padded batch's dummy-row tokens write the dummy page, attend to nothing
        for r, s, m in zip(rows, starts, lens):
            if masked and r == dummy:
                flat_slots += [0] * m
                flat_kv += [0] * m
            else:
                flat_slots += self.page_table.slots(r, s, m)
                flat_kv += range(s + 1, s + m + 1)
        indptr = [0]
        for m in lens:
            indptr.append(indptr[-1] + m)
        if pad_to is not None:  # then the padding request(s), every one past the first empty
            padded_bs = self._check_padding(bs, n, pad_to)
            pad = pad_to - n
            for flat, value in ((flat_ids, 0), (flat_pos, 0), (flat_rows, dummy), (flat_slots, 0), (flat_kv, 0)):
                flat += [value] * pad
            rows = [*rows, *[dummy] * (padded_bs - bs)]
            indptr += [pad_to] * (padded_bs - bs)
        total = len(flat_ids)
        # non_blocking: copies from pageable host memory are staged at once and never wait for the device,
        # so a prefill can be queued behind a step still running (overlap scheduling)
        host = torch.tensor([flat_ids, flat_pos, flat_rows, flat_slots, flat_kv], dtype=torch.int64).reshape(5, total)
        self.input_ids[:total].copy_(host[0], non_blocking=True)
        self.positions[:total].copy_(host[1], non_blocking=True)
        self.token_rows[:total].copy_(host[2], non_blocking=True)
        self.out_slots[:total].copy_(host[3], non_blocking=True)
        self.kv_lens[:total].copy_(host[4].to(torch.int32), non_blocking=True)
        self.tree_mask[:total] = 0
        self.req_rows[: len(rows)].copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
        self.qo_indptr[: len(rows) + 1].copy_(torch.tensor(indptr, dtype=torch.int32), non_blocking=True)
        if pad_to is not None:
            return self.padded_extend(pad_to, self.limits.kv_capacity)
        return self._view(Phase.EXTEND, bs, n, max_kv, 0, max(lens, default=0),
                          (tuple(lens), tuple(s + m for s, m in zip(starts, lens)), tuple(rows)))

    def _check_padding(self, bs: int, num_tokens: int, pad_to: int) -> int:
        """Requests of a batch of `bs` requests and `num_tokens` tokens padded to `pad_to` tokens."""
        padded_bs = self.limits.prefill_graph_rows(pad_to)
        if num_tokens > pad_to or bs >= padded_bs:
            raise InvariantError(f"extend: {bs} requests of {num_tokens} tokens do not fit a padded batch of "
                                 f"{pad_to} tokens and {padded_bs} requests (one of them the padding request)")
        return padded_bs

    def padded_extend(self, num_tokens: int, max_kv_len: int) -> ForwardBatch:
        """The padded EXTEND batch of `num_tokens` tokens (a prefill graph's bucket) that `extend(pad_to=...)`
        fills: Limits.prefill_graph_rows requests, each up to all the tokens long, no host lengths (a graph
        serves every batch that fits). Its layout is the same for every fill, so one plan serves them all."""
        bs = self.limits.prefill_graph_rows(num_tokens)
        self._check(Phase.EXTEND, bs - 1, num_tokens, max_kv_len)  # the real requests it holds at most
        return self._view(Phase.EXTEND, bs, num_tokens, max_kv_len, 0, num_tokens)

    def _fill_paged(self, n: int) -> None:
        """out_slots = the token's own page slot; kv_lens = position + 1 (causal); no scratch."""
        pos = self.positions[:n]
        self.out_slots[:n] = paged_slots(self.page_table.table, self.token_rows[:n], pos, self.limits.page_size)
        self.kv_lens[:n] = (pos + 1).to(torch.int32)
        self.tree_mask[:n] = 0

    # --- uniform-stride phases ------------------------------------------------------------------------------
    # Rows equal to the dummy row are padding (graph buckets): after every fill, `_mask_padding` makes their
    # tokens write to the dummy page and attend to nothing. The rule is on the device, so a graph captured
    # for a bucket of P requests serves any real batch <= P with no host-side knowledge of the real size.
    def _fill_uniform(self, phase: Phase, rows: torch.Tensor, stride: int, input_ids: torch.Tensor,
                      positions: torch.Tensor, max_kv_len: int) -> int:
        """Write [P, stride] tokens (P = rows.shape[0], padding rows included); returns T = P * stride."""
        bs = rows.shape[0]
        n = bs * stride
        self._check(phase, bs, n, max_kv_len)
        self.req_rows[:bs] = rows
        self.qo_indptr[: bs + 1] = torch.arange(0, n + 1, stride, dtype=torch.int32, device=self.device)
        self.token_rows[:n] = rows.repeat_interleave(stride)
        self.input_ids[:n] = input_ids.reshape(-1)
        self.positions[:n] = positions.reshape(-1)
        return n

    def _mask_padding(self, n: int) -> None:
        pad = self.token_rows[:n] == self.limits.dummy_row
        self.out_slots[:n].masked_fill_(pad, 0)
        self.kv_lens[:n].masked_fill_(pad, 0)
        self.tree_mask[:n].masked_fill_(pad[:, None], 0)

    def _fused_paged(self, phase: Phase, rows: torch.Tensor, starts: torch.Tensor, input_ids: torch.Tensor,
                     counts: torch.Tensor | None, max_kv_len: int) -> ForwardBatch:
        """A paged uniform phase (DECODE, DRAFT_EXTEND) filled by the one-launch kernel (ops/metadata.py): input_ids
        [P, stride] at positions starts[b] + i, only the first counts[b] of a row real (None: all)."""
        bs, stride = input_ids.shape
        self._check(phase, bs, bs * stride, max_kv_len)
        fill_uniform_metadata(self, rows, starts, input_ids, counts)
        return self._view(phase, bs, bs * stride, max_kv_len, 0)

    def decode(self, rows: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor,
               max_kv_len: int) -> ForwardBatch:
        """One token per request at `positions` (written to its page slot, attends to 0..position)."""
        if self.fused and rows.shape[0]:
            return self._fused_paged(Phase.DECODE, rows, positions, input_ids[:, None], None, max_kv_len)
        n = self._fill_uniform(Phase.DECODE, rows, 1, input_ids, positions, max_kv_len)
        self._fill_paged(n)
        self._mask_padding(n)
        return self._view(Phase.DECODE, rows.shape[0], n, max_kv_len, 0)

    def scratch_phase(self, phase: Phase, rows: torch.Tensor, committed: torch.Tensor, input_ids: torch.Tensor,
                      depths: torch.Tensor, masks: torch.Tensor, scratch_offset: int, scratch_start: int,
                      scratch_width: int, max_kv_len: int) -> ForwardBatch:
        """VERIFY / DRAFT_DECODE: tokens [P, n] at positions committed + depths [P, n]; token i of a row
        writes its K/V into scratch entry scratch_offset + i and attends to the committed pages
        (kv_len = committed) and to the scratch entries set in `masks` [P, n, words]."""
        bs, n_per = input_ids.shape
        if scratch_offset + n_per > scratch_width:
            raise InvariantError(
                f"{phase.value}: scratch entries [{scratch_offset}, {scratch_offset + n_per}) exceed scratch width "
                f"{scratch_width} (N={self.limits.num_draft_tokens}, K={self.limits.eagle_topk}, "
                f"S={self.limits.num_steps}, bs={bs})"
            )
        if masks.shape[-1] > self.limits.mask_words:
            raise InvariantError(f"{phase.value}: {masks.shape[-1]} mask words > {self.limits.mask_words}")
        if self.fused and bs:
            self._check(phase, bs, bs * n_per, max_kv_len)
            fill_scratch_metadata(self, rows, committed, input_ids, depths, masks, scratch_offset, scratch_start,
                                  scratch_width)
            return self._view(phase, bs, bs * n_per, max_kv_len, scratch_width)
        n = self._fill_uniform(phase, rows, n_per, input_ids, committed[:, None] + depths, max_kv_len)
        entry = scratch_offset + torch.arange(n_per, device=self.device)[None, :]  # [1, n]
        self.out_slots[:n] = (scratch_start + rows[:, None] * scratch_width + entry).reshape(-1)
        self.kv_lens[:n] = committed.to(torch.int32).repeat_interleave(n_per)
        words = masks.shape[-1]
        self.tree_mask[:n, :words] = masks.reshape(n, words)
        self.tree_mask[:n, words:] = 0
        self._mask_padding(n)
        return self._view(phase, bs, n, max_kv_len, scratch_width)

    def draft_extend(self, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                     input_ids: torch.Tensor, max_kv_len: int) -> ForwardBatch:
        """Uniform stride S+1 per request: tokens [P, S+1] at positions starts+i for i < counts, padding after.

        Used for the draft's extend after verify (counts = accepted + 1); capture and replay use the same
        stride, so a graph never sees a different layout from the eager path.
        """
        stride = self.limits.draft_extend_stride
        if input_ids.shape[1] != stride:
            raise InvariantError(f"draft_extend: token stride {input_ids.shape[1]} != the Limits stride {stride} "
                                 f"(S+1 = {self.limits.num_steps + 1}, N = {self.limits.num_draft_tokens})")
        if self.fused and rows.shape[0]:
            return self._fused_paged(Phase.DRAFT_EXTEND, rows, starts, input_ids, counts, max_kv_len)
        i = torch.arange(stride, device=self.device)[None, :]
        n = self._fill_uniform(Phase.DRAFT_EXTEND, rows, stride, input_ids, starts[:, None] + i, max_kv_len)
        real = (i < counts[:, None]).reshape(-1)  # [P*(S+1)]
        self._fill_paged(n)
        self.out_slots[:n].masked_fill_(~real, 0)
        self.kv_lens[:n].masked_fill_(~real, 0)
        self._mask_padding(n)
        return self._view(Phase.DRAFT_EXTEND, rows.shape[0], n, max_kv_len, 0)
