"""Adaptive speculation (speculative/adaptive.py): the policy on numbers, outputs equal to plain decoding whatever
it picks, a plain step that keeps the draft as current as a prefill would, and tensor parallelism (rank 0's costs,
every rank the same choices) on the bundled demo model."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch

from spruce import LLM, SamplingParams
from spruce.config import EngineConfig, builtin_draft_path, builtin_model_path, make_speculative_config
from spruce.runtime.launch import create_engine
from spruce.speculative import adaptive
from spruce.speculative.adaptive import (CATCH_UP, COLLAPSE_ROUNDS, HYSTERESIS, MEASURED_AFTER, PLAIN,
                                         PROBE_EVERY, AdaptivePolicy, RequestAcceptance)
from spruce.speculative.registry import make_strategy

MODEL, DRAFT = builtin_model_path(), builtin_draft_path()
DRAFT_19M = Path(__file__).resolve().parents[1] / "bench" / "assets" / "pycode-19m-eagle3"  # pycode-19m's trained head
WIDTHS = [4]  # a narrower verify width beside N
ENGINE = dict(page_size=16, max_running_requests=4, context_length=256)
PROMPTS = ["def fib(n):", "import os\nclass A:", "for i in range(", "x = [1, 2"]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)
JOBS = PROMPTS + PROMPTS[:2], [GREEDY] * len(PROMPTS) + [SEEDED] * 2  # one batch: greedy and seeded requests


# --- the policy on numbers ---------------------------------------------------------------------------------------
def policy(plain=1.0, narrow=1.6, full=2.0, buckets=(1, 8), max_accept=3) -> AdaptivePolicy:
    costs = {(c, b): s for b in buckets for c, s in ((PLAIN, plain), (4, narrow), (8, full))}
    return AdaptivePolicy(costs, (4, 8), max_accept)


def measured(p: AdaptivePolicy, ema: dict[int, float]) -> None:
    """Set the acceptance EMAs as if each had read enough request rounds for the choice to use it, every round
    accepting the same (no variance: no confidence term)."""
    p.ema = dict(ema)
    p.square = {w: a * a for w, a in ema.items()}
    p.samples.update({w: MEASURED_AFTER for w in ema})


def rounds(p: AdaptivePolicy, width: int, accepted: list[list[int]], n: int, states=None) -> list[RequestAcceptance]:
    states = states or [RequestAcceptance() for _ in accepted]
    for _ in range(n):
        p.on_round(width, accepted, states)
    return states


def test_an_unmeasured_policy_runs_the_configured_round():
    """Before any round every width is taken to accept S drafts: N's round stays (the cheaper width's gain is
    within the hysteresis) until acceptance is measured."""
    p = policy(narrow=1.95)
    assert p.choose(1, healthy=1, total=1) == 8


def test_the_candidate_with_the_most_tokens_per_second_wins():
    """plain 1 / 1.0 s; width 4: (1 + 1.2) / 1.6; N: (1 + 1.5) / 2.0 at the measured acceptance."""
    p = policy()
    rounds(p, 8, [[1, 1], [2, 2]], MEASURED_AFTER // 2 - 1)  # N's rounds: each width's accepted drafts (4's, 8's)
    assert p.expected_tokens(8, 2, 2) == 2 + 2 * 3  # not yet measured: taken to accept S
    rounds(p, 8, [[1, 1], [2, 2]], 1)
    assert p.ema == {4: 1.5, 8: 1.5}
    assert p.choose(1, 2, 2) == 4  # 2.5 / 1.6 beats 2.5 / 2.0 and 1 / 1.0
    for _ in range(1000):  # (new requests each time: none has collapsed) rounds at 4 say nothing about N
        rounds(p, 4, [[0], [0]], 1)
    assert p.ema[8] == 1.5 and p.ema[4] < 0.1
    assert p.choose(1, 2, 2) == 8  # per request and second: N 2.5 / 2.0, plain 1.0, width 4 ~0.65


def test_hysteresis_keeps_a_candidate_until_another_is_clearly_faster():
    p = policy(plain=1.0, full=2.0)
    measured(p, {4: 0.0, 8: 1.0})  # N: exactly plain's speed
    assert p.choose(1, 1, 1) == 8
    measured(p, {4: 0.0, 8: 2 / HYSTERESIS - 1 - 0.01})  # plain just over HYSTERESIS faster
    assert p.choose(1, 1, 1) == PLAIN
    measured(p, {4: 0.0, 8: 1.0})  # back level: plain stays
    assert p.choose(1, 1, 1) == PLAIN
    measured(p, {4: 0.0, 8: 2 * HYSTERESIS - 1 + 0.01})
    assert p.choose(1, 1, 1) == 8


def test_served_seconds_move_the_cost_table_a_held_up_step_at_most_a_quarter():
    p = policy(plain=1.0)
    p.on_cost(PLAIN, 1, 100.0)  # an engine held up (a stall between two steps): read as 3x the entry
    assert p.costs[(PLAIN, 1)] == pytest.approx(1.25)
    for _ in range(60):  # a table 5x too low (long contexts: padding rows attend to nothing) still converges
        p.on_cost(PLAIN, 1, 5.0)
    assert p.costs[(PLAIN, 1)] == pytest.approx(5.0, rel=1e-3) and p.costs[(PLAIN, 8)] == 1.0


def test_buckets_choose_apart_and_probe_n_on_a_fixed_schedule():
    """Rounds pay at batch 1 (cheap) but not at batch 8; at 8 every PROBE_EVERY-th step is a round at N."""
    costs = {(PLAIN, 1): 1.0, (4, 1): 1.2, (8, 1): 1.3, (PLAIN, 8): 1.0, (4, 8): 3.0, (8, 8): 4.0}
    p = AdaptivePolicy(costs, (4, 8), 3)
    measured(p, {4: 0.5, 8: 1.0})
    picks = [p.choose(8, 8, 8) for _ in range(2 * PROBE_EVERY)]
    assert [i + 1 for i, c in enumerate(picks) if c != PLAIN] == [PROBE_EVERY, 2 * PROBE_EVERY]
    assert picks[PROBE_EVERY - 1] == 8 and p.probes == 2
    assert p.choose(1, 1, 1) == 8


def test_collapsed_requests_count_plain_and_leave_the_engine_wide_acceptance():
    """collapse_below: the fewest drafts at which some round beats plain at some bucket (here 1.6 / 1.0 - 1); a
    request collapses below half of it."""
    p = policy()
    assert p.collapse_below == pytest.approx(0.6)
    states = rounds(p, 8, [[2, 3], [0, 0]], COLLAPSE_ROUNDS - 1)
    assert not any(s.collapsed for s in states)
    rounds(p, 8, [[2, 3], [0, 0]], 1, states)
    assert [s.collapsed for s in states] == [False, True] and p.collapsed == 1
    before = dict(p.ema)
    rounds(p, 8, [[2, 3], [0, 0]], 5, states)  # the collapsed request's zeros no longer pull the EMA down
    assert p.ema[8] > before[8] and p.ema[4] > before[4]
    gain = p.expected_tokens(8, healthy=1, total=1) - 1
    assert p.expected_tokens(8, healthy=1, total=2) == pytest.approx(2 + gain)  # the collapsed request: 1 token


def test_a_request_near_break_even_does_not_collapse_by_chance():
    """collapse_below 0.6: rounds accepting 0, 0, 1, 0 (mean 0.25 after four) then 1, 1, 1, 0 (0.5 after eight),
    and so on, are a request near break-even with an unlucky start: it keeps speculating (its mean, after
    COLLAPSE_ROUNDS, is above half of collapse_below)."""
    p = policy()
    state = RequestAcceptance()
    for a in (0, 0, 1, 0, 1, 1, 1, 0) * (COLLAPSE_ROUNDS // 8):
        p.on_round(8, [[a, a]], [state])
    assert state.rounds == COLLAPSE_ROUNDS and not state.collapsed and p.collapsed == 0


def test_the_choice_depends_on_the_counts_alone():
    """Two policies fed the same rounds choose the same steps (no clock: tensor-parallel ranks agree)."""
    a, b = policy(), policy()
    for i in range(300):
        accepted = [[i % 3, i % 4], [0, i % 2]]
        assert a.choose(8 if i % 2 else 1, 2, 2) == b.choose(8 if i % 2 else 1, 2, 2)
        a.on_round(8, accepted, [RequestAcceptance(), RequestAcceptance()])
        b.on_round(8, accepted, [RequestAcceptance(), RequestAcceptance()])
    assert a.snapshot() == b.snapshot()


# --- engines --------------------------------------------------------------------------------------------------------
def run(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(*JOBS)]


@pytest.fixture(scope="module")
def plain_outputs():
    """The plain engine's tokens for JOBS."""
    return run(LLM(MODEL, **ENGINE))


