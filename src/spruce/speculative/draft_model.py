"""Speculation with a separate small causal LM as the draft (STANDALONE; vLLM's `draft_model`): the EAGLE round
(speculative/eagle_worker.py: draft -> tree -> verify -> accept -> commit -> draft extend) with a draft that reads
tokens only (models/standalone.py). The tree, verify, scratch, commit, sampling, grammar, logprob and graph machinery
is the EAGLE worker's; what differs is where the draft's tokens sit.

An EAGLE head's KV slot p pairs the target's feature at p with the token at p+1. A draft LM caches the token at
position p at p, as the target does, and one position further: its KV holds the next round's root (the last
committed token, at position `committed`), whose hidden gave the stored step-0 top-K (Limits.draft_ahead = 1, so
pages and the draft extend's stride cover that one more position). E.g. committed 10, root r: the draft KV holds
positions 0..10; step j of the draft loop runs the K frontier nodes of depth j at position 10 + j over positions
0..10 and their scratch ancestors; after a round accepting a = 2 drafts d1, d2 with bonus b, the draft extend runs
r, d1, d2, b at 10..13 (the draft KV then holds only accepted tokens), b's hidden gives the next top-K, and
committed becomes 13.
"""

from __future__ import annotations

import itertools

import torch

from spruce.runtime.strategy import PrefillChunk
from spruce.speculative.eagle_worker import EagleWorker, Verified
from spruce.speculative.tree import DraftCandidates


class DraftModelWorker(EagleWorker):
    """The EAGLE round over a draft LM (module docstring)."""

    def wants_prefill_features(self, chunks: list[PrefillChunk]) -> bool:
        return False  # the draft reads tokens only

    def extend_draft(self, chunks: list[PrefillChunk], features: torch.Tensor | None, ends: list[int],
                     finals: list[int], new_tokens: torch.Tensor) -> None:
        """The draft over the prefilled chunks' own tokens at their positions; a final chunk's also over the token
        sampled after the prompt (`new_tokens`, on the device) at the prompt's length, whose hidden gives the
        request's step-0 top-K."""
        r = self.runner
        tokens = [c.tokens + [0] * c.final for c in chunks]
        stops = list(itertools.accumulate(len(t) for t in tokens))  # each chunk's draft tokens end here
        last = None
        if finals:
            last = torch.tensor([stops[i] - 1 for i in finals], dtype=torch.int64).to(r.device, non_blocking=True)
        no_features = torch.empty(stops[-1], 0, dtype=r.dtype, device=r.device)  # [T, 0]
        h = r.draft_extend_forward([c.row for c in chunks], [c.start for c in chunks], tokens, no_features,
                                   (last, new_tokens) if finals else None)  # [T, Hd]
        if finals:
            rows = torch.tensor([chunks[i].row for i in finals], dtype=torch.int64).to(r.device, non_blocking=True)
            self.store_step0(rows, h[last])

    def _draft(self, rows: torch.Tensor, committed: torch.Tensor, max_kv: int) -> DraftCandidates:
        """The EAGLE draft loop one position on: a depth-j node sits at committed + j and sees the draft KV up to
        and including the root (committed + 1 positions)."""
        return super()._draft(rows, committed + 1, max_kv)

    def _extend_draft_after_verify(self, P: int, max_kv: int, verified: Verified, next_tokens: torch.Tensor) -> None:
        """The draft over the root, the accepted drafts and the bonus at committed .. committed + accept_len + 1;
        the bonus's hidden gives the step-0 top-K. next_tokens [P, S+1]: the accepted drafts, then the bonus at
        column accept_len (padding after)."""
        r, rows, committed, accept_lens = self.runner, self.rows[:P], self.committed[:P], self.accept_lens[:P]
        tokens = torch.cat([verified.tree.tokens[:P, :1], next_tokens], dim=1)  # [P, S+2]: the root first
        ext = r.builder.draft_extend(rows, committed, accept_lens + 2, tokens, max_kv)
        h = r.draft_forward(ext, None)  # [P*(S+2), Hd]
        hd = h.shape[-1]
        bonus_hidden = h.view(P, r.limits.draft_extend_stride, hd).gather(1, (accept_lens + 1)[:, None, None].expand(-1, 1, hd))
        self.store_step0(rows, bonus_hidden[:, 0])
