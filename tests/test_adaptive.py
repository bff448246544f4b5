"""Adaptive speculation in the engine: switching between speculative rounds and plain steps mid-request changes no
token (greedy and seeded sampling equal plain decoding, K 1/4, pages 1/16, overlap on and off); a plain step runs
no draft forward, and the catch-up before a round leaves the draft exactly where rounds would have (the round
accepts what a round from a fresh prefill of the same text accepts, after lags of one to many plain steps, across
pages); the prefix cache only takes pages whose draft KV is valid; the measured costs and acceptance drive the
choice, reported in /metrics.

Target: the bundled pycode-6m. Drafts: random checkpoints with the oracle wrapper (tests/oracle_draft.py), and the
bundled trained EAGLE-3 head where real acceptance matters. Start-up timing is replaced by a fixed table
(`fixed_costs`), so the choice does not depend on this machine's speed.
"""

from __future__ import annotations

import collections
import itertools
import time
from pathlib import Path

import pytest
import torch

from spruce import LLM, SamplingParams, limits
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.errors import ConfigError
from spruce.server.metrics import Metrics
from spruce.speculative import adaptive
from spruce.speculative.adaptive_policy import PLAIN, SPECULATIVE, AdaptivePolicy, Decision
from spruce.speculative.eagle_worker import EagleWorker
from spruce.speculative.strategy import PlainDecoding
from checkpoints import write_eagle3_checkpoint
from conftest import assert_no_leaks
from oracle_draft import install_oracle
from test_overlap import PROMPTS as OVERLAP_PROMPTS

TARGET = builtin_model_path()
PROMPTS = OVERLAP_PROMPTS[:4]
MAX_NEW = 16


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("drafts") / "eagle3", TARGET, seed=4))


@pytest.fixture(scope="module")
def reference():
    """Plain decoding (no draft) of every prompt under the given parameters (computed once per parameters)."""
    llm = LLM(TARGET, page_size=16, max_running_requests=8)
    done = {}

    def generate(params):
        key = repr(params)
        if key not in done:
            done[key] = llm.generate(PROMPTS, params)
        return done[key]

    return generate


def fixed_costs(monkeypatch, plain: float = 1.0, spec: float = 2.0) -> None:
    """Device timing replaced: a plain step costs `plain` seconds, a round `spec`, at every batch size, with no
    launch time (the start-up table; online device samples are dropped)."""
    monkeypatch.setattr(adaptive, "_time_step", lambda strategy, rows, max_kv, cuda:
                        (plain if isinstance(strategy, PlainDecoding) else spec, 0.0))
    monkeypatch.setattr(AdaptivePolicy, "measured", lambda self, *a, **kw: None)


def force(llm, pattern: list[int]) -> list[str]:
    """Override the policy's choice with `pattern` (1: speculate), cycled; returns the log of choices made. An
    entry may be served by the fast path (`AdaptivePolicy.repeat`) where the last decision stands and is the same
    choice. No request detaches (a forced round may come at any step)."""
    policy = llm.engine.strategy.policy
    decide, repeat, log = policy.decide, policy.repeat, []

    def forced(requests, *args, **kw):
        d = decide(requests, *args, **kw)
        d.choice = SPECULATIVE if pattern[len(log) % len(pattern)] else PLAIN
        log.append(d.choice)
        return d

    def forced_repeat(choice, batch_size):
        wanted = SPECULATIVE if pattern[len(log) % len(pattern)] else PLAIN
        if choice != wanted or not repeat(choice, batch_size):
            return False
        log.append(choice)
        return True

    policy.decide, policy.repeat = forced, forced_repeat
    policy.detach_blocker = lambda batch_size: "model_choice"
    policy.stand_ahead = lambda batch_size: (0, 0, 0)  # every step asks (no standing steps taken ahead)
    return log


def adaptive_llm(draft, k=4, s=3, n=8, page=16, oracle_refs=None, **kw) -> LLM:
    llm = LLM(TARGET, page_size=page, max_running_requests=8, draft_model=draft, speculative_num_steps=s,
              speculative_eagle_topk=k, speculative_num_draft_tokens=n, speculative_adaptive=True, **kw)
    if oracle_refs is not None:
        oracle = install_oracle(llm, 0.8)
        for o in oracle_refs:
            oracle.add_reference(o.prompt_token_ids, o.token_ids)
    return llm


GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def mixed_params() -> list[SamplingParams]:
    """Greedy, greedy with logprobs, seeded top-p sampling, and a short greedy one (ends mid-round)."""
    return [GREEDY, SamplingParams(max_tokens=MAX_NEW, logprobs=2, ignore_eos=True),
            SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=5, ignore_eos=True)]


@pytest.mark.parametrize("k,s,n,page,overlap", [(1, 3, 4, 1, True), (4, 2, 6, 16, False)])
def test_switching_mid_request_equals_plain_decoding(monkeypatch, draft, reference, k, s, n, page, overlap):
    fixed_costs(monkeypatch)
    params = mixed_params()
    want = reference(params)
    llm = adaptive_llm(draft, k, s, n, page, oracle_refs=reference(GREEDY), disable_overlap_schedule=not overlap)
    log = force(llm, [1, 0, 0, 1, 1, 0, 1])  # every transition: spec->plain, plain->plain, plain->spec, spec->spec
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got[1].logprobs, want[1].logprobs):  # plain steps' and rounds' logprobs are the target's
        assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    assert {PLAIN, SPECULATIVE} <= set(log)
    stats = llm.engine.stats()
    assert stats["spec"]["rounds"] > 0 and stats["adaptive"]["chosen"][PLAIN] > 0
    assert stats["spec"]["mean_accept_length"] > 1.5  # the rounds after plain steps still accept (oracle 0.8)
    assert_no_leaks(llm)


@pytest.mark.parametrize("pattern,page,overlap,window", [([0, 0, 1, 0, 1], 16, True, 256),
                                                         ([0] * 7 + [1, 1], 4, True, 256),
                                                         ([0] * 5 + [1], 4, False, 256),
                                                         ([0] * 10 + [1], 4, True, 3)])
