"""N-gram (prompt-lookup) speculation (`speculative_algorithm="NGRAM"`, vLLM's `{"method": "ngram"}`): drafts are
copied from the request's own context, no draft model is loaded.

The rule (vLLM's): the context is the prompt and the output so far, its last token the round's root. Among the
n-grams that end the context, n in [prompt_lookup_min, prompt_lookup_max], find the earlier occurrences (each
ending before the last token); the best is the longest n-gram's earliest occurrence, and its draft is the up to S
tokens that follow it in the context (fewer where the context ends first). With K = speculative_eagle_topk > 1 the
K best occurrences by (n-gram length, then earliest) each propose their continuation, and the continuations merge
into a trie (equal prefixes share nodes), the verify tree. K = 1 is vLLM's chain exactly.

E.g. context [1 2 3 1 2 4 1 2], lookup [1, 3], S = 3: the longest n-gram ending the context that occurred earlier is
[1 2] (at 0..1 and 3..4; [4 1 2] never did), so the draft is [3 1 2], the tokens after its earliest occurrence (a
continuation may run into the end of the context). With K = 2 the occurrence at 3..4 adds [4 1 2]: the trie's root
has two children, six nodes in all.

The round is EAGLE's (speculative/eagle_worker.py): the same tree layout (speculative/tree.py's `build_tree`), the
same verify phase, scratch, sampled and grammar-masked acceptance, logprobs, penalties, page commit and CUDA graphs.
Only the draft phase (matching and the trie) and the bookkeeping after a commit differ; there is no draft KV.

Where the context lives: `NgramWorker.tokens`, one token id per slot of the target's paged KV (Limits.num_page_slots),
written wherever the target's KV is written (a prefill chunk, a round's accepted path). A row's context is then
read through its page table like its KV, so a prompt served from the prefix cache brings its tokens along (its
pages were written by an earlier request), and the device never waits for the host: the matching runs inside the
round's first graph and works under overlap scheduling, where the host learns a round's tokens one step late.
Every tensor-parallel rank holds the same tokens and makes the same choice (integer keys, no ties).

Cost, on the device per round: a gather of each row's context through its page table and, per n <= lookup max, one
compare over it: O(P * W * prompt_lookup_max) int32 work, W = the step's KV bound (under CUDA graphs the Limits'
kv_capacity, the longest context), then one top-K over [P, W] and a K*K*S trie merge. With P = 256 rows of an 8K
context and max 5 that is ~10M int32 ops (tens of microseconds on an H100-class GPU); a long context pays linearly.
"""

from __future__ import annotations

import torch

from spruce.attention.metadata import Phase
from spruce.runtime.batch_builder import paged_slots
from spruce.runtime.model_runner import ModelRunner
from spruce.runtime.strategy import PrefillChunk
from spruce.speculative.eagle_worker import EagleWorker, RoundPhase, Verified
from spruce.speculative.tree import DraftCandidates, Tree, build_tree
from spruce.speculative.verify import Acceptance, accept_matching

NO_TOKEN = -1  # context entries past a row's last token (token ids are >= 0)
DEPTH_DECAY = 0.9  # a trie node's score: its candidates' rank weights, times this per depth (`merge_candidates`)


def row_context(tokens: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, committed: torch.Tensor,
                roots: torch.Tensor, width: int, page_size: int) -> torch.Tensor:
    """Each row's context [P, width] int32: the tokens at positions [0, committed) read through the page table
    from `tokens` (one id per KV slot), the root (the last token, no KV yet) at `committed`, NO_TOKEN after it.
    width must exceed every committed length (a step's KV bound does) and is at most the page table's reach."""
    positions = torch.arange(width, device=rows.device)[None, :]  # [1, W]
    ctx = tokens[paged_slots(table, rows[:, None], positions, page_size)]  # [P, W]
    ctx = torch.where(positions < committed[:, None], ctx, NO_TOKEN)
    return torch.where(positions == committed[:, None], roots[:, None].to(ctx.dtype), ctx)


def match_lengths(ctx: torch.Tensor, lengths: torch.Tensor, max_n: int) -> torch.Tensor:
    """m [P, W] int64: for each end position e, the longest n <= max_n with ctx[e-n+1 .. e] equal to the context's
    last n tokens ctx[L-n .. L-1] (L = lengths [P], the context's length); 0 at e >= L - 1 (an occurrence ends
    before the last token)."""
    P, W = ctx.shape
    dev = ctx.device
    padded = torch.cat([torch.full((P, max_n), NO_TOKEN, dtype=ctx.dtype, device=dev), ctx], dim=1)  # [P, max_n+W]
    run = torch.ones(P, W, dtype=torch.bool, device=dev)
    m = torch.zeros(P, W, dtype=torch.int64, device=dev)
    for i in range(max_n):  # run: the last i+1 tokens match ending at e
        at = lengths - 1 - i  # [P] the context token the i-th one back from e must equal
        last = ctx.gather(1, at.clamp(min=0)[:, None])  # [P, 1]
        last = torch.where(at[:, None] >= 0, last, NO_TOKEN - 1)  # no such token: equals nothing
        run = run & (padded[:, max_n - i:max_n - i + W] == last)  # padded[:, max_n - i + e] = ctx[e - i]
        m += run
    ends = torch.arange(W, device=dev)[None, :]
    return torch.where(ends <= (lengths - 2)[:, None], m, 0)


