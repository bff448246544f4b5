"""One EAGLE speculative round per decode step (DESIGN §1): draft -> tree -> verify -> accept -> commit ->
draft extend.

The round is three graph-capturable phases over static, Limits-sized buffers (rows past the real batch
hold the dummy row): DRAFT_DECODE (all S-1 draft steps + tree build), VERIFY (target forward over the
tree + logits + greedy acceptance) and DRAFT_EXTEND (commit of the accepted path + draft extend + next
step-0 top-K). When a batch has sampled requests, their token selection and acceptance run eagerly between
VERIFY and DRAFT_EXTEND and overwrite the greedy result; so, when a request wants logprobs, does the scoring of
the accepted path's verify logits (runtime/logprobs.py). When a request has structured output, the tree is read
back after DRAFT_DECODE, each node gets its grammar mask on the host (runtime/grammar.py), and every row's
selection and acceptance run eagerly on the masked verify logits. Nothing in a round syncs with the host until one
[bs, S+2] read-back (accept lengths and tokens) at its end. The same phase functions run eagerly or under
CUDA graphs (runtime/cuda_graph.py).

Adaptive speculation (speculative/adaptive.py) may also run the round over a narrower verify tree (N' < N,
Limits.narrower_widths): the same draft, the tree of its best N'-1 candidates (`NarrowRound`); its phases are graphs
of their own. Every round's result row then ends with, per narrower width, the drafts a round at that width would
have accepted (speculative/tree.py's `accepted_within`), which is what the policy chooses the width by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from spruce.attention.metadata import Phase
from spruce.errors import ConfigError, InvariantError
from spruce.ops import softmax_topk
from spruce.runtime.batch_builder import paged_slots
from spruce.runtime.grammar import GrammarBatch, allowed_tokens, apply_token_mask
from spruce.runtime.logprobs import LogprobPlan, pack_logprobs
from spruce.runtime.model_runner import ModelRunner
from spruce.runtime.penalties import node_paths
from spruce.runtime.sampler import SamplingTensors, select_tokens
from spruce.runtime.strategy import DecodeStrategy, PrefillChunk
from spruce.speculative.frontier import expand_frontier
from spruce.speculative.synthetic import synthetic_acceptance
from spruce.speculative.tree import DraftCandidates, Tree, accepted_within, build_tree, own_bits
from spruce.speculative.verify import Acceptance, accept


class RoundPhase(NamedTuple):
    """One phase of a round as BucketGraphs runs and captures it (runtime/cuda_graph.py)."""

    name: str
    fn: Callable
    plan: Callable[[int, int], None]


@dataclass
class Verified:
    """VERIFY's output: the tree it checked and the target's logits and draft features at every node."""

    tree: Tree
    logits: torch.Tensor  # [P*N, V]
    features: torch.Tensor  # [P*N, F]

    @property
    def batch_rows(self) -> int:
        return self.tree.batch_rows


@dataclass(frozen=True)
class NarrowRound:
    """The worker's round over a verify tree of `tree_width` (< N) nodes: what adaptive speculation launches when
    it chooses that width (DecodeStrategy.decode's contract)."""

    worker: "EagleWorker"
    tree_width: int
    speculative = True

    def decode(self, rows: list[int], max_kv: int, sampling: SamplingTensors,
               logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None) -> torch.Tensor:
        return self.worker.decode(rows, max_kv, sampling, logprobs, grammar, self.tree_width)


class EagleWorker(DecodeStrategy):
    speculative = True

    def __init__(self, runner: ModelRunner, debug: bool = False):
        super().__init__(runner)
        self.debug = debug
        lim = runner.limits
        self.K, self.S, self.N = lim.eagle_topk, lim.num_steps, lim.num_draft_tokens
        self.tree_width = self.N
        self.synthetic = synthetic_acceptance(runner.config, runner.device)  # None: verify (the default)
        # per verify width: its phases (name, fn, plan); N's keep the plain names (a fixed engine's graphs)
        self._phases = {width: self._make_phases(width) for width in lim.tree_widths}
        r, i64 = lim.max_running_requests, dict(dtype=torch.int64, device=runner.device)
        # a round's per-row inputs (gathered from the row state by DRAFT_DECODE) and accept state
        self.committed = torch.zeros(r, **i64)  # [R]
        self.roots = torch.zeros(r, **i64)  # [R]
        self.accept_lens = torch.zeros(r, **i64)  # [R]
        self.path = torch.zeros(r, self.S + 1, **i64)  # [R, S+1]
        self.bonus = torch.zeros(r, **i64)  # [R]
        self._init_draft(runner)

    def _init_draft(self, runner: ModelRunner) -> None:
        """The draft's state carried between rounds and the draft loop's buffers (a strategy that drafts without a
        draft model, speculative/ngram.py, keeps its own)."""
        lim, draft = runner.limits, runner.draft
        if self.K > draft.draft_vocab_size:
            raise ConfigError(f"speculative_eagle_topk={self.K} exceeds the draft vocabulary {draft.draft_vocab_size}")
        dev, rows, r = runner.device, lim.num_rows, lim.max_running_requests
        i64 = dict(dtype=torch.int64, device=dev)
        # draft state carried between rounds, per page-table row
        self.topk_p = torch.zeros(rows, self.K, dtype=torch.float32, device=dev)  # [rows, K]
        self.topk_ids = torch.zeros(rows, self.K, **i64)  # [rows, K]
        self.hidden = torch.zeros(rows, draft.hidden_size, dtype=runner.dtype, device=dev)  # [rows, Hd]
        # draft-loop buffers: every candidate of a round (M = K + (S-1)*K*K), written in place by each step
        k, s, m = self.K, self.S, lim.num_candidates
        self.to_target = draft.draft_to_target(torch.arange(draft.draft_vocab_size, **i64))  # [draft vocab]
        self.cand_tokens = torch.zeros(r, m, **i64)  # [R, M]
        self.cand_scores = torch.zeros(r, m, dtype=torch.float32, device=dev)  # [R, M]
        self.cand_parents = torch.full((r, m), -1, **i64)  # [R, M] step-0 columns stay -1 (children of the root)
        depth_of = [1] * k + [d + 1 for d in range(1, s) for _ in range(k * k)]
        self.cand_depths = torch.tensor(depth_of, **i64)[None, :].expand(r, m)  # [R, M] constant
        self.step_depths = torch.arange(s, **i64)[:, None, None].expand(s, r, k).contiguous()  # [S, R, K]: j
        self.first_cand = torch.arange(k, **i64)[None, :].expand(r, k).contiguous()  # [R, K]
        self.no_masks = torch.zeros(r, k, lim.mask_words, **i64)  # [R, K, words]

    # --- draft state after an extend ------------------------------------------------------------------------
    def store_step0(self, rows: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """From the draft's hidden at each request's last committed position: top-K for the next round."""
        p, ids = softmax_topk(self.runner.draft.compute_logits(last_hidden), self.K)  # [bs, K]
        self.topk_p[rows] = p
        self.topk_ids[rows] = self.to_target[ids]
        self.hidden[rows] = last_hidden.to(self.hidden.dtype)

    def wants_prefill_features(self, chunks: list[PrefillChunk]) -> bool:
        return True  # every prefill extends the draft

    def extend_draft(self, chunks: list[PrefillChunk], features: torch.Tensor, ends: list[int], finals: list[int],
                     new_tokens: torch.Tensor) -> None:
        """Draft extend over prefill chunks: pairs (target feature at p, token at p+1) for the chunks' p.

        A final chunk's last pair takes the token just sampled after the prompt (`new_tokens`, on the device);
        its request then gets its step-0 top-K."""
        r = self.runner
        last = None
        if finals:
            last = torch.tensor([ends[i] for i in finals], dtype=torch.int64).to(r.device, non_blocking=True)
        h = r.draft_extend_forward([c.row for c in chunks], [c.start for c in chunks],
                                   [c.next_tokens + [0] * c.final for c in chunks], features,
                                   (last, new_tokens) if finals else None)  # [T, Hd]
        if finals:
            rows = torch.tensor([chunks[i].row for i in finals], dtype=torch.int64).to(r.device, non_blocking=True)
            self.store_step0(rows, h[last])

    # --- the round -------------------------------------------------------------------------------------------
    def _make_phases(self, width: int) -> list[RoundPhase]:
        """The round's three phases over a verify tree of `width` nodes, in their order."""
        plan, suffix = self.runner.planner, "" if width == self.N else f"@{width}"
        return [RoundPhase(f"draft{suffix}", lambda P, max_kv: self._draft_phase(P, max_kv, width),
                           plan(Phase.DRAFT_DECODE)),
                RoundPhase(f"verify{suffix}", self._verify_phase, plan(Phase.VERIFY, tree_width=width)),
                RoundPhase(f"extend{suffix}", self._extend_phase, plan(Phase.DRAFT_EXTEND))]

    def narrow(self, width: int) -> "NarrowRound | EagleWorker":
        """What launches a round at verify width `width` (one of Limits.tree_widths): the worker itself at N."""
        if width not in self._phases:
            raise InvariantError(f"verify width {width} is not one of {tuple(self._phases)} (Limits.tree_widths)")
        return self if width == self.N else NarrowRound(self, width)

    def decode(self, rows: list[int], max_kv: int, sampling: SamplingTensors,
               logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None,
               width: int | None = None) -> torch.Tensor:
        """One round for the requests in `rows` over a verify tree of `width` nodes (None: N); `sampling` has one
        row per tree node ([bs*width]), `grammar` one entry per request."""
        graphs, timer = self.runner.graphs, self.runner.timer
        draft, verify, extend = self._phases[width or self.N]
        bs = len(rows)
        self.fill_rows(rows)
        if grammar is not None:
            with timer.phase("grammar"):  # the depth-1 draft tokens: only what the grammar allows next
                self._prune_step0(bs, grammar.row_masks(self.runner.device))
        with timer.phase("draft"):
            tree = graphs.run(draft.name, draft.fn, bs, max_kv, plan=draft.plan)
        masks = None
        if grammar is not None:
            with timer.phase("grammar"):  # [bs*N, words]: each node's mask after its path (reads the tree back)
                masks = grammar.tree_masks(tree.tokens[:bs], tree.parents[:bs], self.runner.device)
        with timer.phase("verify"):  # also accepts greedily on the device (the rows' accept state)
            verified = graphs.run(verify.name, verify.fn, bs, max_kv, tree, plan=verify.plan)
        if not sampling.all_greedy or masks is not None:
            with timer.phase("accept"):  # sampled or masked rows: accept along the target's own choices instead
                self._accept(bs, verified.tree, self._sampled_target_tokens(bs, verified, sampling, masks), masks)
        if logprobs is not None:
            with timer.phase("logprobs"):
                logprobs.pack = self._path_logprobs(verified, logprobs)
        with timer.phase("extend"):
            out = graphs.run(extend.name, extend.fn, bs, max_kv, verified, plan=extend.plan)  # [P, result width]
        return out[:bs]

    def _prune_step0(self, bs: int, masks: torch.Tensor) -> None:
        """Recompute the rows' step-0 top-K from the draft's stored hidden state with the draft logits masked by
        each request's grammar (masks [bs, words], target vocabulary), so no depth-1 slot of the tree holds a
        token the grammar refuses. A row whose mask allows no draft-vocabulary token keeps its unmasked top-K
        (its nodes are then dead; verification never accepts them)."""
        rows = self.rows[:bs]
        logits = self.runner.draft.compute_logits(self.hidden[rows])  # [bs, Vd]
        allowed = allowed_tokens(masks, self.runner.model_config.vocab_size)[:, self.to_target]  # [bs, Vd]
        allowed |= ~allowed.any(dim=-1, keepdim=True)
        p, ids = softmax_topk(logits.float().masked_fill(~allowed, float("-inf")), self.K)  # [bs, K]
        self.topk_p[rows] = p
        self.topk_ids[rows] = self.to_target[ids]

    def _sampled_target_tokens(self, bs: int, verified: Verified, sampling: SamplingTensors,
                               masks: torch.Tensor | None = None) -> torch.Tensor:
        """The target's token after each tree node under the requests' sampling parameters (and grammar masks
        [bs*N, words], if given): [bs, N] (N: the tree's width).

        The random key is (seed, position) alone, as in plain decoding: the committed token at a position is
        the same sample whichever tree (or no tree) led there, so seeded output is identical with and without
        speculation, across batches and through preemption. Penalties count the committed output and the
        node's path (runtime/penalties.py), and bad words match its end (runtime/token_restrictions.py)."""
        tree = verified.tree
        positions = (self.committed[:bs, None] + tree.depths[:bs] + 1).reshape(-1)  # each node's successor
        history = None
        if sampling.penalties is not None or sampling.bad_words is not None:  # a node's own path counts too
            history = self.history(sampling, self.rows[:bs],
                                   *node_paths(tree.tokens[:bs], tree.parents[:bs], tree.depths[:bs], self.S))
        width = tree.tokens.shape[1]
        logits = verified.logits[: bs * width]
        if masks is not None:
            logits = apply_token_mask(logits, masks)
        return select_tokens(logits, sampling, positions, history).view(bs, width)

    def _path_logprobs(self, verified: Verified, plan: LogprobPlan) -> torch.Tensor:
        """The target's logprobs of the tokens the round commits, for the batch rows of `plan`: [w*(S+1), 2+2k].

        Pack row j of a batch row is the verify logits of its accepted path's node at depth j (the root, then
        the accepted nodes) at the token after it: the next path node's, or the bonus at depth accept_len.
        Rows past accept_len are padding (the last node repeated), never read back."""
        dev, steps = self.runner.device, self.S + 1
        idx = torch.tensor(plan.rows, dtype=torch.int64).to(dev, non_blocking=True)  # [w]
        path, accept_lens, bonus = self.path[idx], self.accept_lens[idx], self.bonus[idx]  # [w, S+1], [w], [w]
        path_tokens = verified.tree.tokens[idx].gather(1, path)  # [w, S+1]
        depth = torch.arange(steps, device=dev)[None, :]
        chosen = torch.cat([path_tokens[:, 1:], bonus[:, None]], dim=1)
        chosen = torch.where(depth == accept_lens[:, None], bonus[:, None], chosen)  # [w, S+1]
        nodes = (idx[:, None] * verified.tree.tokens.shape[1] + path).reshape(-1)  # verify logits rows of the path
        return pack_logprobs(verified.logits[nodes], chosen.reshape(-1), plan.k)

    def _accept(self, P: int, tree: Tree, target_tokens: torch.Tensor, masks: torch.Tensor | None = None) -> None:
        """Accept along target_tokens [P, N] into the rows' accept state (padding rows accept nothing); `masks`
        (grammar, [P*N, words]): synthetic acceptance takes only nodes their parent's grammar allows."""
        tree = _slice_tree(tree, P)
        acc = (self._acceptance(tree, target_tokens) if self.synthetic is None
               else self.synthetic.accept(tree, self.rows[:P], self.S, target_tokens, masks))
        real = self.rows[:P] != self.runner.limits.dummy_row
        self.accept_lens[:P] = torch.where(real, acc.accept_lens, 0)
        self.path[:P] = acc.path
        self.bonus[:P] = acc.bonus

    def _acceptance(self, tree: Tree, target_tokens: torch.Tensor) -> Acceptance:
        """The verified acceptance of `tree` (sliced to the batch) along target_tokens: every node may be accepted."""
        return accept(tree, target_tokens, self.S)

    def prepare_padding(self, start: int, stop: int) -> None:
        """Rows [start, stop) become padding (dummy row, nothing accepted); used for real batches and capture."""
        super().prepare_padding(start, stop)
        self.accept_lens[start:stop] = 0
        self.path[start:stop] = 0
        self.bonus[start:stop] = 0

    # --- phases (graph-capturable: device work only, static inputs) ----------------------------------------------
    def _draft_phase(self, P: int, max_kv: int, width: int) -> Tree:
        """Gather the rows' committed lengths and last tokens (the roots), then draft and build the tree of `width`
        nodes."""
        committed, roots = self.runner.row_state.gather(self.rows[:P])
        self.committed[:P] = committed
        self.roots[:P] = roots
        cands = self._draft(self.rows[:P], self.committed[:P], max_kv)
        lim = self.runner.limits
        return build_tree(cands, self.roots[:P], width, lim.mask_words, self.S, debug=self.debug)

    def _verify_phase(self, P: int, max_kv: int, tree: Tree) -> Verified:
        r, lim = self.runner, self.runner.limits
        batch = r.builder.scratch_phase(Phase.VERIFY, self.rows[:P], self.committed[:P], tree.tokens, tree.depths,
                                        tree.masks, 0, r.target_kv.scratch_start, lim.target_scratch_width, max_kv)
        hidden, aux = r.target_forward(batch)
        logits = r.target.compute_logits(hidden)  # [P*N, V]
        greedy = logits.argmax(dim=-1).view(P, tree.tokens.shape[1])  # [P, N] (explicit: P may be 0)
        self._accept(P, tree, greedy)  # greedy rows' acceptance, inside the graph
        return Verified(tree, logits, r.target_features(hidden, aux))

    def _extend_phase(self, P: int, max_kv: int, verified: Verified) -> torch.Tensor:
        """Commit the accepted path's target KV, run the draft over it and advance the rows' state.

        Returns [P, step_result_width]: each row's accept length, then its S+1 next tokens (accepted path + bonus,
        padded), then per narrower width N' (Limits.narrower_widths) the drafts a round at N' accepts
        (`accepted_within`; at N' >= this tree's width, this round's own)."""
        r, lim, tree = self.runner, self.runner.limits, verified.tree
        rows, committed = self.rows[:P], self.committed[:P]
        accept_lens, path, bonus = self.accept_lens[:P], self.path[:P], self.bonus[:P]
        steps = torch.arange(self.S + 1, device=r.device)[None, :]  # [1, S+1]
        real = steps <= accept_lens[:, None]  # [P, S+1] the root and the accepted nodes
        src = r.target_kv.scratch_start + rows[:, None] * lim.target_scratch_width + path  # [P, S+1]
        dst = torch.where(real, paged_slots(r.page_table.table, rows[:, None], committed[:, None] + steps,
                                            lim.page_size), 0)
        r.target_kv.copy_slots(src.reshape(-1), dst.reshape(-1))

        width = tree.tokens.shape[1]
        path_tokens = tree.tokens.gather(1, path)  # [P, S+1]
        next_tokens = torch.cat([path_tokens[:, 1:], bonus[:, None]], dim=1)  # token at p+1 for each p
        next_tokens = torch.where(steps == accept_lens[:, None], bonus[:, None], next_tokens)
        self._extend_draft_after_verify(P, max_kv, verified, next_tokens)
        r.row_state.set(rows, committed + accept_lens + 1, bonus)
        columns = [accept_lens[:, None], next_tokens]
        if lim.narrower_widths:
            path_ranks = tree.ranks.gather(1, path)[:, 1:]  # [P, S]
            columns += [(accepted_within(path_ranks, accept_lens, w) if w < width else accept_lens)[:, None]
                        for w in lim.narrower_widths]
        return torch.cat(columns, dim=1)

    def _extend_draft_after_verify(self, P: int, max_kv: int, verified: Verified, next_tokens: torch.Tensor) -> None:
        """Bring the draft's KV up to the accepted path and store the rows' step-0 top-K: pairs (target feature at
        p, token at p+1) for p = committed .. committed + accept_len. next_tokens [P, S+1]: the token after each
        path node (the accepted nodes', then the bonus; padding past accept_len)."""
        r, rows, committed = self.runner, self.rows[:P], self.committed[:P]
        accept_lens, path = self.accept_lens[:P], self.path[:P]
        width = verified.tree.tokens.shape[1]
        feats = verified.features.view(P, width, verified.features.shape[-1])
        path_feats = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))  # [P, S+1, F]
        ext = r.builder.draft_extend(rows, committed, accept_lens + 1, next_tokens, max_kv)
        h = r.draft_forward(ext, path_feats.reshape(P * (self.S + 1), feats.shape[-1]))  # [P*(S+1), Hd]
        last = h.view(P, self.S + 1, h.shape[-1]).gather(1, accept_lens[:, None, None].expand(-1, 1, h.shape[-1]))
        self.store_step0(rows, last[:, 0])

    def _draft(self, rows: torch.Tensor, committed: torch.Tensor, max_kv: int) -> DraftCandidates:
        """S steps of top-K expansion. Step 0 is the stored top-K; step j runs the draft (its layer for step j:
        multi-layer MTP) on the K frontier nodes (depth j, draft position committed + j - 1) and keeps the best
        K of their K*K children (speculative/frontier.py). Every candidate lands in the persistent cand_* buffers."""
        r, lim = self.runner, self.runner.limits
        K, S = self.K, self.S
        P = rows.shape[0]
        words = lim.mask_words
        cand_tokens, cand_scores, cand_parents = self.cand_tokens[:P], self.cand_scores[:P], self.cand_parents[:P]
        f_tokens = self.topk_ids[rows]  # [P, K]
        f_scores = self.topk_p[rows]  # [P, K]
        f_cand = self.first_cand[:P]  # [P, K] candidate index of each frontier node
        f_hidden = self.hidden[rows].repeat_interleave(K, dim=0)  # [P*K, Hd] feature feeding each node
        f_masks = self.no_masks[:P]  # [P, K, words] ancestors in the draft scratch
        if S == 1:
            cand_tokens[:, :K] = f_tokens
            cand_scores[:, :K] = f_scores
        for j in range(1, S):
            layer = r.draft.step_layer(j)
            if layer != r.draft.step_layer(j - 1):
                # a draft layer caches only the steps it runs: ancestors drafted by another layer are not in
                # its cache, so its first step sees the committed prefix and its own scratch entries alone
                f_masks = self.no_masks[:P]
            masks = f_masks | own_bits(K, words, r.device, offset=(j - 1) * K)[None]  # [P, K, words]
            batch = r.builder.scratch_phase(
                Phase.DRAFT_DECODE, rows, committed, f_tokens, self.step_depths[j - 1, :P], masks,
                (j - 1) * K, r.draft_kv.scratch_start, lim.draft_scratch_width, max_kv)
            h = r.draft_forward(batch, f_hidden, layer)  # [P*K, Hd]
            p, ids = softmax_topk(r.draft.compute_logits(h, layer), K)  # [P*K, K]
            nxt = expand_frontier(p, ids, self.to_target, f_tokens, f_scores, f_cand, cand_tokens, cand_scores,
                                  cand_parents, offset=K + (j - 1) * K * K, write_roots=j == 1)
            f_tokens, f_scores, f_cand = nxt.tokens, nxt.scores, nxt.cand
            hd = h.shape[-1]  # explicit widths: an empty batch (P = 0) has no -1 to infer
            f_hidden = h.view(P, K, hd).gather(1, nxt.slot[:, :, None].expand(-1, -1, hd)).view(P * K, hd)
            f_masks = masks.gather(1, nxt.slot[:, :, None].expand(-1, -1, words))
        return DraftCandidates(tokens=cand_tokens, parents=cand_parents, scores=cand_scores,
                               depths=self.cand_depths[:P])

    # --- graphs -------------------------------------------------------------------------------------------------
    def capture_graphs(self, show_progress: bool) -> None:
        """Each verify width's chain of phases, N's first."""
        for width in sorted(self._phases, reverse=True):
            self.runner.graphs.capture(self._phases[width], lambda p: self.prepare_padding(0, p),
                                       f"capturing speculative graphs (N={width})", show_progress)


def _slice_tree(tree: Tree, bs: int) -> Tree:
    return Tree(tree.tokens[:bs], tree.parents[:bs], tree.depths[:bs], tree.masks[:bs], tree.ranks[:bs])