def test_catch_up_leaves_the_draft_where_rounds_would(monkeypatch, pattern, page, overlap, window):
    """With the bundled trained head (real acceptance): after every catch-up (lags of 1, 2, 5 and 7 positions,
    crossing pages of 4; or forced every 3 plain steps by a feature ring of 3) the draft's step-0 state (its hidden
    at the last committed position, which attends to the draft KV of every earlier one) equals a fresh prefill's of
    the same text, and every round that follows plain steps accepts exactly what the first round after that fresh
    prefill accepts."""
    fixed_costs(monkeypatch)
    monkeypatch.setattr(limits, "DRAFT_LAG_WINDOW", window)
    prompt = "def fib(n):\n    "
    llm = LLM(TARGET, draft_model=builtin_draft_path(), speculative_adaptive=True, disable_radix_cache=True,
              page_size=page, disable_overlap_schedule=not overlap)
    force(llm, pattern)
    caught = record_catch_ups(monkeypatch, llm)
    rounds = []  # (committed length before the round, accepted drafts) of each round after a plain step
    resolved, before = llm.engine.strategy.resolved, {}

    def record(step, requests, results, waited_s, **kw):
        speculated = step is not None and step.speculative
        for q, row in zip(requests, results):
            if step is not None and speculated and before.get(q.request_id) == PLAIN:
                rounds.append((q.committed - row[0] - 1, row[0]))
            if step is not None:
                before[q.request_id] = SPECULATIVE if speculated else PLAIN
        resolved(step, requests, results, waited_s, **kw)

    llm.engine.strategy.resolved = record
    out = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    text = out.prompt_token_ids + out.token_ids
    fresh = LLM(TARGET, draft_model=builtin_draft_path(), disable_radix_cache=True)
    assert len(rounds) >= 3 and sum(a for _, a in rounds) > 0
    forced = 10 // window * len(rounds) if window < 10 else 0  # catch-ups before plain steps, at a full ring
    assert len(caught) == len(rounds) + forced == llm.engine.stats()["adaptive"]["catch_ups"]
    for committed, accepted in rounds:
        first = fresh.generate([text[:committed]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
        counts = first.spec_stats["accept_length_counts"]
        assert first.token_ids[0] == text[committed] and counts[accepted] == 1, (committed, accepted, counts)
    assert_caught_up_as_fresh(caught, fresh, text)


def test_start_up_catch_ups_seed_the_catch_up_fits(draft):
    """measure_costs times a small and a large catch-up over the dummy row (16 positions; R requests x 64), and
    they seed the policy's catch-up fits (the CPU's host seconds are 0: the work is the device's there)."""
    llm = LLM(TARGET, draft_model=draft, speculative_adaptive=True, page_size=16, max_running_requests=4)
    policy = llm.engine.strategy.policy
    (small, small_s), (large, large_s) = policy.catch_up_prior["device"]
    assert (small, large) == (16, 4 * 64) and small_s > 0 and large_s > 0
    slope = (large_s - small_s) / (large - small)
    if slope >= 0 and small_s - slope * small >= 0:  # the fit's line runs through both
        assert policy.catch_up_device.predict(small) == pytest.approx(small_s, rel=1e-6)
        assert policy.catch_up_device.predict(large) == pytest.approx(large_s, rel=1e-6)
    elif slope < 0:  # a busy CPU timed the small one slower: flat
        assert policy.catch_up_device.coefficients()[1] == 0.0
    else:  # ... or the large one disproportionately slower: the fixed part clamps at 0
        assert policy.catch_up_device.coefficients()[0] == 0.0
    assert [seconds for _, seconds in policy.catch_up_prior["host"]] == [0.0, 0.0]
    assert_no_leaks(llm)


def lazy_prefills(monkeypatch) -> None:
    """The policy prefers plain steps at every batch size: every prefill that may be lazy is (and none detaches)."""
    monkeypatch.setattr(AdaptivePolicy, "steady_choice", lambda self, batch_size: PLAIN)
    monkeypatch.setattr(AdaptivePolicy, "detach_blocker", lambda self, batch_size: "unsettled")


@pytest.mark.parametrize("page,overlap", [(16, True), (4, False)])
def test_lazy_prefill_catches_up_where_an_eager_one_is(monkeypatch, page, overlap):
    """A prefill while the policy prefers plain steps runs the target alone (its features go to the ring) and the
    draft lags by the prompt; the first round catches it up over prompt and plain steps at once. With the trained
    head: the caught-up draft state equals a fresh (eager) prefill's of the same text, the rounds accept exactly what
    rounds after a fresh prefill accept, and the tokens are plain decoding's."""
    fixed_costs(monkeypatch)
    lazy_prefills(monkeypatch)
    prompt = "def fib(n):\n    "
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = LLM(TARGET, page_size=page).generate([prompt], params)[0]
    llm = LLM(TARGET, draft_model=builtin_draft_path(), speculative_adaptive=True, disable_radix_cache=True,
              page_size=page, disable_overlap_schedule=not overlap)
    force(llm, [0, 0, 1, 0, 1])
    caught = record_catch_ups(monkeypatch, llm)
    lags = []
    extend = llm.engine.strategy.worker.extend_draft
    monkeypatch.setattr(llm.engine.strategy.worker, "extend_draft", lambda *a: lags.append("eager") or extend(*a))
    got = llm.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids
    assert lags == []  # the prompt's draft extend never ran at prefill: the catch-ups did it
    assert llm.engine.stats()["adaptive"]["prompt_draft_seconds"] is None  # so it priced no prompt
    text = got.prompt_token_ids + got.token_ids
    prompt_len = len(got.prompt_token_ids)
    assert caught and caught[0][0] == prompt_len + 2  # the first catch-up: the prompt and two plain steps
    fresh = LLM(TARGET, draft_model=builtin_draft_path(), disable_radix_cache=True, page_size=page)
    assert_caught_up_as_fresh(caught, fresh, text)
    assert llm.engine.stats()["spec"]["rounds"] >= 3
    assert_no_leaks(llm)


@pytest.mark.parametrize("reason,eager", [("model", True), ("probe", False)])
def test_a_prefill_under_standing_rounds_extends_its_draft_at_once(monkeypatch, reason, eager):
    """While rounds are the last decision's model choice, a prefill extends its draft at once without asking the
    steady choice (here: plain steps, which would make it lazy); after a probe of rounds it asks, and is lazy."""
    lazy_prefills(monkeypatch)
    llm = LLM(TARGET, draft_model=builtin_draft_path(), speculative_adaptive=True, disable_radix_cache=True,
              page_size=16)
    strategy = llm.engine.strategy
    strategy.last_decision = Decision(bucket=1, batch_size=1, choice=SPECULATIVE, reason=reason,
                                      tokens_per_step={PLAIN: 1.0, SPECULATIVE: 4.0},
                                      step_seconds={PLAIN: 1e-3, SPECULATIVE: 1e-3})
    extends = []
    extend = strategy.worker.extend_draft
    monkeypatch.setattr(strategy.worker, "extend_draft", lambda *a: extends.append(1) or extend(*a))
    llm.engine.add_request("def fib(n):\n    ", SamplingParams(max_tokens=4, ignore_eos=True))
    llm.engine.step()  # the prefill
    assert bool(extends) == eager
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert_no_leaks(llm)


@pytest.mark.parametrize("window", [32, 16])
def test_lazy_prefill_in_a_mixed_batch_equals_plain_decoding(monkeypatch, draft, reference, window):
    """Four requests (greedy, logprobs, seeded sampling, short) prefilled together, three chunks lazy and one not
    (its prompt, 22 tokens, is longer than half the ring), then every switch: the tokens and logprobs are plain
    decoding's, and no page leaks. The ring store takes the eager chunk's features too; with a ring of 16 they wrap
    within their row's ring (22 positions) in one store. (The caught-up draft state itself is checked against a
    fresh prefill's in test_lazy_prefill_catches_up_where_an_eager_one_is.)"""
    fixed_costs(monkeypatch)
    lazy_prefills(monkeypatch)
    monkeypatch.setattr(limits, "DRAFT_LAG_WINDOW", window)
    params = mixed_params()
    want = reference(params)
    llm = adaptive_llm(draft, 4, 2, 6, 16, oracle_refs=reference(GREEDY))
    force(llm, [0, 0, 1, 0, 1, 1])
    calls = []
    extend = llm.engine.strategy.worker.extend_draft
    monkeypatch.setattr(llm.engine.strategy.worker, "extend_draft",
                        lambda chunks, *a: calls.append(len(chunks)) or extend(chunks, *a))
    got = llm.generate(PROMPTS, params)
    assert [len(o.prompt_token_ids) for o in got] == [8, 22, 8, 4]
    assert calls == [1]  # one prefill of four chunks: the 22-token prompt's draft extend ran, the others waited
    policy = llm.engine.strategy.policy  # that extend prices a new request's prompt (one completed by it)
    assert policy.draft_prompt_requests == 1.0 and llm.engine.stats()["adaptive"]["prompt_draft_seconds"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got[1].logprobs, want[1].logprobs):
        assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    assert llm.engine.stats()["spec"]["rounds"] > 0
    assert_no_leaks(llm)


def test_a_catch_up_larger_than_one_forward_is_split(monkeypatch):
    """Four requests lagging 12 positions each (48 pairs) with forwards of at most 32 tokens: the catch-up runs as
    several draft extends, each within Limits.max_tokens_per_forward, and every caught-up draft equals a fresh
    prefill's (found on the H100: 32 requests lagging 2650 positions in all, one extend over a 2048 limit)."""
    fixed_costs(monkeypatch)
    kw = dict(draft_model=builtin_draft_path(), disable_radix_cache=True, page_size=4, max_running_requests=4,
              speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4,
              chunked_prefill_size=32)
    llm = LLM(TARGET, speculative_adaptive=True, **kw)
    budget = llm.engine.runner.limits.max_tokens_per_forward
    assert budget == 32
    force(llm, [0] * 12 + [1])
    caught = record_catch_ups(monkeypatch, llm)
    extends = []
    draft_forward = llm.engine.runner.draft_forward
    monkeypatch.setattr(llm.engine.runner, "draft_forward", lambda batch, *a: extends.append(
        batch.num_tokens) or draft_forward(batch, *a))
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=16, ignore_eos=True))
    want = LLM(TARGET, page_size=4).generate(PROMPTS[:4], SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert len(caught) == 4 and max(extends) <= budget
    fresh = LLM(TARGET, **kw)
    for out, (end, hidden) in zip(outs, caught):
        assert_caught_up_as_fresh([(end, hidden)], fresh, out.prompt_token_ids + out.token_ids)


def record_catch_ups(monkeypatch, llm) -> list[tuple[int, torch.Tensor]]:
    """(committed length, the draft's step-0 hidden) of every request after each catch-up, as they happen."""
    worker, caught = llm.engine.strategy.worker, []
    catch_up = worker.catch_up

    def recording(lagging, ring):
        catch_up(lagging, ring)
        caught.extend((g.end, worker.hidden[g.row].clone()) for g in lagging)

    monkeypatch.setattr(worker, "catch_up", recording)
    return caught


def assert_caught_up_as_fresh(caught, fresh: LLM, text: list[int]) -> None:
    """Each caught-up draft state equals the one `fresh` (a non-adaptive engine) has after prefilling the text."""
    for end, hidden in caught:
        fresh.generate([text[:end]], SamplingParams(max_tokens=1))  # its draft state after the prefill (row 0)
        assert torch.allclose(hidden, fresh.engine.strategy.hidden[0], atol=1e-4), end


def test_nextn_catch_up_on_mla(monkeypatch, pycodemla):
    """NEXTN (the target's MTP layer) on the DeepSeek-V3-architecture fixture: the plain step keeps the final normed
    hidden as the feature, the catch-up extends the MTP layer's latent cache; tokens equal plain decoding and the
    caught-up draft state equals a fresh prefill's."""
    fixed_costs(monkeypatch)
    kw = dict(page_size=4, max_running_requests=4, speculative_algorithm="NEXTN", speculative_num_steps=3,
              speculative_eagle_topk=4, speculative_num_draft_tokens=8, disable_radix_cache=True)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = LLM(pycodemla, page_size=4).generate([PROMPTS[0]], params)[0]
    llm = LLM(pycodemla, speculative_adaptive=True, **kw)
    force(llm, [0, 0, 0, 1])
    caught = record_catch_ups(monkeypatch, llm)
    got = llm.generate([PROMPTS[0]], params)[0]
    assert got.token_ids == want.token_ids and len(caught) >= 3
    assert_caught_up_as_fresh(caught, LLM(pycodemla, **kw), got.prompt_token_ids + got.token_ids)


def test_the_engine_hands_the_policy_the_requests_it_holds(monkeypatch, draft):
    """Four requests at once, two rows: the first decode steps run over two while two wait, and the engine hands
    `choose` the four it holds (running and queued), the load the policy prices a level's ramp at
    (AdaptivePolicy.decide's `held`, tested there)."""
    fixed_costs(monkeypatch)
    llm = LLM(TARGET, page_size=16, max_running_requests=2, draft_model=draft, speculative_num_steps=2,
              speculative_eagle_topk=2, speculative_num_draft_tokens=3, speculative_adaptive=True)
    strategy = llm.engine.strategy
    choose, seen = strategy.choose, []
    monkeypatch.setattr(strategy, "choose", lambda reqs, held: seen.append((len(reqs), held)) or choose(reqs, held))
    llm.generate(PROMPTS[:4], SamplingParams(max_tokens=4, ignore_eos=True))
    assert seen[0] == (2, 4) and seen[-1] == (2, 2)


@pytest.mark.parametrize("overlap", [True, False])
def test_standing_rounds_are_read_in_order_a_few_at_a_time(monkeypatch, draft, overlap):
    """Rounds only (plain steps priced at 100 rounds): every resolved round's (request, accepted drafts) reaches
    AdaptivePolicy.accepted_rounds once, in resolve order; standing rounds are read READ_EVERY at a time, a decided
    round at once with those before it, and nothing is left unread when the policy decides or a snapshot is taken."""
    fixed_costs(monkeypatch, plain=100.0, spec=1.0)
    llm = LLM(TARGET, page_size=16, max_running_requests=4, draft_model=draft, speculative_num_steps=3,
              speculative_eagle_topk=2, speculative_num_draft_tokens=4, speculative_adaptive=True,
              disable_overlap_schedule=not overlap)
    strategy, policy = llm.engine.strategy, llm.engine.strategy.policy
    resolved_rows, read, calls = [], [], []
    resolved, accepted_rounds, decide = strategy.resolved, policy.accepted_rounds, policy.decide

    def on_resolved(step, requests, results, *args, **kw):
        if step is not None and step is not strategy.plain and (step is strategy.worker or step.speculative):
            resolved_rows.extend((q.request_id, row[0]) for q, row in zip(requests, results))
        return resolved(step, requests, results, *args, **kw)

    def on_read(rounds):
        for requests, drafts in rounds:
            read.extend((q.request_id, a) for q, a in zip(requests, drafts))
        calls.append(sum(len(requests) for requests, _ in rounds))
        return accepted_rounds(rounds)

    def on_decide(*args, **kw):
        assert not strategy._unread_rounds  # the policy decides on every round resolved so far
        return decide(*args, **kw)

    monkeypatch.setattr(strategy, "resolved", on_resolved)
    monkeypatch.setattr(policy, "accepted_rounds", on_read)
    monkeypatch.setattr(policy, "decide", on_decide)
    llm.generate(PROMPTS[:4], SamplingParams(max_tokens=48, ignore_eos=True))
    llm.engine.stats()  # a snapshot reads what is left
    assert not strategy._unread_rounds and read == resolved_rows and len(read) > 8 * adaptive.READ_EVERY
    assert max(calls) <= 4 * adaptive.READ_EVERY and max(calls) > 4  # several rounds per read, none over the cap


@pytest.mark.parametrize("spec", [1.0, 100.0])
def test_standing_steps_are_taken_ahead_and_each_counted(monkeypatch, draft, reference, spec):
    """Rounds (spec=1: plain steps priced at 100 rounds) or plain steps (spec=100): after a standing step asks the
    policy (`repeat`), the steps that stand after it are taken without asking (a ticket); the policy still counts
    every decode step once (decided or standing), and the tokens are plain decoding's. (Parks off: plain steps over
    detached requests would run parked, test_parked_steps_*.)"""
    fixed_costs(monkeypatch, plain=100.0 if spec == 1.0 else 1.0, spec=spec)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    llm = LLM(TARGET, page_size=16, max_running_requests=8, draft_model=draft, speculative_num_steps=3,
              speculative_eagle_topk=2, speculative_num_draft_tokens=4, speculative_adaptive=True)
    policy = llm.engine.strategy.policy
    monkeypatch.setattr(policy, "park", lambda d: None)
    asked, repeat = [], policy.repeat
    monkeypatch.setattr(policy, "repeat", lambda choice, batch_size: asked.append(choice) or repeat(choice,
                                                                                                 batch_size))
    outputs = llm.generate(PROMPTS, params)
    decodes = llm.engine.stats()["steps"]["decodes"]
    chosen = llm.engine.strategy.policy.chosen  # read through `policy`: the last ticket replayed
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference(params)]
    assert sum(chosen.values()) == decodes and chosen[SPECULATIVE if spec == 1.0 else PLAIN] > decodes / 2
    assert 0 < len(asked) < decodes / 2  # most standing steps never asked


