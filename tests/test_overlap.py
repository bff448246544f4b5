"""Overlap scheduling: with one step in flight while the next is planned, every request gets exactly the tokens
of the synchronous loop (disable_overlap_schedule=True), for plain decoding and EAGLE / EAGLE-3 trees, with
stop tokens, stop strings and max_tokens ending requests mid-round, aborts mid-flight and preemption; and
seeded sampling gives the same tokens with or without speculation, alone or batched, through preemption.

Target: the bundled pycode-6m; drafts: random checkpoints the tests write, with the oracle wrapper making
most proposals right so rounds accept several tokens.
"""

from __future__ import annotations

import pytest

from spruce import LLM, SamplingParams
from spruce.config import builtin_model_path
from spruce.errors import InvariantError
from spruce.runtime.fixes import ENV_VAR
from checkpoints import write_eagle3_checkpoint, write_eagle_checkpoint
from conftest import assert_no_leaks
from oracle_draft import install_oracle

pytestmark = pytest.mark.slow  # scheduled first (conftest)

TARGET = builtin_model_path()
PROMPTS = [
    "def fib(n):\n    ",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n",
    "for i in range(10):",
    "x = [",
    "with open(path) as f:\n    for line in f:\n        ",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {
        "EAGLE3": str(write_eagle3_checkpoint(root / "eagle3", TARGET, seed=4)),
        "EAGLE": str(write_eagle_checkpoint(root / "eagle", TARGET, seed=2)),
    }


@pytest.fixture(scope="module")
def greedy_reference():
    llm = LLM(TARGET, page_size=16, max_running_requests=8)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    return {p: o for p, o in zip(PROMPTS, outs)}


def mixed_params(reference) -> list[SamplingParams]:
    """Per prompt: greedy, seeded sampling, a stop token mid-output, a stop string, a short max_tokens, eos."""
    out1 = reference[PROMPTS[2]]
    stop_text = out1.text[6:9]
    return [
        SamplingParams(max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=MAX_NEW, stop=[stop_text], ignore_eos=True),
        SamplingParams(max_tokens=MAX_NEW, stop_token_ids=(reference[PROMPTS[3]].token_ids[7],), ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.7, seed=5),
    ]


def build(overlap: bool, algo: str | None, drafts, k=4, s=3, n=8, page=16, oracle_refs=None, **kw) -> LLM:
    spec = {}
    if algo is not None:
        spec = dict(draft_model=drafts[algo], speculative_algorithm=algo, speculative_num_steps=s,
                    speculative_eagle_topk=k, speculative_num_draft_tokens=n)
    llm = LLM(TARGET, page_size=page, max_running_requests=8, disable_overlap_schedule=not overlap, **spec, **kw)
    if algo is not None and oracle_refs is not None:
        oracle = install_oracle(llm, 0.8)
        for p, o in oracle_refs.items():
            oracle.add_reference(o.prompt_token_ids, o.token_ids)
    return llm


def run(llm, params) -> list[tuple[list[int], str, str]]:
    outs = llm.generate(PROMPTS, params)
    assert_no_leaks(llm)
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


CASES = [(None, 1, 1, 2, 1), (None, 1, 1, 2, 64), ("EAGLE3", 1, 3, 4, 16), ("EAGLE3", 4, 3, 8, 1),
         ("EAGLE", 4, 5, 16, 64), ("EAGLE3", 8, 3, 32, 16), ("EAGLE", 8, 2, 16, 1)]


@pytest.mark.parametrize("algo,k,s,n,page", CASES)
def test_overlap_equals_synchronous_loop(drafts, greedy_reference, algo, k, s, n, page):
    params = mixed_params(greedy_reference)
    got = {}
    for overlap in (False, True):
        llm = build(overlap, algo, drafts, k, s, n, page, oracle_refs=greedy_reference)
        got[overlap] = run(llm, params)
    assert got[True] == got[False]
    greedy = got[True][0][0]
    assert greedy == greedy_reference[PROMPTS[0]].token_ids  # and both equal the plain target
    assert got[True][2][2] == "stop" and got[True][3][2] == "stop" and len(got[True][4][0]) == 3
    assert got[True][3][0][-1] == params[3].stop_token_ids[0]  # nothing emitted past the stop token


@pytest.mark.parametrize("algo", [None, "EAGLE3"])
def test_overlap_under_preemption(drafts, greedy_reference, algo):
    """Room for about two requests: decode growth preempts and recomputes; both loops agree, no leaks."""
    params = mixed_params(greedy_reference)
    got = [run(build(overlap, algo, drafts, page=4, max_total_tokens=160, oracle_refs=greedy_reference), params)
           for overlap in (False, True)]
    assert got[0] == got[1]


def test_abort_mid_flight_frees_pages_after_the_step(drafts, greedy_reference):
    """Abort while a step that includes the request is in flight: its pages stay until that step resolves,
    the other requests' tokens are unchanged, and nothing leaks."""
    llm = build(True, "EAGLE3", drafts, page=4, oracle_refs=greedy_reference)
    eng = llm.engine
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in PROMPTS[:3]]
    for _ in range(3):
        eng.step()
    victim = eng.requests[ids[1]]
    assert victim.inflight == 1  # a round that includes it is queued
    eng.abort(ids[1])
    assert victim.row is not None and eng.runner.allocator.num_used > 0  # still held by the step in flight
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            done[out.request_id] = out
    assert done[ids[1]].finish_reason == "abort"
    for rid, p in zip((ids[0], ids[2]), (PROMPTS[0], PROMPTS[2])):
        assert done[rid].token_ids == greedy_reference[p].token_ids
    assert_no_leaks(llm)


