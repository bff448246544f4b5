"""EAGLE / EAGLE-3 tree speculation: greedy output equals the target alone, for every K/S/N/page/batch mix.

Target: the bundled pycode-6m (a real trained Llama, so argmaxes are not near-ties). Drafts: random
checkpoints in the published EAGLE and EAGLE-3 layouts, plus an oracle wrapper that makes a chosen fraction
of proposals right, so that every accept length 0..S and every commit path runs.
"""

from __future__ import annotations

import itertools

import pytest

from spruce import SamplingParams
from spruce.config import MAX_DRAFT_TOKENS, builtin_model_path
from spruce.errors import ConfigError
from checkpoints import write_eagle3_checkpoint, write_eagle_checkpoint
from oracle_draft import install_oracle

pytestmark = pytest.mark.slow  # scheduled first (conftest)

TARGET = builtin_model_path()
MAX_NEW = 14
PROMPTS = [
    "def fib(n):\n    ",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "for i in range(10):",
    "# utilities\nfrom typing import List\n\ndef mean(xs: List[float]) -> float:\n    return",
    "x = [",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n        self.children",
    "with open(path) as f:\n    for line in f:\n        ",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {
        "EAGLE3": str(write_eagle3_checkpoint(root / "eagle3", TARGET, draft_vocab_size=1024, seed=1)),
        "EAGLE": str(write_eagle_checkpoint(root / "eagle", TARGET, seed=2)),
        "EAGLE3-full": str(write_eagle3_checkpoint(root / "eagle3-full", TARGET, seed=4)),  # every token draftable
    }


@pytest.fixture(scope="module")
def reference():
    """Greedy non-speculative outputs (token ids) of the target for PROMPTS."""
    from spruce import LLM

    llm = LLM(TARGET, page_size=16, max_running_requests=8)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    return {p: (o.prompt_token_ids, o.token_ids) for p, o in zip(PROMPTS, outs)}


def allowed(k: int, s: int, n: int) -> bool:
    return n - 1 <= k + (s - 1) * k * k and n <= MAX_DRAFT_TOKENS


MATRIX = [(k, s, n) for k, s in itertools.product([1, 2, 4, 8], [1, 3, 5]) for n in [2, 8, 32, 64] if allowed(k, s, n)]
MATRIX += [(1, s, s + 1) for s in (3, 5)]  # chains of full length
CASES = [(k, s, n, [1, 4, 16, 64][i % 4], 1 + (i * 3) % 8, ["EAGLE3", "EAGLE"][i % 2])
         for i, (k, s, n) in enumerate(MATRIX)]


def run_spec(make_llm, drafts, reference, algo, k, s, n, page, prompts, oracle=None, **kw):
    llm = make_llm(TARGET, page_size=page, max_running_requests=kw.pop("max_running_requests", 8),
                   draft_model=drafts[algo], speculative_algorithm=algo.split("-")[0], speculative_num_steps=s,
                   speculative_eagle_topk=k, speculative_num_draft_tokens=n, **kw)
    if oracle is not None:
        o = install_oracle(llm, oracle)
        for p in prompts:
            o.add_reference(*reference[p])
    return llm


@pytest.mark.parametrize("k,s,n,page,bs,algo", CASES, ids=[f"K{c[0]}-S{c[1]}-N{c[2]}-p{c[3]}-bs{c[4]}-{c[5]}"
                                                           for c in CASES])
def test_greedy_spec_equals_target(make_llm, drafts, reference, k, s, n, page, bs, algo):
    prompts = PROMPTS[:bs]
    llm = run_spec(make_llm, drafts, reference, algo, k, s, n, page, prompts, oracle=0.6 if bs % 2 else None)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference[p][1], (p, o.spec_stats)


def accept_lengths_seen(llm) -> set[int]:
    """Every accept length some round of this engine produced."""
    counts = llm.engine.stats()["spec"]["accept_length_counts"]
    return {a for a, c in enumerate(counts) if c}


@pytest.mark.parametrize("k,s,n,page", [(1, 5, 6, 4), (4, 5, 16, 16), (8, 3, 32, 64), (2, 4, 12, 1)])
def test_oracle_exercises_every_accept_length(make_llm, drafts, reference, k, s, n, page):
    seen = set()
    for frac, algo in [(1.0, "EAGLE3-full"), (0.7, "EAGLE"), (0.3, "EAGLE3-full")]:
        llm = run_spec(make_llm, drafts, reference, algo, k, s, n, page, PROMPTS, oracle=frac)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        for p, o in zip(PROMPTS, outs):
            assert o.token_ids == reference[p][1]
        acc = accept_lengths_seen(llm)
        seen |= acc
        if frac == 1.0:
            assert max(acc) == min(s, n - 1)
            assert outs[0].spec_stats["mean_accept_length"] > 2.0
    assert seen == set(range(min(s, n - 1) + 1)), seen


def test_the_oracle_refuses_an_engine_with_captured_graphs(make_llm, drafts):
    """The oracle wraps the draft on the host: an engine whose CUDA graphs replay the unwrapped draft (a GPU run
    without cuda_graph=False) is refused, not silently left with the real draft's acceptance."""
    llm = make_llm(TARGET, draft_model=drafts["EAGLE3"], speculative_algorithm="EAGLE3", speculative_num_steps=3,
                   speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    llm.engine.runner.graphs.graphs[("draft", 1)] = None  # as a capture leaves it
    with pytest.raises(AssertionError, match="cuda_graph=False"):
        install_oracle(llm, 0.5)
    del llm.engine.runner.graphs.graphs[("draft", 1)]


@pytest.mark.parametrize("page", [64, 4])
def test_seed_configs_topk8_joining_mid_flight(make_llm, drafts, reference, page):
    """The two configurations that broke other engines: page 64 + topk 8 and page 4 + topk 8."""
    llm = run_spec(make_llm, drafts, reference, "EAGLE3-full", 8, 5, 64, page, PROMPTS, oracle=0.8,
                   max_running_requests=5)
    eng = llm.engine
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    ids = {eng.add_request(reference[p][0], params): p for p in PROMPTS[:3]}
    done = {}
    for step in range(200):
        if step == 3:
            ids.update({eng.add_request(reference[p][0], params): p for p in PROMPTS[3:]})
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if not eng.has_unfinished() and step > 3:
            break
    assert {ids[i]: o.token_ids for i, o in done.items()} == {p: reference[p][1] for p in PROMPTS}


def test_spec_with_preemption(make_llm, drafts, reference):
    llm = run_spec(make_llm, drafts, reference, "EAGLE3-full", 4, 3, 8, 4, PROMPTS, oracle=0.7, max_total_tokens=260)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference[p][1] for p in PROMPTS]


def test_spec_stats_reported(make_llm, drafts, reference):
    llm = run_spec(make_llm, drafts, reference, "EAGLE3-full", 4, 3, 8, 16, PROMPTS[:2], oracle=1.0)
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))[0]
    st = out.spec_stats
    assert st["rounds"] >= 1 and 1.0 <= st["mean_accept_length"] <= 4.0
    assert len(st["accept_rate_per_depth"]) == 3
    agg = llm.engine.stats()["spec"]
    assert agg["rounds"] >= st["rounds"]


