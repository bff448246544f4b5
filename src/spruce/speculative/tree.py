"""Tree build (DESIGN §1.2): keep the best N-1 draft candidates plus the root, in topological order.

A candidate's score is the product of the draft probabilities along its path, so a child never scores
above its parent; with a stable sort (ties keep candidate order, and parents precede children in that
order) a kept child always has a kept parent. Debug mode checks it on the device.

The tree of width N' < N is the first N'-1 candidates of the same order, so it is the width-N tree's nodes of rank
below N'-1 (`Tree.ranks`), an ancestor-closed sub-tree: a round at N reads off exactly what a round at N' would
have accepted (`accepted_within`), which adaptive speculation uses to choose the width (speculative/adaptive.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from spruce.errors import InvariantError
from spruce.attention.tree_mask import MASK_WORD_BITS


@dataclass
class DraftCandidates:
    """Every node the draft loop proposed, in generation order (step 0 first). M = K + (S-1)*K*K."""

    tokens: torch.Tensor  # [bs, M] int64 target-vocabulary ids
    parents: torch.Tensor  # [bs, M] int64 candidate index of the parent, -1 for children of the root
    scores: torch.Tensor  # [bs, M] float32 cumulative probability
    depths: torch.Tensor  # [bs, M] int64, 1 for step-0 candidates


@dataclass
class Tree:
    """The verify tree of each request. Node 0 is the root (the request's last token)."""

    tokens: torch.Tensor  # [bs, N] int64
    parents: torch.Tensor  # [bs, N] int64 tree index, -1 for the root
    depths: torch.Tensor  # [bs, N] int64, 0 for the root
    masks: torch.Tensor  # [bs, N, words] int64 ancestor bitmask (self included)
    ranks: torch.Tensor  # [bs, N] int64 a node's place in the score order (0: the best draft), -1 for the root

    @property
    def batch_rows(self) -> int:
        """Requests (padded) this tree was built for."""
        return self.tokens.shape[0]


@functools.lru_cache(maxsize=None)
def own_bits(num_nodes: int, words: int, device, offset: int = 0) -> torch.Tensor:
    """[num_nodes, words] int64 where node i has only bit (offset + i) set. Cached per device, so a CUDA
    graph capture (which runs after an eager warm-up) never copies from the host."""
    bits = torch.zeros(num_nodes, words, dtype=torch.int64)
    for i in range(num_nodes):
        b = offset + i
        val = 1 << (b % MASK_WORD_BITS)
        bits[i, b // MASK_WORD_BITS] = val if val < (1 << 63) else -(1 << 63)
    return bits.to(device)


def ancestor_masks(parents: torch.Tensor, words: int, max_depth: int) -> torch.Tensor:
    """Ancestor-or-self bitmask per node from parent indices ([bs, N], -1 = none): [bs, N, words]."""
    bs, n = parents.shape
    own = own_bits(n, words, parents.device)[None].expand(bs, n, words)
    idx = parents.clamp(min=0)[:, :, None].expand(bs, n, words)
    has_parent = (parents >= 0)[:, :, None]
    masks = own.clone()
    for _ in range(max_depth):  # depth <= max_depth: each pass pulls in one more generation of ancestors
        masks = own | torch.where(has_parent, masks.gather(1, idx), 0)
    return masks


def build_tree(cands: DraftCandidates, root_tokens: torch.Tensor, num_draft_tokens: int, words: int,
               max_depth: int, debug: bool = False) -> Tree:
    """Best N-1 candidates by score (stable: ties keep generation order) + the root, topologically sorted."""
    bs, m = cands.scores.shape
    keep = num_draft_tokens - 1
    if keep > m:
        raise InvariantError(f"tree needs {keep} candidates but the draft produced {m} (N={num_draft_tokens})")
    best = cands.scores.argsort(dim=1, descending=True, stable=True)[:, :keep]  # [bs, N-1]
    chosen, rank = best.sort(dim=1)  # generation order = parents before children; each one's place in `best`
    device = root_tokens.device
    cand_to_node = torch.full((bs, m), -1, dtype=torch.int64, device=device)
    node_ids = torch.arange(1, keep + 1, device=device)[None, :].expand(bs, keep)
    cand_to_node.scatter_(1, chosen, node_ids)
    parent_cand = cands.parents.gather(1, chosen)  # [bs, N-1]
    parent_node = torch.where(parent_cand < 0, 0, cand_to_node.gather(1, parent_cand.clamp(min=0)))
    if debug and not _capturing() and bool((parent_node < 0).any()):
        raise InvariantError("tree build kept a draft node whose parent was dropped (scores not monotone)")
    root_col = torch.zeros(bs, 1, dtype=torch.int64, device=device)
    tokens = torch.cat([root_tokens[:, None], cands.tokens.gather(1, chosen)], dim=1)
    parents = torch.cat([root_col - 1, parent_node], dim=1)
    depths = torch.cat([root_col, cands.depths.gather(1, chosen)], dim=1)
    return Tree(tokens=tokens, parents=parents, depths=depths, masks=ancestor_masks(parents, words, max_depth),
                ranks=torch.cat([root_col - 1, rank], dim=1))


def accepted_within(path_ranks: torch.Tensor, accept_lens: torch.Tensor, width: int) -> torch.Tensor:
    """The drafts a round at verify width `width` accepts, from a wider round's accepted path: [bs].

    path_ranks [bs, S]: the ranks (`Tree.ranks`) of the accepted path's nodes at depths 1..S (past accept_lens:
    anything). The narrower tree holds the nodes of rank below width-1; its path is the wider one's up to the first
    node it lacks (siblings carry distinct tokens, so no other child of that depth matches the target's token)."""
    depth = torch.arange(1, path_ranks.shape[1] + 1, device=path_ranks.device)[None, :]  # [1, S]
    kept = (path_ranks < width - 1) & (depth <= accept_lens[:, None])  # [bs, S]
    return kept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