@pytest.fixture(scope="module")
def adaptive_llm():
    return LLM(MODEL, draft_model=DRAFT, speculative_adaptive=True, speculative_adaptive_widths=WIDTHS, **ENGINE)


def forced(llm, picks):
    """Make the engine's policy answer `picks` (cycled) at every step that asks it; a round over stale drafts waits
    for a catch-up step, as the policy's own rounds do."""
    cycle = itertools.cycle(picks)
    head = [next(cycle)]

    def choose(bucket, healthy, total, drafts_current=True):
        if head[0] not in (PLAIN, CATCH_UP) and not drafts_current:
            return CATCH_UP
        pick, head[0] = head[0], next(cycle)
        return pick

    llm.engine.strategy.policy.choose = choose


def test_outputs_equal_plain_decoding_whatever_the_policy_picks(adaptive_llm, plain_outputs, monkeypatch):
    """Greedy and seeded requests in one batch, the policy forced to cycle through every step kind (plain steps,
    catch-ups, N, the narrower width) so that each follows each and runs twice in a row."""
    monkeypatch.setattr(adaptive_llm.engine.strategy.policy, "choose", None)
    forced(adaptive_llm, [PLAIN, 8, PLAIN, PLAIN, 4, 4, 8, 8, CATCH_UP, CATCH_UP, PLAIN, 4, CATCH_UP, 8])
    assert run(adaptive_llm) == plain_outputs