def test_a_ticket_outlives_its_deciding_steps_resolve_and_the_acceptance_reads(monkeypatch, draft):
    """Standing rounds (no arrivals after the start): the ticket a standing step takes is not ended by the resolve
    of the decided round before it (its cost samples go straight to the policy) nor by the batched acceptance reads
    (the ticket is granted again after them): no standing step asks the policy right after one that was granted
    steps ahead over the same batch."""
    fixed_costs(monkeypatch, plain=100.0, spec=1.0)
    llm = LLM(TARGET, page_size=16, max_running_requests=8, draft_model=draft, speculative_num_steps=3,
              speculative_eagle_topk=2, speculative_num_draft_tokens=4, speculative_adaptive=True)
    strategy = llm.engine.strategy
    policy = strategy.policy
    step, asked = [0], []
    choose, repeat = strategy.choose, policy.repeat
    monkeypatch.setattr(strategy, "choose", lambda *a: step.__setitem__(0, step[0] + 1) or choose(*a))

    def asking(choice, batch_size):
        granted = repeat(choice, batch_size)
        asked.append((step[0], batch_size, granted, policy._reuse_left))
        return granted

    monkeypatch.setattr(policy, "repeat", asking)
    llm.generate(PROMPTS, SamplingParams(max_tokens=64, ignore_eos=True))
    assert llm.engine.stats()["adaptive"]["chosen"][SPECULATIVE] > 4 * adaptive.READ_EVERY
    again = [(a, b) for a, b in zip(asked, asked[1:])
             if b[0] == a[0] + 1 and b[1] == a[1] and a[2] and b[2] and a[3] > 0]
    assert again == []


def test_a_standing_round_never_runs_over_a_lagging_draft(monkeypatch, draft, reference):
    """Rounds stand (a ticket's fast path in `choose`) only while every draft of the batch is current: a request whose
    draft lags (made to lag by two positions here, between standing rounds; served, a lazy prefill's) is caught up by
    a decided round first. Lossless either way (the target verifies), so only `choose`'s answer shows it."""
    fixed_costs(monkeypatch, plain=100.0, spec=1.0)
    llm = adaptive_llm(draft, disable_overlap_schedule=True)
    strategy = llm.engine.strategy
    choose, checked = strategy.choose, []

    def choosing(requests, held=0):
        if strategy._ticket is not None and strategy._ticket.left and len(checked) < 3:
            strategy.add_lag(requests[0], 2)  # as a lazy prefill's chunk would
            step = choose(requests, held)
            assert isinstance(step, adaptive.AdaptiveStep) and step.catch_up_positions == 2, step
            checked.append(step)
            return step
        return choose(requests, held)

    monkeypatch.setattr(strategy, "choose", choosing)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert len(checked) == 3 and all(step.speculative for step in checked)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference(params)]


