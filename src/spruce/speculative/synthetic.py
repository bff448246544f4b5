"""Synthetic acceptance: drafts accepted at chosen rates instead of verified (a benchmark setting, vLLM's
`rejection_sample_method="synthetic"`).

A random-weight model accepts almost nothing, so its speculative rounds say nothing about speed at a real
acceptance. With synthetic acceptance a round runs exactly as usual (draft, tree, target forward over the tree,
commit, draft extend), but which drafts it commits is drawn at configured rates, not checked against the target:
the outputs are NOT the target's. It is never on by default, the engine warns at start-up, and Engine.info,
/server_info and every bench result name it.

Rates, as vLLM has them (resolved and checked with the config, config.py's `resolve_rates`): `rates[d-1]` is the UNCONDITIONAL probability that a round accepts depths 1..d (so the
list is non-increasing, one entry per draft depth, S = speculative_num_steps of them), and the mean acceptance
length (tokens a round commits, bonus included) is 1 + sum(rates). A mean length L alone resolves to the
minimum-variance schedule: floor(L-1) ones, then the fraction, then zeros. Worked example, S=5, L=3.5:
rates (1, 1, 0.5, 0, 0); a round accepts 2 drafts or 3, each half the time; mean length 1 + 2.5 = 3.5.

How a round's accepted path is drawn, for chains and trees alike: per depth d = 1..S the round draws one uniform;
the path, standing at its node of depth d-1, goes on to that node's BEST-RANKED CHILD (the child with the highest
draft score, `Tree.ranks`) when the uniform is below the conditional rate rates[d-1] / rates[d-2] (rates[-1] = 1),
and stops otherwise, or where the node has no child in the tree. The bonus token is the target's own choice after
the last accepted node (greedy or sampled, as the request asks). A chain is a tree whose nodes each have one child,
so it accepts exactly at the rates; a tree accepts at them along its best-ranked branch, and less where that branch
is shorter than S: at equal rates, trees and chains differ in what a round costs, not in what it accepts. Because
the child taken is the best-ranked one, a narrower tree of the same round (its nodes of rank below N'-1) accepts
exactly the prefix of the path that it holds (speculative/tree.py's `accepted_within` stays exact). A request with
structured output takes a node only where its grammar allows the node's token after its parent (the path stops
where it does not), so its committed tokens stay grammatical.

Randomness: one uniform per (row, depth, round) from the engine's counter-based generator (runtime/rng.py), keyed
by the engine seed and a round counter held on the device and advanced by each draw. It is all device work: no
host sync, the same under CUDA graphs (the counter's increment is part of the captured graph) and under overlap
scheduling, and identical on every tensor-parallel rank.

The rates are resolved, checked and described (Engine.info's line, `describe_synthetic`) in config.py; this
module imports no torch at load.
"""

from __future__ import annotations

import logging

from spruce.config import describe_synthetic

logger = logging.getLogger("spruce.speculative.synthetic")


def conditional_rates(rates: tuple[float, ...]) -> tuple[float, ...]:
    """Per-depth probability of going on given the depth above was accepted: rates[d] / rates[d-1] (0 after a
    zero). e.g. (0.8, 0.4, 0.1) -> (0.8, 0.5, 0.25)."""
    above = (1.0, *rates[:-1])
    return tuple(min(1.0, r / a) if a > 0.0 else 0.0 for r, a in zip(rates, above))


class SyntheticAcceptance:
    """The device side: draws a round's accepted path (see the module docstring). Built once per worker."""

    def __init__(self, rates: tuple[float, ...], seed: int, device):
        import torch

        self.rates = rates
        cond = (1.0, *conditional_rates(rates))  # [S+1]: depth 0 (the root) is always kept
        self.conditional = torch.tensor(cond, dtype=torch.float32, device=device)
        self.seed_base = (int(seed) & 0x7FFFFFFF) << 32  # the round counter fills the low 32 bits
        self.rounds = torch.zeros((), dtype=torch.int64, device=device)  # advanced on the device by each draw
        logger.warning("speculative rounds use %s (a benchmark setting, vLLM's rejection_sample_method="
                       "'synthetic')", describe_synthetic(rates))

    def accept(self, tree, rows, num_steps: int, target_tokens, grammar_masks=None):
        """The round's Acceptance (speculative/verify.py) over `tree` ([P, N]) for page-table `rows` [P]: the path
        drawn at the rates; bonus = target_tokens [P, N] at its last node. With `grammar_masks` ([P*N, words], each
        node's allowed next tokens, runtime/grammar.py) the path takes only nodes their parent's mask allows."""
        import torch

        from spruce.runtime.rng import uniform
        from spruce.speculative.verify import accept_matching

        self.rounds.add_(1)
        depth_ids = torch.arange(num_steps + 1, device=rows.device)  # [S+1]
        positions = rows[:, None] * (num_steps + 1) + depth_ids[None, :]  # [P, S+1]: one stream per (row, depth)
        draws = uniform(self.seed_base + (self.rounds & 0xFFFFFFFF), positions)  # [P, S+1]
        goes_on = draws < self.conditional[None, :]  # [P, S+1]: per depth, whether the path may go on to it
        matches = best_ranked_child(tree.parents, tree.ranks) & goes_on.gather(1, tree.depths)  # [P, N]
        if grammar_masks is not None:
            matches &= grammar_allowed(tree, grammar_masks)
        return accept_matching(tree, matches, target_tokens, num_steps)


def best_ranked_child(parents, ranks):
    """[P, N] bool: node i is the best-ranked (lowest `Tree.ranks`) child of its parent; False for the root.

    parents [P, N] (-1: the root), ranks [P, N] (distinct per row among the drafts). e.g. parents (-1, 0, 0, 1),
    ranks (-1, 1, 0, 2) -> (F, F, T, T): node 2 beats its sibling 1; node 3 is node 1's only child."""
    import torch

    n = parents.shape[1]
    parent_idx = parents.clamp(min=0)
    child_rank = torch.where(parents >= 0, ranks, n)  # the root competes for no parent
    best = torch.full_like(ranks, n).scatter_reduce(1, parent_idx, child_rank, "amin", include_self=True)
    return (parents >= 0) & (ranks == best.gather(1, parent_idx))


def grammar_allowed(tree, masks):
    """[P, N] bool: node i's token is allowed by its parent's grammar mask (masks [P*N, words] int32, bit t of a
    node's mask: token t may follow it; runtime/grammar.py's format). The root's entry is meaningless."""
    import torch

    from spruce.runtime.grammar import WORD_BITS

    p, n = tree.tokens.shape
    words = masks.shape[-1]
    index = tree.parents.clamp(min=0) * words + tree.tokens // WORD_BITS  # [P, N]: the word holding the bit
    word = masks.reshape(p, n * words).gather(1, index)  # [P, N] int32
    return ((word >> (tree.tokens % WORD_BITS).to(torch.int32)) & 1).bool()


def synthetic_acceptance(config, device) -> SyntheticAcceptance | None:
    """The engine's synthetic acceptance (None when `config.speculative` does not ask for it)."""
    spec = config.speculative
    if spec is None or spec.synthetic_acceptance_rates is None:
        return None
    return SyntheticAcceptance(spec.synthetic_acceptance_rates, config.seed, device)