@pytest.mark.parametrize("kw,match", [
    (dict(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=8), "K \\+ \\(S-1\\)"),
    (dict(speculative_eagle_topk=0), "eagle_topk must be >= 1"),
    (dict(speculative_num_draft_tokens=500), "supported maximum"),
    (dict(speculative_algorithm="MEDUSA"), "MEDUSA"),
])
def test_bad_speculative_settings(drafts, kw, match):
    from spruce import LLM

    with pytest.raises(ConfigError, match=match):
        LLM(TARGET, draft_model=drafts["EAGLE3"], **kw)


def test_draft_that_does_not_fit_the_target(tmp_path, drafts):
    """A draft whose fc expects another target hidden size is refused at load with both numbers named."""
    from spruce import LLM
    from spruce.errors import SpruceError

    other = write_eagle3_checkpoint(tmp_path / "wide", TARGET, draft_vocab_size=512, seed=3, target_hidden=320)
    with pytest.raises(SpruceError, match="320"):
        LLM(TARGET, draft_model=str(other))


def test_empty_batch_is_valid_in_every_phase(drafts):
    """Every phase's builder and both backends accept zero requests."""
    import torch

    from spruce import LLM
    from spruce.attention.metadata import Phase

    llm = LLM(TARGET, draft_model=drafts["EAGLE3"], speculative_num_steps=3, speculative_eagle_topk=4,
              speculative_num_draft_tokens=8)
    r = llm.engine.runner
    e = torch.zeros(0, dtype=torch.int64)
    batches = [
        r.builder.extend([], [], []),
        r.builder.decode(e, e, e, 1),
        r.builder.scratch_phase(Phase.VERIFY, e, e, e.view(0, 8), e.view(0, 8), e.view(0, 8, 1), 0,
                                r.target_kv.scratch_start, r.limits.target_scratch_width, 1),
        r.builder.draft_extend(e, e, e, e.view(0, 4), 1),
    ]
    for b in batches:
        assert b.num_tokens == 0
        hidden, _ = r.target_forward(b)
        assert hidden.shape[0] == 0
        assert r.draft_forward(b, torch.zeros(0, r.draft.feature_width)).shape[0] == 0