@pytest.mark.parametrize("window", [5, 8])
def test_the_lag_bound_lets_no_plain_step_run_over_a_full_ring(monkeypatch, draft, reference, window):
    """`choose` lets plain steps stand by a bound of the lags, not a loop over them: with two rows for four
    requests of different lengths (they finish at different steps, which leaves the bound loose, and the later
    ones join mid-run), no standing plain step runs over a lag that fills the ring, a decided plain step catches up
    exactly where one is due, the bound is never below a lag, and the tokens are plain decoding's."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    monkeypatch.setattr(limits, "DRAFT_LAG_WINDOW", window)
    llm = LLM(TARGET, page_size=4, max_running_requests=2, draft_model=draft, speculative_num_steps=3,
              speculative_eagle_topk=2, speculative_num_draft_tokens=4, speculative_adaptive=True,
              disable_overlap_schedule=True)
    strategy = llm.engine.strategy
    choose, seen = strategy.choose, []

    def choosing(requests, held=0):
        before = max(q.draft_lag for q in requests)
        step = choose(requests, held)
        seen.append((before, step, strategy._lag_bound, max(q.draft_lag for q in requests)))
        return step

    monkeypatch.setattr(strategy, "choose", choosing)
    lengths = (7, 19, 11, 16)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [reference(p)[i].token_ids for i, p in enumerate(params)]
    standing = [before for before, step, _, _ in seen if step is strategy.plain]
    decided = [(before, step.catch_up_positions) for before, step, _, _ in seen
               if isinstance(step, adaptive.AdaptiveStep)]
    assert standing and all(before < window for before in standing)
    assert all(not step.speculative for _, step, _, _ in seen if isinstance(step, adaptive.AdaptiveStep))
    assert all((positions > 0) == (before >= window) for before, positions in decided)
    assert any(positions for _, positions in decided)  # the ring filled, and was caught up
    assert all(bound >= after for _, _, bound, after in seen)


@pytest.mark.parametrize("window", [256, 3])
def test_plain_steps_run_no_draft_forward(monkeypatch, draft, reference, window):
    """The model chooses plain (rounds priced at 100 plain steps): the draft runs only for the prompt when it is too
    long to leave to a catch-up (window 3: the ring holds less) and for the catch-ups a full feature ring forces,
    never in a plain step, and the lag grows by one per plain step; with a ring of 256 the prompt's extend could
    wait, and with rounds that far out of reach the request detaches (`AdaptivePolicy.detach_blocker`, no model
    choice yet): the draft never runs and no lag is kept; the plain fast path serves every step that no catch-up
    interrupts (one decision per catch-up, plus the first); a plain step's result rows are a plain engine's two
    columns (accept length 0, the token: no round's padding to read back); the tokens are plain decoding's."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    monkeypatch.setattr(limits, "DRAFT_LAG_WINDOW", window)
    llm = adaptive_llm(draft, disable_overlap_schedule=True)
    runner, policy, calls, decisions = llm.engine.runner, llm.engine.strategy.policy, [], []
    draft_forward, decide = runner.draft_forward, policy.decide
    monkeypatch.setattr(runner, "draft_forward", lambda batch, *a, **kw: calls.append(batch.phase) or
                        draft_forward(batch, *a, **kw))
    monkeypatch.setattr(policy, "decide", lambda *a, **kw: decisions.append(1) or decide(*a, **kw))
    lags, widths = [], set()
    resolved = llm.engine.strategy.resolved

    def record(step, requests, results, waited_s, **kw):
        if step is not None:
            lags.extend(q.draft_lag for q in requests)
            widths.update(len(row) for row in results)
        resolved(step, requests, results, waited_s, **kw)

    llm.engine.strategy.resolved = record
    got = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert got.token_ids == reference(GREEDY)[0].token_ids
    prompt = len(got.prompt_token_ids)
    if prompt <= llm.engine.limits.lazy_prefill_tokens:  # plain preferred from the start: a detached prefill
        assert lags == [0] * (MAX_NEW - 1) and calls == [] and len(decisions) == 1  # the draft never ran
        assert llm.engine.strategy.detached_requests == 1
    else:
        want_lags = [i % window + 1 for i in range(MAX_NEW - 1)]
        catch_ups = sum(lag == 1 for lag in want_lags[1:])
        assert lags == want_lags and len(calls) == 1 + catch_ups and len(decisions) == 1 + catch_ups
    assert llm.engine.stats()["adaptive"]["chosen"] == {PLAIN: MAX_NEW - 1, SPECULATIVE: 0}
    assert widths == {2}


@pytest.mark.parametrize("rounds_pay", [False, True])
def test_an_eager_prefill_ends_standing_plain_steps_only_where_rounds_would_pay(monkeypatch, draft, reference,
                                                                                rounds_pay):
    """Rounds priced at 100 plain steps: a short request runs and ends (its prefill lazy, so the prefix cache
    remembers its prompt), three others decode with standing plain steps, then a fourth arrives whose prompt repeats
    the short one's, so its prefill extends its draft eagerly (its pages may enter the prefix cache). Where rounds do
    not pay even with every draft current (the steady choice is plain), the standing choice goes on over the arrival:
    no decision follows its prefill (each was a decided step's host work). Where they would (the steady choice made
    rounds for this arrival), it ends and the next step decides. Tokens are plain decoding's either way."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    llm = adaptive_llm(draft, page=4, disable_overlap_schedule=True)  # (the short prompt fills pages of 4)
    engine, strategy = llm.engine, llm.engine.strategy
    policy = strategy.policy
    monkeypatch.setattr(policy, "detach_blocker", lambda batch_size: "unsettled")  # requests that may run rounds
    monkeypatch.setattr(policy, "rounds_out_of_reach", lambda batch_size, load=None: False)  # (a repeat: eager)
    decisions, extends = [], []
    decide, extend = policy.decide, strategy.worker.extend_draft
    monkeypatch.setattr(policy, "decide", lambda *a, **kw: decisions.append(1) or decide(*a, **kw))
    monkeypatch.setattr(strategy.worker, "extend_draft", lambda chunks, *a: extends.append(len(chunks)) or
                        extend(chunks, *a))
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[1:]]
    for _ in range(4):  # the prefill, then plain steps that stand
        engine.step()
    assert extends == [] and strategy.last_decision.choice == PLAIN
    decisions.clear()
    if rounds_pay:
        monkeypatch.setattr(policy, "steady_choice", lambda batch_size: SPECULATIVE)
    ids.append(engine.add_request(PROMPTS[0], GREEDY))  # repeats the short request's prompt: extended eagerly
    for _ in range(4):  # its prefill, then four requests' plain steps (batches of 3 and 4 share a cost bucket)
        engine.step()
    assert extends == [1] and bool(decisions) == rounds_pay, (extends, decisions)
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    want = reference(GREEDY)
    assert [outputs[i].token_ids for i in ids] == [w.token_ids for w in want[1:]] + [want[0].token_ids]


def test_lazy_prefills_join_standing_plain_steps(monkeypatch, draft):
    """Rounds priced at 100 plain steps: five requests decode with standing plain steps (a ticket over batches of
    5-8), then two more arrive one after the other, their prefills lazy. Each prefill joins the ticket: it is not
    replayed inside the prefill's launch (whose mean sets how long prefill batching holds arrivals), the standing
    steps after it take the same ticket without asking the policy, and the steady choice is asked once for the
    ticket, not at each arrival. The policy still counts every decode step once, and the prefills among them."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    llm = adaptive_llm(draft, disable_overlap_schedule=True)
    engine, strategy = llm.engine, llm.engine.strategy
    policy = strategy.policy
    monkeypatch.setattr(policy, "park", lambda d: None)  # (the ticket's steps, not a park's)
    replays, steady, asked = [], [], []
    stood, steady_choice, repeat = policy.stood, policy.steady_choice, policy.repeat
    monkeypatch.setattr(policy, "stood", lambda *a: replays.append(len(a[1])) or stood(*a))
    monkeypatch.setattr(policy, "steady_choice", lambda batch_size: steady.append(batch_size) or
                        steady_choice(batch_size))
    monkeypatch.setattr(policy, "repeat", lambda choice, batch_size: asked.append(batch_size) or
                        repeat(choice, batch_size))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for prompt in OVERLAP_PROMPTS[:5]:
        engine.add_request(prompt, params)
    for _ in range(4):  # the prefill, then plain steps that stand
        engine.step()
    ticket = strategy._ticket
    assert ticket is not None and ticket.choice == PLAIN and strategy.last_decision.choice == PLAIN
    replays.clear(), steady.clear(), asked.clear()
    arrivals_before = policy.epochs.current.arrivals
    for prompt in (OVERLAP_PROMPTS[5], "while True:\n    "):
        engine.add_request(prompt, params)
        engine.step()  # its prefill: lazy
        engine.step()  # a plain step over the larger batch, standing
    assert strategy._ticket is ticket and len(ticket.prefills) == 2
    assert replays == [] and asked == [] and len(steady) == 1, (replays, asked, steady)
    decodes = engine.stats()["steps"]["decodes"]
    chosen = strategy.policy.chosen  # read through `policy`: the ticket replayed, its prefills with it
    assert sum(chosen.values()) == decodes and replays and policy.epochs.current.arrivals >= arrivals_before + 2


@pytest.mark.parametrize("page,overlap", [(16, True), (1, False)])
def test_detached_requests_decode_plainly_with_no_draft_state(monkeypatch, draft, reference, page, overlap):
    """Requests that join while the policy lets them detach (`AdaptivePolicy.detachable`) decode as a plain engine
    would, token for token (greedy, logprobs, seeded sampling), with no draft state at all: no draft extend, no
    feature kept in the ring (no store, and every decode step is the detached plain step, whose target keeps no
    features), no catch-up, no round, and their prefills' target forwards keep no draft features either. Fails if
    a detached batch runs the feature-keeping plain step, or a prefill of detached requests keeps EAGLE-3's aux
    features."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    params = mixed_params()
    want = reference(params)
    llm = adaptive_llm(draft, page=page, disable_overlap_schedule=not overlap)
    strategy = llm.engine.strategy
    monkeypatch.setattr(strategy.policy, "detach_blocker", lambda batch_size: None)
    calls = collections.Counter()

    def counted(obj, name, key):
        real = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, **kw: calls.update([key]) or real(*a, **kw))

    counted(strategy.worker, "extend_draft", "extend")
    counted(strategy.worker, "catch_up", "catch_up")
    counted(strategy.worker, "decode", "round")
    counted(strategy.ring, "store", "ring_store")
    counted(strategy.plain, "decode", "plain")
    counted(strategy.detached_plain, "decode", "detached")
    forwards, target_forward = [], strategy.runner.target_forward  # (eager on the CPU: one a step or prefill)
    monkeypatch.setattr(strategy.runner, "target_forward", lambda batch, **kw: forwards.append(kw.get("aux", True))
                        or target_forward(batch, **kw))
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got[1].logprobs, want[1].logprobs):
        assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    assert calls["detached"] > 0 and set(calls) == {"detached"}, calls
    prefills = llm.engine.stats()["steps"]["prefills"]
    assert len(forwards) == calls["detached"] + prefills and set(forwards) == {False}, forwards  # none keeps any
    adaptive_stats = llm.engine.stats()["adaptive"]
    assert adaptive_stats["detached_requests"] == len(PROMPTS) and adaptive_stats["attached_requests"] == {}
    assert_no_leaks(llm)


def test_rounds_wait_for_detached_requests_to_end(monkeypatch, draft, reference):
    """Rounds priced far below plain steps, but the first request joined detached: every step over a batch that
    holds it is plain (reason "detached"), and the second request, which joined with its draft (lazily), gets its
    rounds once the first has ended. Both decode the plain engine's tokens."""
    fixed_costs(monkeypatch, plain=1.0, spec=0.01)
    llm = adaptive_llm(draft, oracle_refs=reference(GREEDY), disable_overlap_schedule=True)
    engine, strategy = llm.engine, llm.engine.strategy
    policy = strategy.policy
    detach = [True]
    monkeypatch.setattr(policy, "detach_blocker", lambda batch_size: None if detach[0] else "probe_waiting")
    monkeypatch.setattr(policy, "steady_choice", lambda batch_size: PLAIN)  # its prefill is lazy
    monkeypatch.setattr(policy, "repeat", lambda choice, batch_size: False)  # every step decides
    decisions, decide = [], policy.decide

    def logged(requests, *a, **kw):
        d = decide(requests, *a, **kw)
        decisions.append((d.choice, d.reason, any(q.detached_at is not None for q in requests)))
        return d

    monkeypatch.setattr(policy, "decide", logged)
    first = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # its prefill: detached
    detach[0] = False
    second = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    want = reference(SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert outs[first].token_ids == want[0].token_ids[:8] and outs[second].token_ids == want[1].token_ids
    blocked = [(choice, reason) for choice, reason, detached in decisions if detached]
    assert blocked and set(blocked) == {(PLAIN, "detached")}, decisions
    assert any(choice == SPECULATIVE for choice, _, detached in decisions if not detached), decisions
    assert sum(outs[first].spec_stats["accept_length_counts"]) == 0 < sum(outs[second].spec_stats[
        "accept_length_counts"])
    adaptive_stats = engine.stats()["adaptive"]  # the second was lazy, kept from detaching (the blocker given)
    assert adaptive_stats["detached_requests"] == 1 and adaptive_stats["attached_requests"] == {"probe_waiting": 1}
    assert_no_leaks(llm)


def test_a_request_with_a_draft_ends_the_detached_plain_steps(monkeypatch, draft):
    """Plain steps stand over a detached request (the detached plain step: no features kept, no lag counted); a
    request that then joins with its draft (lazily) is in the next standing step, which must keep its features and
    count its lag: the feature-keeping plain step runs from there on. Fails if standing steps go on without
    features after it joined."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    llm = adaptive_llm(draft, disable_overlap_schedule=True)
    engine, strategy = llm.engine, llm.engine.strategy
    detach = [True]
    monkeypatch.setattr(strategy.policy, "park", lambda d: None)  # (standing steps, not a park's)
    monkeypatch.setattr(strategy.policy, "detach_blocker",
                        lambda batch_size: None if detach[0] else "probe_waiting")
    ran = []
    for name in ("plain", "detached_plain"):
        plain = getattr(strategy, name)
        real = plain.decode
        monkeypatch.setattr(plain, "decode", lambda *a, name=name, real=real, **kw: ran.append(name) or real(*a, **kw))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    detached = {engine.add_request(p, params) for p in PROMPTS[:3]}
    for _ in range(4):  # their prefill (detached), then plain steps over 3: decided, then standing (cost bucket 4)
        engine.step()
    assert set(ran) == {"detached_plain"} and strategy._ticket is not None and strategy._ticket.hi == 4, ran
    detach[0] = False
    engine.add_request(PROMPTS[3], params)
    engine.step()  # its prefill: lazy, with its draft
    ran.clear()
    for _ in range(3):  # standing steps over the 4, within the ticket's bucket
        engine.step()
    joined = next(q for q in engine.requests.values() if q.request_id not in detached)
    assert ran == ["plain"] * 3 and joined.draft_lag > 3 and joined.detached_at is None, (ran, joined.draft_lag)
    assert strategy.policy.chosen[PLAIN] == engine.stats()["steps"]["decodes"]
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(llm)


def test_prefix_cache_pages_a_detached_request_wrote_lack_draft_kv(monkeypatch):
    """A detached request's pages from its detached prompt chunk on hold no valid draft KV: the prefix cache takes
    them with their target KV alone, and a later request that will run rounds (it cannot join detached) takes none
    of them: its prompt, the first one's whole text plus more, gives the tokens and round-by-round accept lengths of
    the same run without the cache. Its own pages then give the cached ones their draft KV (copied): the same prompt
    once more is served from the cache and still gives those accept lengths (fails if the copy is wrong or missing:
    the draft would read the KV a detached request never wrote)."""
    fixed_costs(monkeypatch)
    kw = dict(draft_model=builtin_draft_path(), speculative_adaptive=True, page_size=4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = LLM(TARGET, **kw)
    monkeypatch.setattr(llm.engine.strategy.policy, "steady_choice", lambda batch_size: PLAIN)
    force(llm, [0])
    detach = [True]
    monkeypatch.setattr(llm.engine.strategy.policy, "detach_blocker",
                        lambda batch_size: None if detach[0] else "probe_waiting")
    a = llm.generate([PROMPTS[1]], params)[0]
    cache = llm.engine.scheduler.prefix_cache
    assert llm.engine.stats()["adaptive"]["detached_requests"] == 1
    held = cache.match(a.prompt_token_ids + a.token_ids)
    assert len(held) > 2 and cache.drafted(held) == 0  # (its first chunk was detached: no page has draft KV)
    b_prompt = a.prompt_token_ids + a.token_ids + llm.tokenizer.encode("\n\n\ndef")
    detach[0] = False
    force(llm, [1])
    got = [llm.generate([b_prompt], params)[0] for _ in range(2)]
    base = LLM(TARGET, disable_radix_cache=True, **kw)
    force(base, [1])
    want = _round_counts(base, [b_prompt], params)
    assert [(o.token_ids, o.spec_stats["accept_length_counts"]) for o in got] == want * 2
    assert got[0].num_cached_tokens == 0 and got[1].num_cached_tokens > len(a.prompt_token_ids)
    assert cache.drafted(cache.match(b_prompt)) == len(cache.match(b_prompt))
    assert_no_leaks(llm)


def test_detaching_is_judged_at_the_requests_the_engine_holds(monkeypatch, draft, reference):
    """Eight requests arrive together into an idle engine whose prefills hold two or three prompts each: the load they
    live at is the engine's (all held, queued included), not the prefill's own few requests nor the empty batch. A
    load detachable only from 8 requests up detaches every one of them (fails if judged at the prefill's chunks or
    the batch: the first ones would join with their drafts)."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    llm = adaptive_llm(draft, chunked_prefill_size=32)
    strategy = llm.engine.strategy
    asked = []
    monkeypatch.setattr(strategy.policy, "detach_blocker", lambda batch_size: asked.append(batch_size) or (
        None if batch_size >= 8 else "unsettled"))
    prompts = [p[:60] for p in PROMPTS * 2]  # two or three prompts fill a prefill
    want = LLM(TARGET, page_size=16, max_running_requests=8).generate(prompts, GREEDY)
    got = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.stats()["steps"]["prefills"] >= 3 and set(asked) == {8}, asked
    assert llm.engine.stats()["adaptive"]["detached_requests"] == 8
    assert_no_leaks(llm)


def test_detached_requests_take_pages_without_draft_kv(monkeypatch, draft, reference):
    """Requests that join detached are served the pages detached requests left (target KV alone) at their prompt's
    second sight, as a plain engine would: no draft extend runs, every request is detached (those admitted onto such
    pages whatever their prefill finds), and the tokens are the plain engine's."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    llm = adaptive_llm(draft, page=4)
    strategy = llm.engine.strategy
    monkeypatch.setattr(strategy.policy, "detach_blocker", lambda batch_size: None)
    extends = []
    real = strategy.worker.extend_draft
    monkeypatch.setattr(strategy.worker, "extend_draft", lambda *a, **kw: extends.append(1) or real(*a, **kw))
    want = reference(GREEDY)
    first = llm.generate(PROMPTS, GREEDY)
    second = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == [o.token_ids for o in want]
    assert all(o.num_cached_tokens == 0 for o in first)
    assert all(o.num_cached_tokens >= len(o.prompt_token_ids) - 4 for o in second)
    adaptive_stats = llm.engine.stats()["adaptive"]
    assert adaptive_stats["detached_requests"] == 2 * len(PROMPTS) and adaptive_stats["attached_requests"] == {}
    assert extends == [], extends
    assert_no_leaks(llm)


def _round_counts(llm, prompts, params):
    return [(o.token_ids, o.spec_stats["accept_length_counts"]) for o in (llm.generate([p], params)[0]
                                                                          for p in prompts)]


@pytest.mark.parametrize("pattern", [[0], [0, 0, 0, 1, 0]], ids=["finishes-lagging", "caught-up"])
def test_prefix_cache_takes_only_pages_with_a_current_draft(monkeypatch, pattern):
    """Request A decodes with plain steps (finishing while its draft lags, or with rounds catching it up, pages of 4);
    request B's prompt is A's whole text plus more, so it hits A's pages, including those A wrote while lagging.
    B (all rounds) gives the tokens and round-by-round accept lengths of the same run without the cache: the tree
    never holds a page whose draft KV is missing or wrong."""
    fixed_costs(monkeypatch)
    kw = dict(draft_model=builtin_draft_path(), speculative_adaptive=True, page_size=4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = LLM(TARGET, **kw)
    force(llm, pattern)
    a = llm.generate([PROMPTS[1]], params)[0]
    b_prompt = a.prompt_token_ids + a.token_ids + llm.tokenizer.encode("\n\n\ndef")
    force(llm, [1])
    got = _round_counts(llm, [b_prompt], params)
    base = LLM(TARGET, disable_radix_cache=True, **kw)
    force(base, [1])
    assert got == _round_counts(base, [b_prompt], params)
    cached = llm.engine.stats()["prefix_cache"]["hit_tokens"]
    prompt_pages = len(a.prompt_token_ids) // 4 * 4  # the prompt's draft is current: its prefill extended it
    assert cached > prompt_pages if pattern != [0] else cached == prompt_pages, (cached, prompt_pages)
    assert_no_leaks(llm)


@pytest.mark.parametrize("within_reach", [True, False])
def test_a_plain_server_still_caches_its_shared_prompt(monkeypatch, within_reach):
    """Rounds priced far above plain steps: the engine decodes plainly from its start, so prefills are lazy and
    leave every prompt's draft behind, and the prefix cache takes their pages with the target's KV alone, which a
    request that may run rounds does not take (detaching held back here, as while a probe of rounds is owed; a
    detached one takes them at once: test_detached_requests_take_pages_without_draft_kv). The cache remembers that
    such a page exists, so where rounds are within reach a prompt that repeats it is extended eagerly: the second
    request computes the prompt with its draft (no hit), the third finds it cached; a prompt never seen before
    stays lazy (no draft extend): the fourth, another prompt. Where rounds are out of reach
    (AdaptivePolicy.rounds_out_of_reach) the repeated prompt stays lazy too: no draft extend at all, and each
    request computes the prompt (fails if the repeat is extended there, or not extended where rounds are within
    reach)."""
    fixed_costs(monkeypatch, plain=1.0, spec=50.0)
    llm = LLM(TARGET, draft_model=builtin_draft_path(), speculative_adaptive=True, page_size=4,
              max_running_requests=2)
    policy = llm.engine.strategy.policy
    monkeypatch.setattr(policy, "detach_blocker", lambda batch_size: "probe_waiting")
    monkeypatch.setattr(policy, "rounds_out_of_reach", lambda batch_size, load=None: not within_reach)
    extends = []
    worker = llm.engine.strategy.worker
    real_extend = worker.extend_draft
    monkeypatch.setattr(worker, "extend_draft", lambda chunks, *a: (extends.append(len(chunks)),
                                                                    real_extend(chunks, *a))[1])
    prompt = OVERLAP_PROMPTS[1]
    params = SamplingParams(max_tokens=3, ignore_eos=True)  # too few steps for an epoch to end (and a probe)
    outs = [llm.generate([p], params)[0] for p in (prompt, prompt, prompt, OVERLAP_PROMPTS[2])]
    assert llm.engine.stats()["adaptive"]["chosen"][SPECULATIVE] == 0
    assert outs[1].token_ids == outs[2].token_ids == outs[0].token_ids
    assert [o.num_cached_tokens for o in outs[:2]] == [0, 0]
    if within_reach:
        assert outs[2].num_cached_tokens >= len(prompt_ids := outs[0].prompt_token_ids) // 4 * 4 - 4 > 0, prompt_ids
        assert extends == [1], extends  # only the second request's prefill extended the draft
    else:
        assert outs[2].num_cached_tokens == 0 and extends == [], extends
    assert_no_leaks(llm)


@pytest.mark.parametrize("fraction,expected", [(0.0, PLAIN), (1.0, SPECULATIVE)])
def test_acceptance_and_costs_drive_the_choice(monkeypatch, draft, reference, fraction, expected):
    """A round costs 2 plain steps: an oracle that is always wrong makes the engine decode plainly (with probes),
    one that is always right makes it speculate; tokens equal plain decoding either way; /metrics shows it. (Long
    enough for standing decisions to end in epochs and decide again: the steady samples /metrics shows.)"""
    fixed_costs(monkeypatch, plain=1.0, spec=2.0)
    params = SamplingParams(max_tokens=160, ignore_eos=True)
    want = reference(params)
    llm = adaptive_llm(draft, oracle_refs=want)
    llm.engine.runner.draft.fraction = fraction
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.engine.stats()
    chosen = stats["adaptive"]["chosen"]
    assert chosen[expected] > 3 * chosen[PLAIN if expected == SPECULATIVE else SPECULATIVE], chosen
    metrics = Metrics(3)
    metrics.on_engine_stats(stats)
    text = metrics.render()
    bucket = max(stats["adaptive"]["buckets"])
    assert f'spruce_adaptive_choice{{bucket="{bucket}",choice="' in text
    assert f'spruce_adaptive_device_seconds{{bucket="8",choice="speculative"}} 2.0' in text
    assert f'spruce_adaptive_resolve_seconds{{bucket="{bucket}",choice="' in text  # deciding steps' resolves
    assert f'spruce_adaptive_steps_total{{choice="{expected}"}} {chosen[expected]}' in text
    assert f'spruce_adaptive_catch_ups_total {stats["adaptive"]["catch_ups"]}' in text
    assert f'spruce_adaptive_detached_requests_total {stats["adaptive"]["detached_requests"]}' in text
    assert all(f'spruce_adaptive_attached_requests_total{{reason="{r}"}} {n}' in text
               for r, n in stats["adaptive"]["attached_requests"].items()) and stats["adaptive"]["attached_requests"]
    assert 'spruce_adaptive_catch_up_seconds{part="device",term="per_position"}' in text
    assert 'spruce_adaptive_probe_cost_factor{choice="plain"}' in text
    measured_at = [(c, load) for c, per in stats["adaptive"]["probe_cost_factor_at_load"].items() for load in per]
    assert all(f'spruce_adaptive_probe_cost_factor_at_load{{choice="{c}",load="{load}"}}' in text
               for c, load in measured_at)
    assert f'spruce_adaptive_probes_cut_total {stats["adaptive"]["probes_cut"]}' in text
    assert "S=3 K=4 N=8 adaptive" in llm.engine.info()["speculative"]
    a = stats["adaptive"]
    if expected == SPECULATIVE:  # rounds preferred: prefills extend the draft eagerly, and price new prompts
        assert f'spruce_adaptive_prompt_draft_seconds {a["prompt_draft_seconds"]!r}' in text
    assert f'spruce_adaptive_epochs_total {a["epochs"]}' in text
    own = [(c, b) for c, per in a["own_host_seconds"].items() for b in per]
    assert all(f'spruce_adaptive_own_host_seconds{{bucket="{b}",choice="{c}"}}' in text for c, b in own)
    if expected == SPECULATIVE:  # steady rounds decide every REUSE_STEPS steps; plain steps only at an epoch's end
        assert own


def test_adaptive_needs_speculation():
    with pytest.raises(ConfigError, match="speculative_adaptive need a draft model"):
        LLM(TARGET, speculative_adaptive=True)
    from spruce.config import SpeculativeConfig

    with pytest.raises(ConfigError, match="speculative_adaptive must be True or False, got 'yes'"):
        SpeculativeConfig("EAGLE3", "d", 3, 4, 8, adaptive="yes")


DRAFT_19M = Path(__file__).resolve().parents[1] / "bench" / "assets" / "pycode-19m-eagle3"  # its trained head


@pytest.mark.gpu
@pytest.mark.parametrize("overlap,lazy", [(True, False), (False, False), (True, True)])
def test_switching_under_cuda_graphs_equals_plain_decoding(monkeypatch, pycode19m, heldout_prompts, overlap, lazy):
    """On the GPU with graphs (both candidates' phases replayed, costs timed from the replays): forced switching
    on pycode-19m with its trained EAGLE-3 head gives plain decoding's greedy tokens (float32: no bf16 near-ties),
    rounds after plain steps (after a catch-up) still accept, every bucket has a start-up cost, and the steps' device
    times are measured online. `lazy`: the prompts' draft extends wait for the first catch-up (lazy prefill)."""
    if lazy:
        lazy_prefills(monkeypatch)
    kw = dict(device="cuda", dtype="float32", max_running_requests=8, disable_overlap_schedule=not overlap)
    prompts = [t[:600] for t in heldout_prompts[:8]]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    want = LLM(pycode19m, **kw).generate(prompts, params)
    llm = LLM(pycode19m, draft_model=DRAFT_19M, speculative_adaptive=True, **kw)
    assert all(t > 0 for t in llm.engine.strategy.policy.device_seconds.values())
    assert {("decode", 8), ("verify", 8)} <= set(llm.engine.runner.graphs.graphs)
    log = force(llm, [1, 0, 0, 1, 1, 0, 1])
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] and {PLAIN, SPECULATIVE} <= set(log)
    stats = llm.engine.stats()
    assert stats["spec"]["mean_accept_length"] > 2.0  # catch-ups read the features the plain graphs kept
    assert stats["adaptive"]["catch_ups"] > 0 and llm.engine.strategy.policy.measured_device_seconds  # events
    assert_no_leaks(llm)


@pytest.mark.gpu
def test_detached_requests_under_cuda_graphs_equal_plain_decoding(monkeypatch, pycode19m, heldout_prompts):
    """On the GPU with graphs: requests detached from their first step (`AdaptivePolicy.detachable`) replay the
    detached plain step's own graphs (a plain engine's: no features kept) and give plain decoding's greedy tokens;
    none of them runs a round, a catch-up or a draft extend."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    kw = dict(device="cuda", dtype="float32", max_running_requests=8)
    prompts = [t[:600] for t in heldout_prompts[:8]]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    want = LLM(pycode19m, **kw).generate(prompts, params)
    llm = LLM(pycode19m, draft_model=DRAFT_19M, speculative_adaptive=True, **kw)
    strategy = llm.engine.strategy
    assert {("decode_detached", 8), ("decode", 8)} <= set(llm.engine.runner.graphs.graphs)
    monkeypatch.setattr(strategy.policy, "detach_blocker", lambda batch_size: None)
    for name in ("extend_draft", "catch_up", "decode"):
        monkeypatch.setattr(strategy.worker, name, lambda *a, name=name, **k: pytest.fail(f"worker.{name} ran"))
    monkeypatch.setattr(strategy.plain, "decode", lambda *a, **k: pytest.fail("the feature-keeping plain step ran"))
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.stats()["adaptive"]["detached_requests"] == len(prompts)
    assert_no_leaks(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_every_verify_width_under_cuda_graphs(monkeypatch, backend):
    """Adaptive rounds at N = 16 and its narrower trees 4 and 8 (each width's draft, verify and extend phases
    captured as graphs of their own at every bucket), forced switching between them and plain steps, the bundled
    model and its trained head: Triton (float32) gives plain decoding's greedy tokens; FlashInfer (bf16 only) gives
    its eager run's tokens, which needs every width's VERIFY replayed with the wrapper planned for its own query
    stride (one wrapper per bucket shared by the widths replays a graph over the schedule of another width's
    plan)."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    kw = dict(device="cuda", dtype="float32" if backend == "triton" else "bfloat16", max_running_requests=8,
              attention_backend=backend)
    prompts = PROMPTS * 2
    params = SamplingParams(max_tokens=64, ignore_eos=True)

    def adaptive_run(**extra):
        llm = LLM(TARGET, draft_model=builtin_draft_path(), speculative_adaptive=True, speculative_num_steps=5,
                  speculative_eagle_topk=4, speculative_num_draft_tokens=16, speculative_adaptive_widths=(4, 8), **kw,
                  **extra)
        force(llm, [1, 1, 0, 1, 1, 1, 0, 1])
        ran = cycle_widths(monkeypatch, llm, [4, 16, 8])
        return llm, [o.token_ids for o in llm.generate(prompts, params)], ran

    llm, got, ran = adaptive_run()
    assert {("verify", 8), ("verify@4", 8), ("verify@8", 8), ("draft@4", 1), ("extend@8", 4)} <= set(
        llm.engine.runner.graphs.graphs)
    assert set(ran) == {4, 8, 16}
    if backend == "triton":
        want = [o.token_ids for o in LLM(TARGET, **kw).generate(prompts, params)]
    else:
        want = adaptive_run(cuda_graph=False)[1]
    assert got == want
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.5
    assert_no_leaks(llm)


def test_lazy_ring_store_takes_each_prefill_tokens_row_and_position(monkeypatch):
    """A lazy prefill's features go to the ring at the row and the position of each of its tokens, in its order
    (`ModelRunner.prefilled_tokens`: the prefill batch's own buffers); asked for another count than the last
    prefill's, it fails loudly."""
    from spruce.errors import InvariantError

    lazy_prefills(monkeypatch)
    llm = LLM(TARGET, draft_model=builtin_draft_path(), speculative_adaptive=True, disable_radix_cache=True)
    engine = llm.engine
    stored = []
    store = engine.strategy.ring.store
    monkeypatch.setattr(engine.strategy.ring, "store", lambda rows, positions, features: stored.append(
        (rows.tolist(), positions.tolist(), features.shape[0])) or store(rows, positions, features))
    prompts = ["def fib(n):\n    ", "x = ["]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()  # one prefill of both prompts, lazy
    reqs = sorted(engine.requests.values(), key=lambda q: q.arrival)
    lengths = [len(q.prompt_ids) for q in reqs]
    assert stored == [([q.row for q, n in zip(reqs, lengths) for _ in range(n)],
                       [p for n in lengths for p in range(n)], sum(lengths))]
    with pytest.raises(InvariantError, match=f"prefilled_tokens\\({sum(lengths) + 1}\\): the last prefill_forward "
                                             f"ran {sum(lengths)} tokens"):
        engine.runner.prefilled_tokens(sum(lengths) + 1)
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(llm)


def test_padded_prefill_batch_keeps_its_tokens_first():
    """A prefill padded to a graph's bucket holds its own tokens' rows and positions first, in order (what
    `ModelRunner.prefilled_tokens` reads there too), the padding after them."""
    runner = LLM(TARGET, disable_radix_cache=True).engine.runner
    runner.builder.extend([1, 3, 2], [0, 5, 17], [[7] * 4, [9] * 6, [4] * 3], pad_to=32)
    assert runner.builder.token_rows[:13].tolist() == [1] * 4 + [3] * 6 + [2] * 3
    assert runner.builder.positions[:13].tolist() == [*range(4), *range(5, 11), *range(17, 20)]


def test_standing_rounds_go_on_from_request_to_request_at_concurrency_1(monkeypatch, draft, reference):
    """Rounds priced at a hundredth of a plain step, four requests served one after another (an idle gap before
    each): the round decided over the first stands for the next ones, within its budget (REUSE_STEPS, the epoch),
    instead of a decision at each request's start, where nothing overlaps its host work (H200 x4, 6128c32: 128
    decided steps a 64-request level at concurrency 1). Tokens are plain decoding's."""
    fixed_costs(monkeypatch, plain=100.0, spec=1.0)
    llm = adaptive_llm(draft)
    policy = llm.engine.strategy.policy
    starts, decisions = [], []
    decide = policy.decide
    monkeypatch.setattr(policy, "decide", lambda *a, **kw: decisions.append(sum(policy.chosen.values()))
                        or decide(*a, **kw))
    outputs = []
    for prompt in PROMPTS:
        starts.append(sum(policy.chosen.values()))
        outputs += llm.generate([prompt], GREEDY)
    assert policy.chosen[PLAIN] == 0 and decisions[0] == starts[0]
    assert not set(decisions[1:]) & set(starts), (decisions, starts)  # no request but the first starts decided
    assert [o.token_ids for o in outputs] == [w.token_ids for w in reference(GREEDY)]


def test_outputs_share_a_requests_statistics_until_its_next_round(draft):
    """Every output of a speculative engine carries its request's statistics: the one dict built after its last
    round (`SpecStats.built`), shared by its outputs until the next round (the engine process sends statistics
    only when the object changed, server/output_deltas.py), then a new one with the round counted."""
    llm = adaptive_llm(draft)
    pattern = force(llm, [1, 0, 0, 1, 0])
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], GREEDY)
    seen = []  # (rounds so far, the output's statistics)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                seen.append((out.spec_stats["rounds"], out.spec_stats))
    assert SPECULATIVE in pattern and PLAIN in pattern
    for (rounds, stats), (next_rounds, next_stats) in zip(seen, seen[1:]):
        assert (stats is next_stats) == (rounds == next_rounds), (rounds, next_rounds)
    assert seen[-1][1]["rounds"] == pattern.count(SPECULATIVE) > 1


