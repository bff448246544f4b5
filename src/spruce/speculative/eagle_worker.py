"""One EAGLE speculative round per decode step (DESIGN §1): draft -> tree -> verify -> accept -> commit ->
draft extend.

The round is three graph-capturable phases over static, Limits-sized buffers (rows past the real batch
hold the dummy row): DRAFT_DECODE (all S-1 draft steps + tree build), VERIFY (target forward over the
tree + logits) and DRAFT_EXTEND (commit of the accepted path + draft extend + next step-0 top-K). Token
selection and acceptance run eagerly between VERIFY and DRAFT_EXTEND. Nothing in a round syncs with the
host until the accepted tokens are read back at its end. The same phase functions run eagerly or under
CUDA graphs (runtime/cuda_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.attention.metadata import Phase
from spruce.errors import ConfigError
from spruce.ops import topk_small
from spruce.runtime.batch_builder import paged_slots
from spruce.runtime.model_runner import ModelRunner
from spruce.runtime.sampler import SamplingTensors, select_tokens
from spruce.speculative.tree import DraftCandidates, Tree, build_tree, own_bits
from spruce.speculative.verify import accept


@dataclass
class RoundResult:
    accept_lens: list[int]  # per request: accepted draft tokens (bonus excluded)
    new_tokens: list[list[int]]  # per request: accepted tokens + bonus (committed by this round)


class EagleWorker:
    def __init__(self, runner: ModelRunner, debug: bool = False):
        self.runner = runner
        self.debug = debug
        lim = runner.limits
        self.K, self.S, self.N = lim.eagle_topk, lim.num_steps, lim.num_draft_tokens
        draft = runner.draft
        if self.K > draft.draft_vocab_size:
            raise ConfigError(f"speculative_eagle_topk={self.K} exceeds the draft vocabulary {draft.draft_vocab_size}")
        dev, rows, r = runner.device, lim.num_rows, lim.max_running_requests
        i64 = dict(dtype=torch.int64, device=dev)
        # draft state carried between rounds, per page-table row
        self.topk_p = torch.zeros(rows, self.K, dtype=torch.float32, device=dev)  # [rows, K]
        self.topk_ids = torch.zeros(rows, self.K, **i64)  # [rows, K]
        self.hidden = torch.zeros(rows, draft.hidden_size, dtype=runner.dtype, device=dev)  # [rows, Hd]
        # static inputs of a round (padding rows = dummy row)
        self.rows = torch.full((r,), lim.dummy_row, **i64)  # [R]
        self.committed = torch.zeros(r, **i64)  # [R]
        self.roots = torch.zeros(r, **i64)  # [R]
        self.accept_lens = torch.zeros(r, **i64)  # [R]
        self.path = torch.zeros(r, self.S + 1, **i64)  # [R, S+1]
        self.bonus = torch.zeros(r, **i64)  # [R]
        self._tree: Tree | None = None
        self._verify_out: tuple[torch.Tensor, torch.Tensor] | None = None

    # --- draft state after an extend ------------------------------------------------------------------------
    def _store_step0(self, rows: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """From the draft's hidden at each request's last committed position: top-K for the next round."""
        p, ids = topk_small(self.runner.draft.compute_logits(last_hidden).softmax(dim=-1), self.K)  # [bs, K]
        self.topk_p[rows] = p
        self.topk_ids[rows] = self.runner.draft.draft_to_target(ids)
        self.hidden[rows] = last_hidden.to(self.hidden.dtype)

    def prefill_extend(self, rows: list[int], starts: list[int], next_tokens: list[list[int]],
                       features: torch.Tensor, finals: list[bool]) -> None:
        """Draft extend over a prefill chunk: pairs (target feature at p, token at p+1) for the chunk's p.

        features [T, F] are the target's, in the chunk's token order. Requests whose prompt is now complete
        (finals) get their step-0 top-K.
        """
        r = self.runner
        batch = r.builder.extend(rows, starts, next_tokens)
        h = r.draft_forward(batch, features)  # [T, Hd]
        ends, acc = [], 0
        for t in next_tokens:
            acc += len(t)
            ends.append(acc - 1)  # each request's last token
        sel = [i for i, f in enumerate(finals) if f]
        if sel:
            self._store_step0(torch.tensor([rows[i] for i in sel], device=r.device),
                              h[torch.tensor([ends[i] for i in sel], device=r.device)])

    # --- the round -------------------------------------------------------------------------------------------
    def round(self, reqs, sampling: SamplingTensors) -> RoundResult:
        r = self.runner
        bs = len(reqs)
        graphs = r.graphs
        pad = graphs.padded_size(bs)
        for q in reqs:  # always-on host check: the pages cover every position commit/extend may write
            r.page_table.check_covers(q.row, q.committed + self.S + 1, f"commit of request {q.request_id}")
        self._fill_inputs(reqs, pad)
        max_kv = max(q.committed for q in reqs) + self.S + 1

        timer = r.timer
        with timer.phase("draft"):
            self._tree = graphs.run("draft", self._draft_phase, bs, max_kv)
        with timer.phase("verify"):
            self._verify_out = graphs.run("verify", self._verify_phase, bs, max_kv)
        with timer.phase("accept"):
            logits, _ = self._verify_out
            tree = self._tree
            n = bs * self.N
            positions = (self.committed[:bs, None] + tree.depths[:bs] + 1).reshape(-1)  # each node's successor
            nodes = torch.arange(self.N, device=r.device).repeat(bs)
            target_tokens = select_tokens(logits[:n], sampling, positions, nodes).view(bs, self.N)
            acc = accept(_slice_tree(tree, bs), target_tokens, self.S)
            self.accept_lens[:bs] = acc.accept_lens
            self.path[:bs] = acc.path
            self.bonus[:bs] = acc.bonus
        with timer.phase("extend"):
            next_tokens = graphs.run("extend", self._extend_phase, bs, max_kv)
        with timer.phase("sync"):
            lens = acc.accept_lens.tolist()  # the round's one host sync
            toks = next_tokens[:bs].tolist()
        return RoundResult(accept_lens=lens, new_tokens=[t[: a + 1] for t, a in zip(toks, lens)])

    def _fill_inputs(self, reqs, pad: int) -> None:
        dev = self.runner.device
        bs = len(reqs)
        host = torch.tensor([[q.row for q in reqs], [q.committed for q in reqs], [q.token_ids[-1] for q in reqs]],
                            dtype=torch.int64)
        self.rows[:bs].copy_(host[0].to(dev, non_blocking=True))
        self.committed[:bs].copy_(host[1].to(dev, non_blocking=True))
        self.roots[:bs].copy_(host[2].to(dev, non_blocking=True))
        self.prepare_padding(bs, pad)

    def prepare_padding(self, start: int, stop: int) -> None:
        """Rows [start, stop) become padding (dummy row, committed 0); used for real batches and capture."""
        self.rows[start:stop] = self.runner.limits.dummy_row
        self.committed[start:stop] = 0
        self.roots[start:stop] = 0
        self.accept_lens[start:stop] = 0
        self.path[start:stop] = 0
        self.bonus[start:stop] = 0

    # --- phases (graph-capturable: device work only, static inputs) ----------------------------------------------
    def _draft_phase(self, P: int, max_kv: int) -> Tree:
        cands = self._draft(self.rows[:P], self.committed[:P], max_kv)
        lim = self.runner.limits
        self._tree = build_tree(cands, self.roots[:P], self.N, lim.mask_words, self.S, debug=self.debug)
        return self._tree

    def _verify_phase(self, P: int, max_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        r, lim, tree = self.runner, self.runner.limits, self._tree
        batch = r.builder.scratch_phase(Phase.VERIFY, self.rows[:P], self.committed[:P], tree.tokens, tree.depths,
                                        tree.masks, 0, r.target_kv.scratch_start, lim.target_scratch_width, max_kv)
        hidden, aux = r.target_forward(batch)
        self._verify_out = (r.target.compute_logits(hidden), r.target_features(hidden, aux))  # [P*N, V], [P*N, F]
        return self._verify_out

    def _extend_phase(self, P: int, max_kv: int) -> torch.Tensor:
        """Commit the accepted path's target KV, then run the draft over it; returns next tokens [P, S+1]."""
        r, lim, tree = self.runner, self.runner.limits, self._tree
        rows, committed = self.rows[:P], self.committed[:P]
        accept_lens, path, bonus = self.accept_lens[:P], self.path[:P], self.bonus[:P]
        steps = torch.arange(self.S + 1, device=r.device)[None, :]  # [1, S+1]
        real = steps <= accept_lens[:, None]  # [P, S+1] the root and the accepted nodes
        src = r.target_kv.scratch_start + rows[:, None] * lim.target_scratch_width + path  # [P, S+1]
        dst = torch.where(real, paged_slots(r.page_table.table, rows[:, None], committed[:, None] + steps,
                                            lim.page_size), 0)
        r.target_kv.copy_slots(src.reshape(-1), dst.reshape(-1))

        feats = self._verify_out[1].view(P, self.N, -1)
        path_feats = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))  # [P, S+1, F]
        path_tokens = tree.tokens.gather(1, path)  # [P, S+1]
        next_tokens = torch.cat([path_tokens[:, 1:], bonus[:, None]], dim=1)  # token at p+1 for each p
        next_tokens = torch.where(steps == accept_lens[:, None], bonus[:, None], next_tokens)
        ext = r.builder.draft_extend(rows, committed, accept_lens + 1, next_tokens, max_kv)
        h = r.draft_forward(ext, path_feats.reshape(P * (self.S + 1), -1))  # [P*(S+1), Hd]
        last = h.view(P, self.S + 1, -1).gather(1, accept_lens[:, None, None].expand(-1, 1, h.shape[-1]))
        self._store_step0(rows, last[:, 0])
        return next_tokens

    def _draft(self, rows: torch.Tensor, committed: torch.Tensor, max_kv: int) -> DraftCandidates:
        """S steps of top-K expansion. Step 0 is the stored top-K; step j runs the draft on the K frontier
        nodes (depth j, draft position committed + j - 1) and keeps the best K of their K*K children."""
        r, lim = self.runner, self.runner.limits
        K, S = self.K, self.S
        bs = rows.shape[0]
        dev = r.device
        words = lim.mask_words
        f_tokens = self.topk_ids[rows]  # [bs, K]
        f_scores = self.topk_p[rows]  # [bs, K]
        f_cand = torch.arange(K, device=dev)[None, :].expand(bs, K)  # candidate index of each frontier node
        f_hidden = self.hidden[rows][:, None, :].expand(bs, K, -1)  # [bs, K, Hd] feature feeding each node
        f_masks = torch.zeros(bs, K, words, dtype=torch.int64, device=dev)  # ancestors in draft scratch
        tokens, scores = [f_tokens], [f_scores]
        parents = [torch.full((bs, K), -1, dtype=torch.int64, device=dev)]
        depths = [torch.ones(bs, K, dtype=torch.int64, device=dev)]
        offset = K
        for j in range(1, S):
            masks = f_masks | own_bits(K, words, dev, offset=(j - 1) * K)[None]
            batch = r.builder.scratch_phase(
                Phase.DRAFT_DECODE, rows, committed, f_tokens, torch.full((bs, K), j - 1, device=dev), masks,
                (j - 1) * K, r.draft_kv.scratch_start, lim.draft_scratch_width, max_kv)
            h = r.draft_forward(batch, f_hidden.reshape(bs * K, -1))  # [bs*K, Hd]
            p, ids = topk_small(r.draft.compute_logits(h).softmax(dim=-1), K)  # [bs*K, K]
            child_tokens = r.draft.draft_to_target(ids).view(bs, K * K)
            child_scores = (f_scores[:, :, None] * p.view(bs, K, K)).view(bs, K * K)
            tokens.append(child_tokens)
            scores.append(child_scores)
            parents.append(f_cand[:, :, None].expand(bs, K, K).reshape(bs, K * K))
            depths.append(torch.full((bs, K * K), j + 1, dtype=torch.int64, device=dev))
            f_scores, best = child_scores.topk(K, dim=-1)  # [bs, K] new frontier
            slot = best // K  # which frontier node each new one came from
            f_tokens = child_tokens.gather(1, best)
            f_cand = offset + best
            f_hidden = h.view(bs, K, -1).gather(1, slot[:, :, None].expand(-1, -1, h.shape[-1]))
            f_masks = masks.gather(1, slot[:, :, None].expand(-1, -1, words))
            offset += K * K
        return DraftCandidates(tokens=torch.cat(tokens, 1), parents=torch.cat(parents, 1),
                               scores=torch.cat(scores, 1), depths=torch.cat(depths, 1))

    # --- graphs -------------------------------------------------------------------------------------------------
    def capture_graphs(self, show_progress: bool) -> None:
        phases = [("draft", self._draft_phase), ("verify", self._verify_phase), ("extend", self._extend_phase)]
        self.runner.graphs.capture(phases, lambda p: self.prepare_padding(0, p), "capturing speculative graphs",
                                   show_progress)


def _slice_tree(tree: Tree, bs: int) -> Tree:
    return Tree(tree.tokens[:bs], tree.parents[:bs], tree.depths[:bs], tree.masks[:bs])
