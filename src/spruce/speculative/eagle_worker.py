"""One EAGLE speculative round per decode step (DESIGN §1): draft -> tree -> verify -> commit -> draft extend.

Every phase runs on device tensors with no host synchronisation; the single sync of a round is reading the
accepted tokens back at the end. The draft's per-request state between rounds (its step-0 top-K and the
hidden state that feeds step 1) lives in row-indexed buffers sized by `Limits`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.attention.metadata import Phase
from spruce.errors import ConfigError
from spruce.runtime.batch_builder import paged_slots
from spruce.runtime.model_runner import ModelRunner
from spruce.runtime.sampler import SamplingTensors, select_tokens
from spruce.speculative.tree import DraftCandidates, build_tree, own_bits
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
        dev = runner.device
        self.topk_p = torch.zeros(lim.num_rows, self.K, dtype=torch.float32, device=dev)  # [rows, K]
        self.topk_ids = torch.zeros(lim.num_rows, self.K, dtype=torch.int64, device=dev)  # [rows, K]
        self.hidden = torch.zeros(lim.num_rows, draft.hidden_size, dtype=runner.dtype, device=dev)  # [rows, Hd]

    # --- draft state after an extend ------------------------------------------------------------------------
    def _store_step0(self, rows: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """From the draft's hidden at each request's last committed position: top-K for the next round."""
        probs = self.runner.draft.compute_logits(last_hidden).softmax(dim=-1)  # [bs, Vd]
        p, ids = probs.topk(self.K, dim=-1)
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
        ends = torch.tensor(_cumsum([len(t) for t in next_tokens]), device=r.device) - 1  # last token of each
        sel = [i for i, f in enumerate(finals) if f]
        if sel:
            idx = torch.tensor(sel, device=r.device)
            self._store_step0(torch.tensor(rows, device=r.device)[idx], h[ends[idx]])

    # --- the round -------------------------------------------------------------------------------------------
    def round(self, reqs, sampling: SamplingTensors) -> RoundResult:
        r, lim = self.runner, self.runner.limits
        K, S, N = self.K, self.S, self.N
        bs = len(reqs)
        dev = r.device
        rows = torch.tensor([q.row for q in reqs], dtype=torch.int64, device=dev)  # [bs]
        committed = torch.tensor([q.committed for q in reqs], dtype=torch.int64, device=dev)  # [bs]
        roots = torch.tensor([q.token_ids[-1] for q in reqs], dtype=torch.int64, device=dev)  # [bs]
        max_kv = max(q.committed for q in reqs)

        cands = self._draft(rows, committed, max_kv)
        tree = build_tree(cands, roots, N, lim.mask_words, S, debug=self.debug)

        batch = r.builder.scratch_phase(Phase.VERIFY, rows, committed, tree.tokens, tree.depths, tree.masks,
                                        0, r.target_kv.scratch_start, lim.target_scratch_width, bs, max_kv)
        hidden, aux = r.target_forward(batch)
        logits = r.target.compute_logits(hidden[: bs * N])  # [bs*N, V]
        positions = (committed[:, None] + tree.depths + 1).reshape(-1)  # position of each node's successor
        nodes = torch.arange(N, device=dev).repeat(bs)
        target_tokens = select_tokens(logits, sampling, positions, nodes).view(bs, N)
        acc = accept(tree, target_tokens, S)

        steps = torch.arange(S + 1, device=dev)[None, :]  # [1, S+1]
        real = steps <= acc.accept_lens[:, None]  # [bs, S+1] the root and the accepted nodes
        self._commit(reqs, rows, committed, acc.path, real)

        feats = r.target_features(hidden, aux)[: bs * N].view(bs, N, -1)
        path_feats = feats.gather(1, acc.path[:, :, None].expand(-1, -1, feats.shape[-1]))  # [bs, S+1, F]
        path_tokens = tree.tokens.gather(1, acc.path)  # [bs, S+1]
        next_tokens = torch.cat([path_tokens[:, 1:], acc.bonus[:, None]], dim=1)  # token at p+1 for each p
        next_tokens = torch.where(steps == acc.accept_lens[:, None], acc.bonus[:, None], next_tokens)
        ext = r.builder.draft_extend(rows, committed, acc.accept_lens + 1, next_tokens, bs, max_kv + S + 1)
        h = r.draft_forward(ext, path_feats.reshape(bs * (S + 1), -1))  # [bs*(S+1), Hd]
        last = h.view(bs, S + 1, -1).gather(1, acc.accept_lens[:, None, None].expand(-1, 1, h.shape[-1]))
        self._store_step0(rows, last[:, 0])

        lens = acc.accept_lens.tolist()  # the round's one host sync
        toks = next_tokens.tolist()
        return RoundResult(accept_lens=lens, new_tokens=[t[: a + 1] for t, a in zip(toks, lens)])

    def _commit(self, reqs, rows, committed, path, real) -> None:
        """Move the root's and accepted nodes' target KV from tree scratch to pages c..c+a (rest: dummy)."""
        r, lim = self.runner, self.runner.limits
        for q in reqs:  # always-on host check: the pages cover every position commit/extend may write
            r.page_table.check_covers(q.row, q.committed + self.S + 1, f"commit of request {q.request_id}")
        src = r.target_kv.scratch_start + rows[:, None] * lim.target_scratch_width + path  # [bs, S+1]
        pos = committed[:, None] + torch.arange(self.S + 1, device=r.device)[None, :]
        dst = torch.where(real, paged_slots(r.page_table.table, rows[:, None], pos, lim.page_size), 0)
        r.target_kv.copy_slots(src.reshape(-1), dst.reshape(-1))

    # --- the draft loop ---------------------------------------------------------------------------------------
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
                (j - 1) * K, r.draft_kv.scratch_start, lim.draft_scratch_width, bs, max_kv)
            h = r.draft_forward(batch, f_hidden.reshape(bs * K, -1))[: bs * K]  # [bs*K, Hd]
            p, ids = r.draft.compute_logits(h).softmax(dim=-1).topk(K, dim=-1)  # [bs*K, K]
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


def _cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out