def test_the_idle_gap_is_told_to_the_policy_at_its_next_use(monkeypatch, draft, reference):
    """Plain steps standing, requests served one after another: the engine meets each idle gap while the step
    holding the request's last token is in flight, and the strategy then tells the policy nothing (no ticket
    replay, no gap: both wait for the policy's next use, here the stats the engine process takes once idle, or the
    next arrival); the policy hears the ticket's steps, then the gap, stamped when the engine met it, once a gap.
    Tokens are plain decoding's."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    llm = adaptive_llm(draft)
    strategy = llm.engine.strategy
    policy = strategy.policy
    heard, met = [], []
    monkeypatch.setattr(policy, "park", lambda d: None)  # (a ticket's steps; a park's gaps: test_parked_steps_*)
    stood, idle, strategy_idle = policy.stood, policy.idle, strategy.idle
    monkeypatch.setattr(policy, "stood", lambda *a, **kw: heard.append("stood") or stood(*a, **kw))
    monkeypatch.setattr(policy, "idle", lambda *since: heard.append(("idle", *since, None)[:2]) or idle(*since))

    def engine_idle():
        before, told = policy.clock(), len(heard)
        strategy_idle()
        met.append((before, policy.clock(), len(heard) - told))

    monkeypatch.setattr(strategy, "idle", engine_idle)
    outputs = []
    for prompt in PROMPTS:
        outputs += llm.generate([prompt], GREEDY)
        gaps = len(met)
        llm.engine.stats()  # (the engine process's, once idle)
        assert heard and heard[-1][0] == "idle" and sum(h[0] == "idle" for h in heard) == gaps
        assert "stood" in heard[-2:], heard[-3:]  # the ticket's steps before the gap
    assert len(met) >= len(PROMPTS) and all(told == 0 for _, _, told in met), met
    sinces = [h[1] for h in heard if h[0] == "idle"]  # each stamped within the engine's call that met its gap
    assert all(any(before <= since <= after for before, after, _ in met) for since in sinces), (sinces, met)
    assert policy.chosen[SPECULATIVE] == 0
    assert [o.token_ids for o in outputs] == [w.token_ids for w in reference(GREEDY)]


# --- the verify width (speculative/tree_width.py) -------------------------------------------------------------------
def cycle_widths(monkeypatch, llm, widths: list[int]) -> list[int]:
    """The width chooser's pick replaced by `widths`, cycled by the rounds run so far (the pick comes at every
    decision and read); returns the widths the rounds ran at."""
    chooser, ran = llm.engine.strategy.widths, []
    decode = EagleWorker.decode

    def logged(self, rows, max_kv, sampling, logprobs=None, grammar=None, width=None):
        ran.append(width or self.N)
        return decode(self, rows, max_kv, sampling, logprobs, grammar, width)

    def choose(bucket):
        chooser.chosen[bucket] = widths[len(ran) % len(widths)]
        return chooser.chosen[bucket]

    monkeypatch.setattr(EagleWorker, "decode", logged)
    chooser.choose = choose
    return ran


@pytest.mark.parametrize("k,s,n,widths,page,overlap", [(4, 3, 8, (3, 5), 16, True), (4, 2, 6, (2, 4), 1, False),
                                                        (1, 4, 5, (2, 4), 16, True)])
def test_every_verify_width_equals_plain_decoding(monkeypatch, draft, reference, k, s, n, widths, page, overlap):
    """Rounds over trees of every configured width (and plain steps between), the width switched at every decision
    and read: greedy, logprobs, seeded sampling with penalties and a request ending mid-round give plain decoding's
    tokens (a narrower round samples one row per node of its own tree: the engine's sampling repeat is the step's
    width; penalties count each node's own path in it)."""
    fixed_costs(monkeypatch)
    params = mixed_params()
    params[2] = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=11, presence_penalty=0.5,
                               frequency_penalty=0.3, repetition_penalty=1.2, ignore_eos=True)  # + penalties
    want = reference(params)
    llm = adaptive_llm(draft, k, s, n, page, oracle_refs=reference(GREEDY), disable_overlap_schedule=not overlap,
                       speculative_adaptive_widths=widths)
    assert llm.engine.limits.tree_widths == (*widths, n)
    force(llm, [1, 1, 0, 1, 1, 1, 0, 1])
    ran = cycle_widths(monkeypatch, llm, [widths[0], n, widths[1]])
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got[1].logprobs, want[1].logprobs):
        assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    rounds = llm.engine.stats()["adaptive"]["tree_width"]["rounds"]  # (reads the unread rounds)
    assert set(ran) == {*widths, n} and all(rounds[w] == ran.count(w) for w in (*widths, n)), (rounds, ran)
    assert_no_leaks(llm)


