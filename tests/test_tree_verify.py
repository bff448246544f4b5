"""Tree build and acceptance on hand-made trees."""

import torch

from spruce.speculative.tree import DraftCandidates, ancestor_masks, build_tree
from spruce.speculative.verify import accept


def candidates():
    # K=2, S=2: step 0 -> c0 (tok 10, .6), c1 (tok 11, .3); step 1 children of c0: c2 (20, .6*.5), c3 (21, .6*.4)
    # children of c1: c4 (22, .3*.9), c5 (23, .3*.1)
    return DraftCandidates(
        tokens=torch.tensor([[10, 11, 20, 21, 22, 23]]),
        parents=torch.tensor([[-1, -1, 0, 0, 1, 1]]),
        scores=torch.tensor([[0.6, 0.3, 0.30, 0.24, 0.27, 0.03]]),
        depths=torch.tensor([[1, 1, 2, 2, 2, 2]]),
    )


def test_build_tree_keeps_best_in_topological_order():
    tree = build_tree(candidates(), torch.tensor([5]), num_draft_tokens=5, words=1, max_depth=2)
    # best 4: c0 .6, c1 .3, c2 .30 (tie with c1: generation order keeps c1 first), c4 .27
    assert tree.tokens.tolist() == [[5, 10, 11, 20, 22]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2]]
    assert tree.masks[0, :, 0].tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10101]


def test_ancestor_masks_span_words():
    parents = torch.tensor([[-1] + list(range(0, 69))])  # a chain of 70 nodes
    m = ancestor_masks(parents, words=2, max_depth=69)
    assert m[0, 69, 0].item() == -1 and m[0, 69, 1].item() == (1 << 6) - 1
    assert m[0, 63, 0].item() == -1 and m[0, 63, 1].item() == 0


def test_accept_walks_the_target_choices():
    tree = build_tree(candidates(), torch.tensor([5]), num_draft_tokens=5, words=1, max_depth=2)
    # target: after root -> 11, after node 2 (tok 11) -> 22, after node 4 (tok 22) -> 99 (bonus)
    target = torch.tensor([[11, 0, 22, 0, 99]])
    acc = accept(tree, target, num_steps=2)
    assert acc.accept_lens.tolist() == [2] and acc.path.tolist() == [[0, 2, 4]] and acc.bonus.tolist() == [99]
    target = torch.tensor([[12, 0, 0, 0, 0]])  # nothing matches: bonus is the root's target token
    acc = accept(tree, target, num_steps=2)
    assert acc.accept_lens.tolist() == [0] and acc.path.tolist() == [[0, 0, 0]] and acc.bonus.tolist() == [12]
    target = torch.tensor([[10, 7, 0, 0, 0]])  # depth 1 accepted, node 1 has no kept child matching 7
    acc = accept(tree, target, num_steps=2)
    assert acc.accept_lens.tolist() == [1] and acc.path.tolist() == [[0, 1, 1]] and acc.bonus.tolist() == [7]
