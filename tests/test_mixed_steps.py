"""Mixed steps (runtime/mixed_step.py): with plain decoding, prompt chunks run inside decode steps. Every request gets
the tokens it gets with mixing off (prefill and decode steps alternating): greedy token for token, seeded sampling,
penalties, logit bias, min_tokens, logprobs and prompt logprobs, stop strings and stop tokens, across staggered
arrivals, with overlap on and off, pages of 1 and 16 tokens, through preemption and prefix-cache hits. A staggered
batch runs fewer forwards (weight reads) with mixing on; speculative engines keep alternating.

Target: the bundled pycode-6m. One engine per (overlap, page) runs both modes: mixing is the scheduler's switch
(`Scheduler.mixed_steps`), turned on by the engine for plain decoding (`mixed_steps=True`, the default).
"""

from __future__ import annotations

import pytest

from spruce import LLM, SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.errors import InvariantError
from spruce.runtime.mixed_step import check_decode_positions, decode_positions
from spruce.runtime.request import Request, Status
from conftest import assert_no_leaks

TARGET = builtin_model_path()
PROMPTS = [
    "def fib(n):\n    ",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n",
    "for i in range(10):",
    "x = [",
    "with open(path) as f:\n    for line in f:\n        ",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]
PARAMS = [
    SamplingParams(max_tokens=16, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.7, seed=5, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.2, ignore_eos=True),
    SamplingParams(max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=16, stop=["\n    ", "):"], ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=1.0, seed=3, min_tokens=6, logit_bias={13: 4.0}),
    SamplingParams(max_tokens=3, ignore_eos=True),
]
EVERY = 4  # tokens generated (by all requests) between arrivals


@pytest.fixture(scope="module")
def engines():
    """(overlap, page) -> an LLM, made on first use."""
    made: dict[tuple[bool, int], LLM] = {}

    def get(overlap: bool, page: int) -> LLM:
        if (overlap, page) not in made:
            made[(overlap, page)] = LLM(TARGET, page_size=page, max_running_requests=8,
                                        disable_overlap_schedule=not overlap)
        return made[(overlap, page)]

    return get


def staggered(llm: LLM, mixed: bool, prompts=PROMPTS, params=PARAMS, every: int = EVERY):
    """Run the requests arriving one at a time, request i once the engine has generated every * i tokens (a
    clock of work done, not of steps: both modes admit each request at the same point of the others' outputs),
    with mixing `mixed`. Returns (outputs in order, the step counters' change)."""
    eng = llm.engine
    eng.scheduler.mixed_steps = mixed
    eng.flush_cache()
    before = dict(eng.stats()["steps"])
    start = eng.tokens_generated
    ids: dict[str, int] = {}
    outs: dict[int, object] = {}
    while len(ids) < len(prompts) or eng.has_unfinished():
        while len(ids) < len(prompts) and eng.tokens_generated - start >= every * len(ids):
            ids[eng.add_request(prompts[len(ids)], params[len(ids)])] = len(ids)
        for o in eng.step():
            if o.finished:
                outs[ids[o.request_id]] = o
    assert_no_leaks(llm)
    after = eng.stats()["steps"]
    return [outs[i] for i in range(len(prompts))], {k: after[k] - before[k] for k in ("prefills", "decodes", "mixed")}


def assert_same_outputs(got, want):
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        for name in ("logprobs", "prompt_logprobs"):
            gl, wl = getattr(g, name), getattr(w, name)
            assert (gl is None) == (wl is None)
            for ge, we in zip(gl or (), wl or ()):
                assert (ge is None) == (we is None)
                if ge is not None:
                    assert list(ge) == list(we)  # the same tokens, in the same order
                    assert [e.rank for e in ge.values()] == [e.rank for e in we.values()]
                    assert [e.logprob for e in ge.values()] == pytest.approx([e.logprob for e in we.values()],
                                                                             abs=1e-5)


@pytest.fixture(scope="module")
def alternating(engines):
    """overlap -> (outputs, step counts) of the staggered batch with mixing off (pages of 16 tokens: the page size
    changes no output)."""
    made = {}

    def get(overlap: bool):
        if overlap not in made:
            made[overlap] = staggered(engines(overlap, 16), mixed=False)
        return made[overlap]

    return get


@pytest.mark.parametrize("overlap,page", [(True, 1), (True, 16), (False, 16)])
def test_mixed_steps_give_the_alternating_outputs_with_fewer_forwards(engines, alternating, overlap, page):
    want, off = alternating(overlap)
    got, on = staggered(engines(overlap, page), mixed=True)
    assert_same_outputs(got, want)
    assert off["mixed"] == 0 and on["mixed"] >= len(PROMPTS) - 2  # (the first arrives to an idle engine)
    assert on["prefills"] < off["prefills"]
    assert on["prefills"] + on["decodes"] < off["prefills"] + off["decodes"]  # forwards: the weights read
    assert any(o.finish_reason == "stop" for o in got) and any(o.finish_reason == "length" for o in got)


def test_preemption_and_prefix_cache_hits_inside_mixed_steps():
    """A KV cache too small for every request preempts the youngest (its prompt and output are recomputed, in
    mixed steps too), and prompts sharing a prefix take it from the prefix cache: the outputs are the same."""
    shared = "import os\nimport sys\nimport json\n\n\ndef load(path):\n    with open(path) as f:\n        "
    prompts = [shared + tail for tail in ("return json.load(f)\n", "data = f.read()\n", "for line in f:\n", "pass\n")]
    params = [SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.9, seed=21, ignore_eos=True)] * 2
    llm = LLM(TARGET, page_size=4, max_running_requests=4, max_total_tokens=120)
    sched = llm.engine.scheduler
    runs = []
    for mixed in (False, True):
        preempted, hits = sched.num_preemptions, sched.prefix_cache.hit_tokens
        runs.append(staggered(llm, mixed, prompts, params, every=2))
        assert sched.num_preemptions > preempted and sched.prefix_cache.hit_tokens > hits  # each run has both
    (want, _), (got, on) = runs
    assert_same_outputs(got, want)
    assert on["mixed"] > 0