def test_uniform_phase_views_are_reused_per_shape():
    """BatchBuilder keeps one set of buffer views per (tokens, batch) of a uniform phase (slicing eight buffers each
    step cost the host ~25 us a planned phase): the same shape hands out the same views, another shape its own, of
    its own lengths, and a prefill's (EXTEND: any length) are made afresh."""
    from spruce import LLM
    from spruce.attention.metadata import Phase

    builder = LLM(TARGET).engine.runner.builder
    one, again, four = (builder.describe(Phase.DECODE, bs, 1, 64, 0) for bs in (1, 1, 4))
    assert one.input_ids is again.input_ids and one.qo_indptr is again.qo_indptr
    assert one.input_ids is not four.input_ids
    assert (one.input_ids.shape[0], one.qo_indptr.shape[0], four.input_ids.shape[0], four.qo_indptr.shape[0]) == (
        1, 2, 4, 5)
    assert four.input_ids.data_ptr() == builder.input_ids.data_ptr()  # views of the persistent buffers
    prefills = [builder.extend([0], [0], [[5, 6, 7]]) for _ in range(2)]
    assert prefills[0].input_ids.shape[0] == 3 and prefills[0].input_ids is not prefills[1].input_ids


def _first_round_accepts(engine, jobs: list[list[int]], width: int, monkeypatch) -> list[int]:
    """The accept length of the first round of each job (prompt ids), `width` = S + 2 tokens generated each."""
    from spruce import SamplingParams
    from spruce.runtime import request as request_mod

    first: dict[int, int] = {}
    add_round = request_mod.SpecStats.add_round

    def recording(stats, accepted, num_steps):
        first.setdefault(id(stats), accepted)
        add_round(stats, accepted, num_steps)

    monkeypatch.setattr(request_mod.SpecStats, "add_round", recording)
    out = []
    for start in range(0, len(jobs), 64):
        rids = [engine.add_request(ids, SamplingParams(max_tokens=width, temperature=0, ignore_eos=True))
                for ids in jobs[start:start + 64]]
        stats = [engine.requests[rid].spec for rid in rids]  # alive until read: their ids stay theirs
        while engine.has_unfinished():
            engine.step(finished_only=True)
        out += [first[id(s)] for s in stats]
        first.clear()
    monkeypatch.setattr(request_mod.SpecStats, "add_round", add_round)
    return out


def test_a_larger_verify_tree_never_accepts_less(reference, monkeypatch):
    """Same S and K, N = 4, 8 and 16 (the bundled trained EAGLE-3 head, greedy): at every position of the
    reference outputs, the first round after committing it accepts at least as many drafts with the larger tree.
    The tree is the best N-1 candidates by cumulative score, so a smaller tree is a sub-tree of a larger one and
    the target's choice at a node depends on its ancestors alone (a smaller tree's accept length is the larger
    one's cut at its first node outside it): the premise of pricing every N from the rounds of the largest. Also a guard on the tree build's stable, ancestor-closed selection."""
    from spruce import LLM
    from spruce.config import builtin_draft_path

    jobs = [list(ids) + out[:p] for ids, out in reference.values() for p in range(0, MAX_NEW - 1, 2)]
    accept = {}
    for n in (4, 8, 16):
        llm = LLM(TARGET, draft_model=builtin_draft_path(), speculative_num_steps=3, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=n, max_running_requests=16, disable_radix_cache=True)
        accept[n] = _first_round_accepts(llm.engine, jobs, 3 + 2, monkeypatch)
    assert all(a <= b <= c for a, b, c in zip(accept[4], accept[8], accept[16])), accept
    assert sum(accept[16]) > sum(accept[4]) > 0  # the trees differ where it matters