def test_a_round_reports_what_each_narrower_tree_accepts(monkeypatch, reference):
    """A round at N = 16 carries, per narrower width (4 and 8), the drafts that width's tree would accept; at every
    other position of the reference outputs they equal the first round of a fixed engine at that N (the bundled
    trained EAGLE-3 head, greedy, S = 3, K = 4): what the width chooser prices every width by."""
    from spruce.config import builtin_draft_path
    from spruce.speculative import tree_width

    import bench_scripts

    trace = bench_scripts.load("accept_trace")
    jobs = [list(ids) + out.token_ids[:p] for ids, out in zip(
        (o.prompt_token_ids for o in reference(GREEDY)), reference(GREEDY)) for p in range(0, MAX_NEW - 1, 2)]
    fixed = {}
    for n in (4, 8):
        llm = LLM(TARGET, draft_model=builtin_draft_path(), speculative_num_steps=3, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=n, max_running_requests=16, disable_radix_cache=True)
        fixed[n] = trace.first_rounds(llm.engine, jobs, 3 + 2)
    fixed_costs(monkeypatch, plain=100.0, spec=1.0)  # rounds throughout, every prompt's draft extended at once
    llm = LLM(TARGET, draft_model=builtin_draft_path(), speculative_num_steps=3, speculative_eagle_topk=4,
              speculative_num_draft_tokens=16, max_running_requests=16, disable_radix_cache=True,
              speculative_adaptive=True, speculative_adaptive_widths=(4, 8))
    strategy = llm.engine.strategy
    cycle_widths(monkeypatch, llm, [16])
    first: dict[int, list[int]] = {}
    every: list[list[int]] = []  # every round's rows
    resolved = strategy.resolved

    def recording(step, requests, results, *a, **kw):
        if step is not None and step is not strategy.plain:
            every.extend(results)
            for q, row in zip(requests, results):
                first.setdefault(id(q.spec), row)
        return resolved(step, requests, results, *a, **kw)

    monkeypatch.setattr(strategy, "resolved", recording)
    rows = []
    for start in range(0, len(jobs), 16):
        rids = [llm.engine.add_request(ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
                for ids in jobs[start:start + 16]]
        stats = [llm.engine.requests[rid].spec for rid in rids]
        while llm.engine.has_unfinished():
            llm.engine.step(finished_only=True)
        rows += [first[id(st)] for st in stats]
        first.clear()
    column = 1 + llm.engine.limits.step_advance
    assert [row[column] for row in rows] == fixed[4] and [row[column + 1] for row in rows] == fixed[8]
    assert sum(row[0] for row in rows) > sum(fixed[8]) > sum(fixed[4]) > 0  # the widths differ where it matters
    llm.engine.stats()  # (reads the rounds not read yet)
    accept = strategy.widths.accept  # fewer request-rounds than WIDTH_WINDOW: each width's plain mean of its column
    assert len(every) < tree_width.WIDTH_WINDOW
    for w, col in ((4, column), (8, column + 1), (16, 0)):
        assert accept[w] == pytest.approx(sum(row[col] for row in every) / len(every)), w


def test_the_width_chooser_prices_each_width_by_its_acceptance_and_cost():
    """Widest until its acceptance is measured; then (1 + a_w) / (D_w (+) H) per bucket: a device-bound bucket
    takes the narrow tree whose acceptance is nearly as good, a host-bound one the wide tree; a round at a width
    measures only that width and narrower ones; the widest runs again for REFRESH_ROUNDS of every REFRESH_EVERY."""
    from spruce.speculative import tree_width
    from spruce.speculative.tree_width import WidthChooser

    device = {(4, 1): 1e-3, (8, 1): 1.05e-3, (4, 64): 4e-3, (8, 64): 7e-3}
    chooser = WidthChooser((4, 8), device, lambda bucket: 2e-3, max)
    assert chooser.choose(64) == 8 and chooser.choose(1) == 8  # nothing measured yet: the widest measures all
    chooser.add(4, [1, 9], 1)  # a narrow round: says nothing of 8's acceptance
    assert chooser.accept == {4: 1.0} and chooser.choose(64) == 8
    chooser.add(8, [4, 7], 2)  # wide rounds: a_4 = 2, a_8 = 3.5 (their running means)
    assert chooser.accept == {4: pytest.approx(5 / 3), 8: 3.5}
    assert chooser.choose(1) == 8  # host-bound (2 ms host against ~1 ms device): the wider tree's tokens are free
    assert chooser.choose(64) == 4  # device-bound: 2.67 tokens in 4 ms beat 4.5 in 7 ms
    for _ in range(tree_width.REFRESH_EVERY):
        chooser.add(4, [2, 0], 1)
    assert chooser.choose(64) == 8 and chooser.accept[8] == 3.5  # the refresh: the widest re-measures a_8
    for _ in range(tree_width.REFRESH_ROUNDS):
        assert chooser.choose(64) == 8
        chooser.add(8, [2, 3], 1)
    assert chooser.choose(64) == 4
    assert chooser.rounds == {4: 1 + tree_width.REFRESH_EVERY, 8: 1 + tree_width.REFRESH_ROUNDS}
    assert chooser.snapshot()["chosen"] == {1: 8, 64: 4}


def test_adaptive_widths_are_checked():
    from spruce.cli import build_parser, engine_kwargs
    from spruce.config import SpeculativeConfig, make_speculative_config

    with pytest.raises(ConfigError, match=r"speculative_adaptive_widths=\[4\] needs speculative_adaptive"):
        SpeculativeConfig("EAGLE3", "d", 3, 4, 8, adaptive_widths=(4,))
    for bad in ((8,), (1,), (4, 4)):
        with pytest.raises(ConfigError, match=r"each must be distinct and in \[2, speculative_num_draft_tokens=8\)"):
            SpeculativeConfig("EAGLE3", "d", 3, 4, 8, adaptive=True, adaptive_widths=bad)
    with pytest.raises(ConfigError, match="speculative_adaptive_widths need a draft model"):
        LLM(TARGET, speculative_adaptive_widths=(4,))
    with pytest.raises(ConfigError, match="speculative_adaptive_widths must be a tuple of integers, got 0"):
        make_speculative_config("EAGLE3", "d", adaptive=True, adaptive_widths=0)  # refused, not taken as none
    args = build_parser().parse_args(["serve", "--speculative-adaptive", "--speculative-adaptive-widths", "4", "6"])
    assert engine_kwargs(args)["speculative_adaptive_widths"] == (4, 6)


def test_the_probe_budget_is_checked_and_reaches_the_policy():
    """speculative_adaptive_probe_budget: a number in [0, MAX_PROBE_BUDGET], only with speculative_adaptive (bad
    values are refused, naming the value); the flag, the LLM argument and the engine's policy carry it (the engine's
    info names a budget other than the default), and None is the default."""
    from spruce.cli import build_parser, engine_kwargs
    from spruce.config import ADAPTIVE_PROBE_BUDGET, MAX_PROBE_BUDGET, SpeculativeConfig, make_speculative_config

    for bad in (-0.001, MAX_PROBE_BUDGET + 0.01, float("nan"), True, "0.01"):
        with pytest.raises(ConfigError, match=r"speculative_adaptive_probe_budget must be a number in \[0, 0.2\]"):
            SpeculativeConfig("EAGLE3", "d", 3, 4, 8, adaptive=True, adaptive_probe_budget=bad)
    for given in (0.001, ADAPTIVE_PROBE_BUDGET):  # (the default too: a setting given is never ignored)
        with pytest.raises(ConfigError, match=f"speculative_adaptive_probe_budget={given} needs speculative_adaptive"):
            make_speculative_config("EAGLE3", "d", adaptive_probe_budget=given)
    with pytest.raises(ConfigError, match="speculative_adaptive_probe_budget need a draft model"):
        LLM(TARGET, speculative_adaptive_probe_budget=0.001)
    assert make_speculative_config("EAGLE3", "d", adaptive=True).adaptive_probe_budget == ADAPTIVE_PROBE_BUDGET
    args = build_parser().parse_args(["serve", "--speculative-adaptive", "--speculative-adaptive-probe-budget", "0"])
    assert engine_kwargs(args)["speculative_adaptive_probe_budget"] == 0.0
    llm = LLM(TARGET, draft_model=builtin_draft_path(), speculative_adaptive=True,
              speculative_adaptive_probe_budget=0.001, max_running_requests=4)
    assert llm.engine.strategy.policy.probe_budget == 0.001
    assert llm.engine.info()["speculative"].endswith("adaptive probe_budget=0.001")
    default = LLM(TARGET, draft_model=builtin_draft_path(), speculative_adaptive=True, max_running_requests=4)
    assert default.engine.strategy.policy.probe_budget == ADAPTIVE_PROBE_BUDGET
    assert "probe_budget" not in default.engine.info()["speculative"]


def test_parked_steps_are_counted_and_their_tokens_are_plain_decodings(monkeypatch, draft, reference):
    """Rounds priced at 100 plain steps: every request joins detached, and once plain steps measured an epoch at the
    load a decided step over the all-detached batch parks (AdaptivePolicy.park): the steps after it are a plain
    engine's, the policy told nothing, across the idle gaps between requests served one after another (a client's
    round trip). Its steps show in the stats while it goes on, and the policy counts every one once it ends (read
    through `policy`); far fewer decisions than requests. Fails if parked steps are lost from the counts, if the park
    ends at each request, or if the tokens are not plain decoding's."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    llm = adaptive_llm(draft)
    strategy = llm.engine.strategy
    policy = strategy.policy
    decided, decide = [], policy.decide
    monkeypatch.setattr(policy, "decide", lambda *a, **kw: decided.append(1) or decide(*a, **kw))
    outputs = []
    for _ in range(3):
        for prompt in PROMPTS:
            outputs += llm.generate([prompt], GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference(GREEDY)] * 3
    park = strategy._park
    stats = llm.engine.stats()
    assert park is not None and strategy._park is park and park.steps > 0  # the stats left it going
    decodes = stats["steps"]["decodes"]
    assert sum(stats["adaptive"]["chosen"].values()) == decodes
    assert stats["adaptive"]["detached_requests"] == 3 * len(PROMPTS)
    chosen = strategy.policy.chosen  # read through `policy`: the park ends, its steps told
    assert strategy._park is None and sum(chosen.values()) == decodes == chosen[PLAIN]
    assert policy.parks >= 1 and policy.parked_steps > decodes / 2
    assert len(decided) < len(PROMPTS)  # (one a request without parks)


def test_a_park_ends_when_a_request_joins_with_its_draft(monkeypatch, draft):
    """Parked over detached requests, a prompt longer than Limits.lazy_prefill_tokens arrives: its draft is extended
    eagerly (it joins with its draft), so its prefill ends the park first (the policy told of its steps, then of the
    prefill) and the batch runs the feature-keeping plain step from there on. Fails if a park goes on over a
    request with a draft (the extend's invariant raises) or if the detached plain step runs over it."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    llm = adaptive_llm(draft, disable_overlap_schedule=True)
    engine, strategy = llm.engine, llm.engine.strategy
    for prompt in PROMPTS:  # an epoch measured, then a park
        llm.generate([prompt], GREEDY)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    engine.add_request(PROMPTS[0], params)
    while strategy._park is None or not engine.scheduler.running:
        engine.step()
    parked = strategy._park.steps
    ran = []
    for name in ("plain", "detached_plain"):
        plain = getattr(strategy, name)
        real = plain.decode
        monkeypatch.setattr(plain, "decode", lambda *a, name=name, real=real, **kw: ran.append(name) or real(*a, **kw))
    long_prompt = " ".join(["def f(x):\n    return x"] * (engine.runner.limits.lazy_prefill_tokens // 4))
    assert len(engine.tokenizer.encode(long_prompt)) > engine.runner.limits.lazy_prefill_tokens
    engine.add_request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # its prefill: the park ends
    assert strategy._park is None and strategy.policy.parked_steps >= parked
    while engine.has_unfinished():
        engine.step()
    first = ran.index("plain")  # (a step over the detached request alone may come before the new one is in)
    assert ran[first:first + 3] == ["plain"] * 3 and set(ran[:first]) <= {"detached_plain"} and first <= 1


def test_a_park_survives_a_round_trip_gap_and_ends_at_a_longer_one(monkeypatch, draft):
    """Requests served one after another while parked: an idle gap up to DETACH_GAP (a client's round trip) leaves
    the park going, its time left out of the park's busy seconds; a longer one (a change of level) ends it at the
    next arrival, and the policy hears the gap from when the engine met it. Fails if every gap ends the park or if
    a long one is carried over."""
    fixed_costs(monkeypatch, plain=1.0, spec=100.0)
    llm = adaptive_llm(draft)
    strategy = llm.engine.strategy
    policy = strategy.policy
    offset = [0.0]
    monkeypatch.setattr(policy, "clock", lambda: time.perf_counter() + offset[0])
    for prompt in PROMPTS:
        llm.generate([prompt], GREEDY)
    park = strategy._park
    assert park is not None
    offset[0] += adaptive.DETACH_GAP / 2
    llm.generate([PROMPTS[0]], GREEDY)
    assert strategy._park is park and park.idle_seconds >= adaptive.DETACH_GAP / 2
    heard, idle = [], policy.idle
    monkeypatch.setattr(policy, "idle", lambda *since: heard.append(since) or idle(*since))
    met = park.idle_since
    offset[0] += 2 * adaptive.DETACH_GAP
    llm.generate([PROMPTS[1]], GREEDY)
    assert strategy._park is not park and park.steps > 0 and heard == [(met,)]