def propose(ctx: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int, k: int,
            depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K best occurrences' continuations (module docstring): tokens [P, K, depth] int64 and valid [P, K, depth]
    bool (a candidate's real tokens, a prefix of its row: fewer where the context ends, none without an occurrence).
    Candidate 0 is vLLM's proposal: the longest matching n-gram in [min_n, max_n], its earliest occurrence."""
    P, W = ctx.shape
    if W < k:  # top-K needs K columns: pad with positions that match nothing
        ctx = torch.cat([ctx, torch.full((P, k - W), NO_TOKEN, dtype=ctx.dtype, device=ctx.device)], dim=1)
        W = k
    m = match_lengths(ctx, lengths, max_n)  # [P, W]
    ends = torch.arange(W, device=ctx.device)[None, :]
    key = torch.where(m >= min_n, m * (W + 1) + (W - 1 - ends), -1)  # longer first, then earlier; distinct
    best_key, best_end = key.topk(k, dim=1)  # [P, K]
    positions = best_end[:, :, None] + 1 + torch.arange(depth, device=ctx.device)[None, None, :]  # [P, K, depth]
    valid = (best_key >= 0)[:, :, None] & (positions <= (lengths - 1)[:, None, None])
    tokens = ctx.gather(1, positions.clamp(max=W - 1).view(P, k * depth)).view(P, k, depth).to(torch.int64)
    return torch.where(valid, tokens, 0), valid


def merge_candidates(tokens: torch.Tensor, valid: torch.Tensor) -> tuple[DraftCandidates, torch.Tensor]:
    """Merge K continuations [P, K, S] (and their valid masks) into a trie, as the draft candidates `build_tree`
    takes (M = S*K, candidate d*K + c: continuation c's token at depth d+1, so parents precede children), and the
    number of real trie nodes per row [P].

    Node (c, d) is real when c is the first continuation with that prefix (through depth d); its parent is the first
    continuation's node with its prefix one shorter. A real node scores the rank weights 1/(c'+1) of every
    continuation c' through it, times DEPTH_DECAY**d: never above its parent (a superset of continuations, one
    depth less), so `build_tree` keeps ancestor-closed trees, candidate 0's chain first. Every other candidate is
    padding: a child of the root scoring -1, kept only where a row has fewer than N-1 real nodes; `NgramWorker`
    marks such nodes dead so verification never accepts them (their tokens are arbitrary: a sibling may repeat)."""
    P, K, S = tokens.shape
    dev = tokens.device
    equal = (tokens[:, :, None, :] == tokens[:, None, :, :]) & valid[:, :, None, :] & valid[:, None, :, :]
    same = equal.to(torch.int64).cumprod(dim=3)  # [P, K, K, S]: c and c' share the prefix through depth d
    owner = same.argmax(dim=2)  # [P, K, S] the first continuation sharing c's prefix (c itself where valid)
    cand = torch.arange(K, device=dev)
    real = valid & (owner == cand[None, :, None])
    weight = 1.0 / (cand.to(torch.float32) + 1.0)  # [K]
    decay = DEPTH_DECAY ** torch.arange(S, device=dev, dtype=torch.float32)  # [S]
    score = (same.to(torch.float32) * weight[None, None, :, None]).sum(dim=2) * decay  # [P, K, S]
    depth = torch.arange(S, device=dev)[None, None, :]
    parent = torch.cat([torch.full((P, K, 1), -1, dtype=torch.int64, device=dev),
                        (depth[:, :, 1:] - 1) * K + owner[:, :, :-1]], dim=2)  # [P, K, S] candidate index

    def flat(x: torch.Tensor) -> torch.Tensor:  # [P, K, S] -> [P, S*K], depth-major
        return x.transpose(1, 2).reshape(P, S * K)

    cands = DraftCandidates(tokens=flat(torch.where(real, tokens, 0)), parents=flat(torch.where(real, parent, -1)),
                            scores=flat(torch.where(real, score, -1.0)),
                            depths=flat(torch.where(real, depth + 1, 1).expand(P, K, S)))
    return cands, real.sum(dim=(1, 2))


def _no_plan(P: int, max_kv: int) -> None:
    """The plan callback of a phase that runs no attention."""


class NgramWorker(EagleWorker):
    """EAGLE's round (EagleWorker) with the draft phase replaced by context matching and no draft model: see the
    module docstring. Needs a SpeculativeConfig of algorithm NGRAM (its prompt_lookup_min / _max)."""

    def __init__(self, runner: ModelRunner, debug: bool = False):
        spec = runner.config.speculative
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max
        super().__init__(runner, debug)

    def _init_draft(self, runner: ModelRunner) -> None:
        """The context store (one token id per KV slot) and each row's count of real tree nodes."""
        lim, dev = runner.limits, runner.device
        self.tokens = torch.zeros(lim.num_page_slots, dtype=torch.int32, device=dev)  # [slots]
        self.real_nodes = torch.zeros(lim.max_running_requests, dtype=torch.int64, device=dev)  # [R]

    def _make_phases(self, width: int) -> list[RoundPhase]:
        """Draft (matching + tree), verify, commit: only the verify runs attention."""
        suffix = "" if width == self.N else f"@{width}"
        return [RoundPhase(f"draft{suffix}", lambda P, max_kv: self._draft_phase(P, max_kv, width), _no_plan),
                RoundPhase(f"verify{suffix}", self._verify_phase, self.runner.planner(Phase.VERIFY, tree_width=width)),
                RoundPhase(f"extend{suffix}", self._extend_phase, _no_plan)]

    # --- the context store ------------------------------------------------------------------------------------
    def wants_prefill_features(self, chunks: list[PrefillChunk]) -> bool:
        return False  # no draft reads them

    def extend_draft(self, chunks: list[PrefillChunk], features: torch.Tensor | None, ends: list[int],
                     finals: list[int], new_tokens: torch.Tensor) -> None:
        """Store the prefilled chunks' tokens at their KV slots (the sampled token is the row's root: no KV yet)."""
        r = self.runner
        ids = [t for c in chunks for t in c.tokens]
        rows, positions = r.prefilled_tokens(len(ids))
        slots = paged_slots(r.page_table.table, rows, positions, r.limits.page_size)
        self.tokens[slots] = torch.tensor(ids, dtype=torch.int32).to(r.device, non_blocking=True)

    def _extend_draft_after_verify(self, P: int, max_kv: int, verified: Verified, next_tokens: torch.Tensor) -> None:
        """Store the committed path's tokens (the root and the accepted nodes) at the slots its KV went to."""
        r, rows, committed = self.runner, self.rows[:P], self.committed[:P]
        steps = torch.arange(self.S + 1, device=r.device)[None, :]  # [1, S+1]
        real = steps <= self.accept_lens[:P, None]  # [P, S+1]
        slots = torch.where(real, paged_slots(r.page_table.table, rows[:, None], committed[:, None] + steps,
                                              r.limits.page_size), 0)  # the rest write the dummy page's slot 0
        path_tokens = verified.tree.tokens.gather(1, self.path[:P])  # [P, S+1]
        self.tokens[slots.reshape(-1)] = path_tokens.reshape(-1).to(torch.int32)

    # --- the round --------------------------------------------------------------------------------------------
    def _prune_step0(self, bs: int, masks: torch.Tensor) -> None:
        """Nothing to prune before drafting: a node whose token the grammar refuses is dead in verification."""

    def _draft_phase(self, P: int, max_kv: int, width: int) -> Tree:
        """Gather the rows' committed lengths and roots, match their contexts and build the tree of `width` nodes."""
        r, lim = self.runner, self.runner.limits
        rows = self.rows[:P]
        committed, roots = r.row_state.gather(rows)
        self.committed[:P] = committed
        self.roots[:P] = roots
        ctx = row_context(self.tokens, r.page_table.table, rows, committed, roots, max_kv, lim.page_size)
        cont, valid = propose(ctx, committed + 1, self.min_n, self.max_n, self.K, self.S)
        cands, real_nodes = merge_candidates(cont, valid)
        self.real_nodes[:P] = real_nodes
        return build_tree(cands, roots, width, lim.mask_words, self.S, debug=self.debug)

    def _acceptance(self, tree: Tree, target_tokens: torch.Tensor) -> Acceptance:
        """EAGLE's acceptance with the padding nodes dead: a node is real when its rank (its place in the score
        order; real nodes outscore padding) is below its row's count of real nodes."""
        P = tree.tokens.shape[0]
        live = (tree.ranks >= 0) & (tree.ranks < self.real_nodes[:P, None])
        matches = (tree.tokens == target_tokens.gather(1, tree.parents.clamp(min=0))) & live
        return accept_matching(tree, matches, target_tokens, self.S)
