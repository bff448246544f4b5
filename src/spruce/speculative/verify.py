"""Verification (DESIGN §1.3): walk the tree along the target's own choices.

`target_tokens[b, i]` is the token the target picks after node i: its argmax (greedy) or a sample of its
temperature/top-k/top-p distribution drawn with the request's own uniform(seed, position). A child
is accepted when it equals its parent's target token; the first node with no accepted child yields the
bonus token (its target token).

Why sampling is lossless: every committed token is exactly the target's own sample at that position, drawn
with that position's uniform (nodes of one depth share it, but only one path's samples are ever committed, and
distinct positions have independent uniforms): the committed sequence is the one plain decoding with the same
seed samples, and the draft only decides how many of those samples one verify pass can confirm.
Siblings carry distinct tokens, so at most one child of a node matches. (With a one-hot draft proposal this
is the same distribution as sequential rejection sampling over the siblings: child x is taken with
probability p(x), the residual is p restricted to the other tokens.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.speculative.tree import Tree


@dataclass
class Acceptance:
    accept_lens: torch.Tensor  # [bs] int64 accepted draft nodes (0..S), the bonus not counted
    path: torch.Tensor  # [bs, S+1] int64 tree index of the root, then the accepted nodes by depth
    bonus: torch.Tensor  # [bs] int64 the target's token after the last accepted node


def accept(tree: Tree, target_tokens: torch.Tensor, num_steps: int) -> Acceptance:
    """Longest root path whose every node equals the target token of its parent. target_tokens [bs, N]."""
    matches = tree.tokens == target_tokens.gather(1, tree.parents.clamp(min=0))  # agrees with its parent's choice
    return accept_matching(tree, matches, target_tokens, num_steps)


def accept_matching(tree: Tree, matches: torch.Tensor, target_tokens: torch.Tensor, num_steps: int) -> Acceptance:
    """Longest root path of nodes whose `matches` [bs, N] holds (at most one child of a node may match); the bonus
    is target_tokens [bs, N] at its last node. `accept` matches the target's choices; synthetic acceptance
    (speculative/synthetic.py) its drawn ones."""
    parents = tree.parents.clamp(min=0)  # [bs, N]
    on_path = matches.clone()
    on_path[:, 0] = True  # the root is always kept
    for _ in range(num_steps):  # depth <= S: each pass propagates one level of "all ancestors matched"
        on_path = matches & on_path.gather(1, parents)
        on_path[:, 0] = True
    accept_lens = on_path[:, 1:].sum(dim=1)  # [bs]
    depth_ids = torch.arange(num_steps + 1, device=tree.tokens.device)  # [S+1]
    at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == depth_ids[None, :, None])  # [bs, S+1, N]
    path = at_depth.to(torch.int64).argmax(dim=2)  # [bs, S+1]: the path node at each depth (0 if none)
    last = path.gather(1, accept_lens[:, None])  # [bs, 1]
    path = torch.where(depth_ids[None, :] <= accept_lens[:, None], path, last)  # pad with the last node
    bonus = target_tokens.gather(1, last).squeeze(1)
    return Acceptance(accept_lens=accept_lens, path=path, bonus=bonus)