def test_structured_output_inside_mixed_steps(engines):
    pytest.importorskip("llguidance", reason="structured output needs spruce[grammar] (llguidance)")
    params = list(PARAMS)
    params[1] = SamplingParams(max_tokens=12, regex=r"[a-z]+( [a-z]+)*")
    params[3] = SamplingParams(max_tokens=8, choice=["yes", "no", "maybe"])
    llm = engines(True, 16)
    want, _ = staggered(llm, False, PROMPTS[:4], params[:4])
    got, on = staggered(llm, True, PROMPTS[:4], params[:4])
    assert_same_outputs(got, want)
    assert on["mixed"] > 0 and got[3].text in ("yes", "no", "maybe")


def test_decode_rows_filling_the_token_budget_alternate(engines):
    """With chunked_prefill_size no larger than the decode batch a mixed step has no room for prompt tokens:
    prefill and decode steps alternate (and a mixed step's chunks take the budget less one token per decode row)."""
    llm = LLM(TARGET, page_size=16, max_running_requests=8, chunked_prefill_size=3)
    sched = llm.engine.scheduler
    assert sched.mixed_prefill_budget(2) == 1 and sched.mixed_prefill_budget(3) == 0
    prefilling = Request("p", [1] * 9, SamplingParams(), 0, 0, status=Status.PREFILL, token_limit=20)
    decoding = [Request(f"d{i}", [1] * 4, SamplingParams(), 0, i + 1, status=Status.DECODE, token_limit=20)
                for i in range(3)]
    sched.running = [prefilling, *decoding[:2]]  # (the engine is idle: its queues are borrowed)
    assert [sched.next_step()[0] for _ in range(2)] == ["mixed", "mixed"]
    sched.running = [prefilling, *decoding]
    assert [sched.next_step()[0] for _ in range(3)] == ["prefill", "decode", "prefill"]
    sched.running = []
    prompts, params = PROMPTS[2:5], [SamplingParams(max_tokens=6, ignore_eos=True)] * 3
    want, off = staggered(llm, False, prompts, params, every=2)
    got, on = staggered(llm, True, prompts, params, every=2)
    assert_same_outputs(got, want)
    assert 0 < on["mixed"] and on["prefills"] > 0  # mixed while 1-2 requests decode, alternating from 3 on


def test_prefill_spans_share_the_budget_oldest_first(engines):
    sched = engines(True, 16).engine.scheduler

    class Q:
        def __init__(self, num_tokens, committed):
            self.num_tokens, self.committed = num_tokens, committed

    a, b, c = Q(60, 0), Q(70, 10), Q(5, 0)
    assert sched.prefill_spans([a, b, c], 100) == [(a, 0, 60), (b, 10, 40)]
    assert sched.prefill_spans([a, b, c], 60) == [(a, 0, 60)]


def test_decode_positions_count_the_decode_step_in_flight():
    class Q:
        def __init__(self, committed):
            self.committed = committed

    a, b = Q(12), Q(30)
    assert decode_positions([a, b], [b]) == [12, 31]
    assert decode_positions([a, b], ()) == [12, 30]


def test_debug_check_names_a_position_off_the_device(engines):
    llm = engines(False, 16)
    eng = llm.engine
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()  # the prefill: its row is at the prompt's length on the device
    q = eng.requests[rid]
    check_decode_positions(eng.runner, [q.row], [q.committed])
    with pytest.raises(InvariantError, match="on the device"):
        check_decode_positions(eng.runner, [q.row], [q.committed + 1])
    while eng.has_unfinished():
        eng.step()


def test_the_flag_turns_mixing_off_and_speculative_engines_alternate():
    off = LLM(TARGET, page_size=16, max_running_requests=8, mixed_steps=False)
    assert off.engine.info()["mixed_steps"] == "off"
    _, steps = staggered(off, off.engine.scheduler.mixed_steps, PROMPTS[:2], PARAMS[:2])
    assert steps["mixed"] == 0
    if not builtin_draft_path().exists():
        pytest.skip("bundled draft head absent")
    spec = LLM(TARGET, page_size=16, max_running_requests=8, draft_model=str(builtin_draft_path()),
               speculative_algorithm="EAGLE3")
    assert spec.engine.info()["mixed_steps"] == "off" and not spec.engine.scheduler.mixed_steps


@pytest.mark.gpu
@pytest.mark.parametrize("page", [1, 16])
def test_gpu_mixed_steps_equal_alternating_with_graphs(page):
    """On the GPU (float32, CUDA graphs: decode steps replay decode graphs, mixed steps prefill graphs; overlap with
    pinned result buffers): the same tokens with mixing on and off, in fewer forwards."""
    llm = LLM(TARGET, device="cuda", dtype="float32", page_size=page, max_running_requests=8, cuda_graph=True,
              attention_backend="triton")
    want, off = staggered(llm, False)
    got, on = staggered(llm, True)
    assert_same_outputs(got, want)
    assert on["mixed"] >= len(PROMPTS) - 2 and on["prefills"] + on["decodes"] < off["prefills"] + off["decodes"]
