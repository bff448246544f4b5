"""ForwardBatch: the one description of a forward pass that every phase, backend and execution mode reads.

Attention contract (all phases, all backends). Query token t of a batch:
  * writes its K/V into slot `out_slots[t]` of the pool (a paged slot, a scratch slot, or the dummy page),
  * attends to the paged positions 0 .. kv_lens[t]-1 of page-table row `token_rows[t]`
    (slot = table[row, p // page_size] * page_size + p % page_size),
  * and to scratch entries j of that row's scratch block whose bit j is set in `tree_mask[t]`
    (bit j of word j // 64; scratch slot = pool.scratch_start + row * W + j).
A token that attends to nothing (padding) produces zeros.

Every phase's metadata is produced by one builder (`spruce.runtime.batch_builder`) into persistent buffers
sized by `Limits`; eager execution and CUDA-graph replay read the same buffers (DESIGN §4). A backend derives
whatever else its kernels need from this batch in its `plan` (host side) and `forward` (DESIGN §13).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Phase(enum.Enum):
    EXTEND = "extend"  # prefill (chunked) of the target
    DECODE = "decode"  # one token per request, no speculation
    VERIFY = "verify"  # target over the N-token tree per request
    DRAFT_DECODE = "draft_decode"  # draft over the K frontier tokens per request
    DRAFT_EXTEND = "draft_extend"  # draft over newly committed tokens (prefill or after verify)


@dataclass
class ForwardBatch:
    """Views into persistent buffers for one forward. T = num_tokens, bs = batch_size (padded when graphed)."""

    phase: Phase
    batch_size: int
    num_tokens: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64
    token_rows: torch.Tensor  # [T] int64
    kv_lens: torch.Tensor  # [T] int32
    tree_mask: torch.Tensor  # [T, words] int64
    req_rows: torch.Tensor  # [bs] int64
    qo_indptr: torch.Tensor  # [bs+1] int32
    max_kv_len: int  # host-side upper bound of kv_lens (no device sync needed to read it)
    max_q_len: int  # host-side upper bound of query tokens per request (the stride for uniform phases)
    scratch_width: int  # W of the pool this batch attends to (0: no scratch attended)
    # per request, when the host built the batch (EXTEND): query tokens and the kv length of its last query
    # token; None for the phases built on the device (a backend's plan may read these, never device memory)
    host_q_lens: tuple[int, ...] | None = None
    host_kv_lens: tuple[int, ...] | None = None
    # per request (padding rows included), when the host knows them: its page-table row, and a kv length its
    # tokens all attend to whose pages are final (a decode step: the committed length as of the last resolved
    # step, a lower bound under overlap scheduling; EXTEND: the rows of `extend`). Planning data for library
    # kernels that need host lengths (DESIGN §13); the attention contract itself reads only the device tensors.
    host_rows: tuple[int, ...] | None = None
    host_kv_floor: tuple[int, ...] | None = None

    @property
    def layout(self) -> tuple:
        """The host-side description a backend plans from (DESIGN §13): equal layouts get equal plans."""
        return (self.phase, self.batch_size, self.num_tokens, self.max_q_len, self.max_kv_len, self.scratch_width,
                self.host_q_lens, self.host_kv_lens, self.host_rows, self.host_kv_floor)
