"""Synthetic acceptance (speculative/synthetic.py): drafts accepted at configured rates, for chains and trees.

The draw tests run the device-side draw on hand-built trees over thousands of (row, round) samples and compare the
accept-length distribution against the one the rates give (chi-square at p ~ 1e-4: a wrong rate fails); the engine
tests run the bundled demo model with its EAGLE-3 head and check what every run reports.
"""

from __future__ import annotations

import logging

import pytest
import torch

from spruce import SamplingParams
from spruce.config import (builtin_draft_path, builtin_model_path, describe_synthetic, make_speculative_config,
                           mean_acceptance_length, rates_for_length)
from spruce.errors import ConfigError
from spruce.speculative.synthetic import SyntheticAcceptance, conditional_rates
from spruce.speculative.tree import Tree
from stats import matches_distribution

ROWS = 2048  # rows per draw; ROUNDS draws: 16k samples of a round's accept length
ROUNDS = 8


def length_distribution(rates: tuple[float, ...], depth: int | None = None) -> list[float]:
    """P(a round accepts a drafts), a = 0..S, for unconditional `rates` over a path that reaches `depth`."""
    s = len(rates)
    u = [1.0, *rates[: depth if depth is not None else s]] + [0.0] * (s + 1)
    return [u[a] - u[a + 1] for a in range(s + 1)]


def chain_tree(rows: int, steps: int) -> Tree:
    """Each row: root 0 -> 1 -> ... -> S (ranks = depth - 1)."""
    n = steps + 1
    parents = torch.arange(-1, steps)[None, :].expand(rows, n).contiguous()
    depths = torch.arange(n)[None, :].expand(rows, n).contiguous()
    tokens = torch.arange(100, 100 + n)[None, :].expand(rows, n).contiguous()
    return Tree(tokens=tokens, parents=parents, depths=depths, masks=torch.zeros(rows, n, 1, dtype=torch.int64),
                ranks=depths - 1)


def branching_tree(rows: int) -> Tree:
    """Each row, 8 nodes (S = 5): the best-ranked branch stops at depth 3, a worse one goes on to depth 4.

        node: 0  1  2  3  4  5  6  7
      parent: -  0  0  1  1  3  4  6      depth 1: 1 (rank 0), 2 (rank 1); depth 2: 3 (rank 2), 4 (rank 3)
        rank: -  0  1  2  3  4  5  6      depth 3: 5 (child of 3, rank 4), 6 (child of 4); depth 4: 7 (child of 6)
    The best-ranked path is 0 -> 1 -> 3 -> 5 (depth 3)."""
    parents = torch.tensor([-1, 0, 0, 1, 1, 3, 4, 6])
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 3, 4])
    ranks = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6])
    tokens = torch.arange(200, 208)
    rep = lambda t: t[None, :].expand(rows, 8).contiguous()  # noqa: E731
    return Tree(tokens=rep(tokens), parents=rep(parents), depths=rep(depths),
                masks=torch.zeros(rows, 8, 1, dtype=torch.int64), ranks=rep(ranks))


def draw_lengths(sampler: SyntheticAcceptance, tree: Tree, steps: int, rounds: int = ROUNDS):
    """Accept-length counts [S+1] over `rounds` draws of every row, and the last draw's Acceptance."""
    rows = torch.arange(tree.tokens.shape[0])
    target = torch.full_like(tree.tokens, 7)
    counts = torch.zeros(steps + 1, dtype=torch.int64)
    for _ in range(rounds):
        acc = sampler.accept(tree, rows, steps, target)
        counts += torch.bincount(acc.accept_lens, minlength=steps + 1)
    return counts.tolist(), acc