def test_seeded_sampling_same_with_speculation_batching_and_preemption(drafts):
    """The random key is (seed, position): speculative rounds commit exactly the plain run's samples, alone or
    batched, through preemption (8 concurrent seeded requests in a cache that holds about two)."""
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(8)]
    prompts = (PROMPTS + PROMPTS)[:8]
    plain = LLM(TARGET, page_size=16)
    alone = [plain.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    spec = build(True, "EAGLE3", drafts, k=4, s=3, n=8, page=4, max_total_tokens=128)
    outs = spec.generate(prompts, params)
    assert spec.engine.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == alone
    assert_no_leaks(spec)


def test_decode_keeps_running_between_prefill_chunks():
    """A long prompt is prefilled in chunks; decode steps of the running request alternate with them."""
    llm = LLM(TARGET, page_size=16, chunked_prefill_size=16)
    eng = llm.engine
    first = eng.add_request("def fib(n):", SamplingParams(max_tokens=40, ignore_eos=True))
    while len(eng.requests[first].output_ids) < 2:
        eng.step()
    long_prompt = "import os\n" * 40  # > 100 tokens: several chunks of 16
    eng.add_request(long_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    before = len(eng.requests[first].output_ids)
    for _ in range(6):
        eng.step()
    assert len(eng.requests[first].output_ids) - before >= 3  # decode ran between the chunks
    while eng.has_unfinished():
        eng.step()
    assert_no_leaks(llm)


def test_interrupted_generate_leaves_nothing_behind(monkeypatch):
    """KeyboardInterrupt (or any error) between steps: generate aborts what it queued; later calls are clean."""
    llm = LLM(TARGET, page_size=4)
    eng = llm.engine
    want = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    real_step, calls = eng.step, []

    def interrupted(**kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(**kwargs)

    monkeypatch.setattr(eng, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:4], SamplingParams(max_tokens=30, ignore_eos=True))
    monkeypatch.setattr(eng, "step", real_step)
    assert_no_leaks(llm)
    again = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in want]
    assert_no_leaks(llm)


def test_reverted_overlap_page_lookahead_fails_loudly(drafts, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "overlap_page_lookahead")
    llm = build(True, "EAGLE3", drafts, page=1)
    with pytest.raises(InvariantError, match="decode step of row .* pages x page_size 1"):
        llm.generate("def f(x):", SamplingParams(max_tokens=12, ignore_eos=True))


def test_reverted_release_after_inflight_fails_loudly(drafts, greedy_reference, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "release_after_inflight")
    llm = build(True, None, drafts, page=4)
    stop = greedy_reference[PROMPTS[0]].token_ids[5]
    with pytest.raises(InvariantError, match="while 1 launched step"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_NEW, stop_token_ids=(stop,), ignore_eos=True))


@pytest.mark.parametrize("argv,overlap", [([], True), (["--disable-overlap-schedule"], False)])
def test_cli_overlap_flag_reaches_the_engine(argv, overlap):
    from spruce.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu", *argv])
    llm = LLM(**engine_kwargs(args))
    assert llm.engine.limits.overlap is overlap
    assert llm.engine.info()["overlap_schedule"] == ("on" if overlap else "off")


def test_abort_between_prefill_chunks_stops_the_prompt():
    """A client gone during a long prompt: the abort lands between chunks and no further chunk runs."""
    llm = LLM(TARGET, page_size=16, chunked_prefill_size=16)
    eng = llm.engine
    rid = eng.add_request("import os\n" * 40, SamplingParams(max_tokens=4))  # > 100 tokens: several chunks
    eng.step()
    req = eng.requests[rid]
    assert 0 < req.committed < req.num_tokens  # one chunk in, more to go
    eng.abort(rid)
    outs = eng.drain()
    assert [o.finish_reason for o in outs] == ["abort"] and req.committed == 16
    assert not eng.has_unfinished()
    assert_no_leaks(llm)


def test_result_views_are_made_once_per_slot_and_shape():
    """A launched step's result lands in the head of a host buffer seen as the result's shape (`_result_view`):
    the same view for the same slot and shape, a view of that slot's buffer (no copy), shaped as asked. The
    buffers are page-locked on CUDA only; plain CPU tensors stand in for them here."""
    import torch

    engine = LLM(TARGET).engine
    engine._result_buffers = [torch.zeros(8, 5, dtype=torch.int64) for _ in range(2)]
    plain, plain_again = engine._result_view(1, torch.Size([3, 2])), engine._result_view(1, torch.Size([3, 2]))
    assert plain is plain_again and plain.shape == (3, 2)
    plain.copy_(torch.arange(6).view(3, 2))
    assert engine._result_buffers[1].view(-1)[:6].tolist() == list(range(6))  # the slot's own buffer, its head
    assert engine._result_buffers[0].abs().sum() == 0
    wide = engine._result_view(1, torch.Size([2, 5]))
    assert wide is not plain and wide.tolist() == [[0, 1, 2, 3, 4], [5, 0, 0, 0, 0]]
    assert engine._result_view(0, torch.Size([3, 2])) is not plain