def recorded(monkeypatch, strategy) -> list:
    """What each decode step ran (strategy.choose's answers), in order."""
    ran, choose = [], strategy.choose

    def record(requests):
        ran.append(choose(requests))
        return ran[-1]

    monkeypatch.setattr(strategy, "choose", record)
    return ran


def test_collapsed_requests_run_a_plain_engines_step(adaptive_llm, plain_outputs, monkeypatch):
    """Every request collapses after its COLLAPSE_ROUNDS rounds (here 2: a request of 16 tokens may run fewer than
    the default); from then on the batch runs the draft-free plain step, and the output is still plain decoding's."""
    strategy = adaptive_llm.engine.strategy
    monkeypatch.setattr(strategy.policy, "collapse_below", float("inf"))
    monkeypatch.setattr(adaptive, "COLLAPSE_ROUNDS", 2)
    monkeypatch.setattr(strategy.policy, "choose", None)
    forced(adaptive_llm, [8])
    ran = recorded(monkeypatch, strategy)
    assert run(adaptive_llm) == plain_outputs
    assert ran[0] is strategy.worker and ran[-1] is strategy.plain
    assert strategy.drafted_plain not in ran


def test_a_catch_up_step_keeps_the_draft_as_a_prefill_would(monkeypatch):
    """After catch-up steps (plain steps with the draft's extend), the row's draft state (step-0 top-K, hidden) is
    what a fixed engine's prefill of the same tokens leaves: the draft's KV covers every position the steps
    committed, at its own position."""
    kw = dict(ENGINE, max_running_requests=1, disable_overlap_schedule=True)
    llm = LLM(MODEL, draft_model=DRAFT, speculative_adaptive=True, **kw)
    forced(llm, [CATCH_UP])
    eng = llm.engine
    prompt = eng.tokenizer.encode(PROMPTS[0])
    rid = eng.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    while len(eng.requests[rid].output_ids) < 10:
        eng.step()
    q = eng.requests[rid]
    worker = eng.strategy.worker
    got = worker.topk_ids[q.row].clone(), worker.hidden[q.row].clone()
    fixed = LLM(MODEL, draft_model=DRAFT, **kw)
    ref_rid = fixed.engine.add_request(prompt + q.output_ids[:-1], SamplingParams(max_tokens=1))
    while fixed.engine.has_unfinished():
        out = fixed.engine.step()
    assert [o.token_ids for o in out if o.request_id == ref_rid] == [q.output_ids[-1:]]
    ref = fixed.engine.strategy
    assert torch.equal(got[0], ref.topk_ids[q.row])
    torch.testing.assert_close(got[1], ref.hidden[q.row], rtol=1e-4, atol=1e-4)