def test_length_resolves_to_the_minimum_variance_schedule():
    assert rates_for_length(3.5, 5) == (1.0, 1.0, 0.5, 0.0, 0.0)
    assert rates_for_length(1.0, 3) == (0.0, 0.0, 0.0)
    assert rates_for_length(6.0, 5) == (1.0,) * 5
    assert rates_for_length(2.6, 3) == pytest.approx((1.0, 0.6, 0.0))
    assert conditional_rates((0.8, 0.4, 0.1)) == pytest.approx((0.8, 0.5, 0.25))
    assert conditional_rates((0.5, 0.0, 0.0)) == (0.5, 0.0, 0.0)


@pytest.mark.parametrize("kwargs, words", [
    (dict(synthetic_acceptance_length=7.0), "in [1, 6]"),
    (dict(synthetic_acceptance_length=0.5), "in [1, 6]"),
    (dict(synthetic_acceptance_length=float("nan")), "in [1, 6]"),
    (dict(synthetic_acceptance_rates=[0.9, 0.8]), "must be 5 numbers"),
    (dict(synthetic_acceptance_rates=[0.5, 0.6, 0.2, 0.1, 0.0]), "depth 2 exceeds"),
    (dict(synthetic_acceptance_rates=[1.2, 0.6, 0.2, 0.1, 0.0]), "in [0, 1]"),
    (dict(synthetic_acceptance_rates=[0.9] * 5, synthetic_acceptance_length=3.0), "not both"),
])
def test_bad_settings_are_refused_naming_them(kwargs, words):
    with pytest.raises(ConfigError, match=r"synthetic|both") as e:
        make_speculative_config("EAGLE3", str(builtin_draft_path()), 5, 1, 6, **kwargs)
    assert words in str(e.value)


def test_synthetic_acceptance_needs_a_draft():
    with pytest.raises(ConfigError, match="speculative_synthetic_acceptance_length need a draft model"):
        make_speculative_config(None, None, synthetic_acceptance_length=3.0)


def test_never_on_by_default():
    spec = make_speculative_config("EAGLE3", str(builtin_draft_path()), 5, 1, 6)
    assert spec.synthetic_acceptance_rates is None and describe_synthetic(None) == "off"


@pytest.mark.parametrize("rates", [(0.9, 0.7, 0.5, 0.3, 0.1), rates_for_length(3.5, 5), (0.6, 0.6, 0.6, 0.0, 0.0)])
def test_a_chain_accepts_at_the_rates(rates):
    sampler = SyntheticAcceptance(rates, seed=0, device="cpu")
    counts, acc = draw_lengths(sampler, chain_tree(ROWS, 5), 5)
    assert matches_distribution(counts, length_distribution(rates)), counts
    mean = 1 + sum(a * c for a, c in enumerate(counts)) / sum(counts)
    assert mean == pytest.approx(mean_acceptance_length(rates), abs=0.05)
    # the same counts do not pass for a wrong rate (the rates read as conditional ones, or the first one off by 0.05)
    wrong = [tuple(torch.tensor(rates).cumprod(0).tolist()), (rates[0] - 0.05, *rates[1:])]
    assert not any(matches_distribution(counts, length_distribution(w)) for w in wrong if w != rates)
    # the path is the chain's prefix and the bonus the target's choice after its last node
    assert torch.equal(acc.path[:, 1], torch.where(acc.accept_lens >= 1, 1, 0))
    assert bool((acc.bonus == 7).all())


def test_a_tree_accepts_along_its_best_ranked_branch():
    rates = (0.9, 0.7, 0.5, 0.3, 0.1)
    sampler = SyntheticAcceptance(rates, seed=3, device="cpu")
    counts, acc = draw_lengths(sampler, branching_tree(ROWS), 5)
    assert counts[4] == counts[5] == 0  # the best-ranked branch ends at depth 3, though a worse one goes deeper
    assert matches_distribution(counts, length_distribution(rates, depth=3)), counts
    deepest = acc.accept_lens == 3
    assert bool(deepest.any()) and bool((acc.path[deepest] == torch.tensor([0, 1, 3, 5, 5, 5])).all())