def test_served_decode_steps_report_their_seconds(adaptive_llm, plain_outputs, monkeypatch):
    """The engine times each decode step that follows a decode step (under overlap: from the previous one's results
    to its own) and the policy moves the step's cost entry; a step after a prefill reports nothing."""
    strategy = adaptive_llm.engine.strategy
    seen, on_cost = [], strategy.policy.on_cost
    monkeypatch.setattr(strategy.policy, "on_cost", lambda c, b, sec: (seen.append((c, b, sec)), on_cost(c, b, sec)))
    reported = []
    on_round = strategy.on_round
    monkeypatch.setattr(strategy, "on_round", lambda *a: (reported.append(a[3]), on_round(*a)))
    assert run(adaptive_llm) == plain_outputs
    assert reported[0] is None and any(r is not None for r in reported)  # the first decode step follows prefills
    assert seen and all(c in (PLAIN, 4, 8) and sec > 0 for c, _, sec in seen)


def test_stats_show_the_policy(adaptive_llm):
    stats = adaptive_llm.engine.stats()["adaptive"]
    assert set(stats["accept_ema"]) <= {4, 8} and stats["step_seconds"]
    assert set(k.split("@")[0] for k in stats["step_seconds"]) == {"0", "4", "8"}


# --- tensor parallelism -----------------------------------------------------------------------------------------------
def skewed_costs(engine, rank: int) -> None:
    """Every rank measures again, rank 1 with costs that make rounds win and the others with costs that make plain
    steps win once acceptance is measured: only rank 0's table on every rank keeps them choosing alike."""
    def fake_time(launcher, rows, max_kv, cuda):
        plain = not launcher.speculative
        return (1.0 if plain else 0.2) if rank == 1 else (0.2 if plain else 1.0)

    adaptive._time_step, kept = fake_time, adaptive._time_step
    try:
        engine.strategy.measure_costs()
    finally:
        adaptive._time_step = kept
    engine.strategy.policy.measured_after = 16  # the short run's rounds measure acceptance


def test_tp2_adaptive_equals_plain_decoding(plain_outputs):
    """tp 2 with rank-skewed start-up costs: the ranks share rank 0's table (their choices, rounds then plain steps,
    stay alike: a difference would hang or fail their collectives), and the tokens are plain decoding's."""
    spec = make_speculative_config(None, str(DRAFT), model=str(MODEL), adaptive=True)
    config = EngineConfig(model=str(MODEL), tp_size=2, speculative=spec, **ENGINE)
    llm = LLM.from_engine(create_engine(config, functools.partial(skewed_costs), make_strategy=make_strategy))
    try:
        assert run(llm) == plain_outputs
        chosen = llm.engine.strategy.policy.chosen
        llm.engine.check_no_leaks()
    finally:
        llm.shutdown()
    assert chosen[PLAIN] > 0 and chosen[8] > 0


@pytest.mark.gpu
def test_switching_under_cuda_graphs_equals_plain_decoding(pycode19m, heldout_prompts, monkeypatch):
    """On the GPU with graphs (float32: no bf16 near-ties): plain steps, catch-ups and rounds at N and at a narrower
    width, forced in turn, give plain decoding's greedy tokens, and rounds after plain steps accept
    about as much as a fixed engine's rounds (a draft left stale by the plain steps' graphs would not)."""
    kw = dict(device="cuda", dtype="float32", max_running_requests=8, page_size=16)
    prompts = heldout_prompts[:8]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    want = [o.token_ids for o in LLM(pycode19m, **kw).generate(prompts, params)]
    fixed = LLM(pycode19m, draft_model=str(DRAFT_19M), **kw)
    assert [o.token_ids for o in fixed.generate(prompts, params)] == want
    llm = LLM(pycode19m, draft_model=str(DRAFT_19M), speculative_adaptive=True, speculative_adaptive_widths=[4], **kw)
    n = llm.engine.limits.num_draft_tokens
    forced(llm, [PLAIN, n, PLAIN, PLAIN, n, 4])
    strategy = llm.engine.strategy
    ran = recorded(monkeypatch, strategy)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert {step.tree_width for step in ran} == {1, 4, n} and strategy.drafted_plain in ran
    assert llm.engine.runner.graphs.count > fixed.engine.runner.graphs.count
    accept = llm.engine.stats()["spec"]["mean_accept_length"]
    assert accept > 0.8 * fixed.engine.stats()["spec"]["mean_accept_length"], accept