def test_a_grammar_refusing_a_node_ends_the_path_there():
    from spruce.runtime.grammar import WORD_BITS

    tree = chain_tree(4, 5)  # tokens 100..105
    words = -(-128 // WORD_BITS)
    masks = torch.full((4 * 6, words), -1, dtype=torch.int32)  # every token allowed after every node ...
    token = 102  # ... but node 2's token after node 1, in rows 0 and 2
    for row in (0, 2):
        masks[row * 6 + 1, token // WORD_BITS] &= ~(1 << (token % WORD_BITS))
    sampler = SyntheticAcceptance((1.0,) * 5, seed=0, device="cpu")
    acc = sampler.accept(tree, torch.arange(4), 5, torch.zeros_like(tree.tokens), masks)
    assert acc.accept_lens.tolist() == [1, 5, 1, 5]
    assert sampler.accept(tree, torch.arange(4), 5, torch.zeros_like(tree.tokens)).accept_lens.tolist() == [5] * 4


def test_draws_differ_between_rows_and_rounds_and_follow_the_seed():
    rates = (0.5,) * 5
    tree = chain_tree(64, 5)
    rows = torch.arange(64)
    target = torch.zeros_like(tree.tokens)
    a = SyntheticAcceptance(rates, seed=1, device="cpu")
    first, second = (a.accept(tree, rows, 5, target).accept_lens for _ in range(2))
    assert not torch.equal(first, second) and len(set(first.tolist())) > 1
    again = SyntheticAcceptance(rates, seed=1, device="cpu").accept(tree, rows, 5, target).accept_lens
    other = SyntheticAcceptance(rates, seed=2, device="cpu").accept(tree, rows, 5, target).accept_lens
    assert torch.equal(first, again) and not torch.equal(first, other)


# --- the engine -------------------------------------------------------------------------------------------------

PROMPTS = ["def fib(n):\n    ", "import os\n", "class Node:\n    def __init__(self):\n"]


def run_engine(caplog, **spec):
    from spruce import LLM

    with caplog.at_level(logging.WARNING, logger="spruce.speculative.synthetic"):
        llm = LLM(builtin_model_path(), draft_model=builtin_draft_path(), max_running_requests=8, **spec)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    counts = [sum(c) for c in zip(*(o.spec_stats["accept_length_counts"] for o in outs))]
    return llm, counts, caplog.text


@pytest.fixture(scope="module")
def chain_run():
    """A chain of 5 at mean length 3.5 (rounds accept 2 or 3 drafts, half the time each): (llm, counts, log)."""
    records = []  # the start-up warning (a module-scoped fixture cannot use caplog)
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("spruce.speculative.synthetic")
    log.addHandler(handler)
    try:
        from spruce import LLM

        llm = LLM(builtin_model_path(), draft_model=builtin_draft_path(), max_running_requests=8,
                  speculative_num_steps=5, speculative_eagle_topk=1, speculative_num_draft_tokens=6,
                  speculative_synthetic_acceptance_length=3.5)
    finally:
        log.removeHandler(handler)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    counts = [sum(c) for c in zip(*(o.spec_stats["accept_length_counts"] for o in outs))]
    return llm, counts, "\n".join(records)


def test_engine_chain_accepts_at_the_configured_length_and_says_so(chain_run):
    llm, counts, log = chain_run
    assert counts[0] == counts[1] == counts[4] == counts[5] == 0 and counts[2] > 0 and counts[3] > 0
    assert matches_distribution(counts, length_distribution(rates_for_length(3.5, 5))), counts
    info = llm.engine.info()["synthetic_acceptance"]
    assert "rates=1,1,0.5,0,0" in info and "not the target's" in info
    assert "synthetic acceptance rates=1,1,0.5,0,0" in log and "not the target's" in log


def test_server_info_and_metrics_name_it(chain_run):
    import httpx
    from server_util import ServerThread

    with ServerThread(chain_run[0].engine) as srv:
        info = httpx.get(f"{srv.base_url}/server_info", timeout=30).json()
        metrics = httpx.get(f"{srv.base_url}/metrics", timeout=30).text
    assert info["speculative_synthetic_acceptance_rates"] == [1.0, 1.0, 0.5, 0.0, 0.0]
    assert info["speculative_synthetic_acceptance_length"] == 3.5
    assert 'synthetic_acceptance="synthetic acceptance rates=1,1,0.5,0,0' in metrics


def test_engine_tree_accepts_along_its_best_branch(caplog):
    # a tree (K=4, N=8) at per-depth rates (1, 0.5, 0, ...): every round accepts 1 or 2 drafts, half the time each
    llm, counts, log = run_engine(caplog, speculative_num_steps=5, speculative_eagle_topk=4,
                                  speculative_num_draft_tokens=8,
                                  speculative_synthetic_acceptance_rates=[1.0, 0.5, 0.0, 0.0, 0.0])
    assert counts[0] == 0 and sum(counts[3:]) == 0
    assert matches_distribution(counts, length_distribution((1.0, 0.5, 0.0, 0.0, 0.0))), counts
    assert "rates=1,0.5,0,0,0" in llm.engine.info()["synthetic_acceptance"] and "rates=1,0.5,0,0,0" in log


def test_command_line_flags_reach_the_engine_and_need_a_draft(capsys):
    from spruce.cli import build_parser
    from spruce.cli_args import draft_path, engine_kwargs

    parser = build_parser()
    base = ["generate", "--prompt", "x", "--speculative-draft-model-path", str(builtin_draft_path())]
    kw = engine_kwargs(parser.parse_args(base + ["--speculative-synthetic-acceptance-rates", "1,0.5,0,0,0",
                                                 "--load-format", "dummy"]))
    assert kw["speculative_synthetic_acceptance_rates"] == (1.0, 0.5, 0.0, 0.0, 0.0)
    assert kw["speculative_synthetic_acceptance_length"] is None and kw["load_format"] == "dummy"
    kw = engine_kwargs(parser.parse_args(base + ["--speculative-synthetic-acceptance-length", "3"]))
    assert kw["speculative_synthetic_acceptance_length"] == 3.0
    assert engine_kwargs(parser.parse_args(base))["speculative_synthetic_acceptance_length"] is None
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--speculative-synthetic-acceptance-rates", "1,half"])
    assert "expected comma-separated numbers such as 0.9,0.7,0.5, got '1,half'" in capsys.readouterr().err
    no_draft = parser.parse_args(["generate", "--prompt", "x", "--model", str(builtin_model_path()),
                                  "--speculative-synthetic-acceptance-length", "3"])
    with pytest.raises(ConfigError, match="--speculative-synthetic-acceptance-length"):
        draft_path(no_draft)


def test_latency_bench_runs_at_the_synthetic_length_and_records_it(tmp_path):
    import json

    from spruce.cli import main

    rc = main(["bench", "latency", "--model", str(builtin_model_path()), "--draft", str(builtin_draft_path()),
               "--device", "cpu", "--dtype", "float32", "--batch-sizes", "2", "--input-len", "8", "--output-len", "13",
               "--num-prompts", "2", "--spec", "3,1,4", "--no-plain", "--graphs", "off", "--repeats", "1",
               "--synthetic-acceptance-length", "3", "--out-dir", str(tmp_path)])
    assert rc == 0
    (path,) = tmp_path.glob("latency-*.json")
    res = json.loads(path.read_text())
    (run,) = res["figures"]["runs"]
    assert res["config"]["synthetic_acceptance_length"] == 3.0
    assert run["synthetic_acceptance"].startswith("synthetic acceptance rates=1,1,0 (mean length 3)")
    assert run["spec"]["mean_accept_length"] == 3.0  # rates (1, 1, 0): every round accepts exactly 2 drafts
