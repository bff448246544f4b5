"""An empty batch (0 requests) is a valid input to every phase (DESIGN §5): prefill, plain decode, and each phase of
a speculative round (draft decode, verify, draft extend), run the way a decode step runs them (BucketGraphs.run,
planned), and a whole round, greedy and sampled. The bundled demo model with its trained EAGLE-3 head; the torch
backend, and the triton one through Triton's CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from spruce import LLM
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.runtime.sampler import SamplingTensors
from spruce.runtime.strategy import PlainDecoding

N = 8  # verify tree width
BACKENDS = ["torch", "triton"]


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request):
    return LLM(builtin_model_path(), draft_model=str(builtin_draft_path()), speculative_num_steps=3,
               speculative_eagle_topk=4, speculative_num_draft_tokens=N, page_size=4, max_running_requests=4,
               context_length=64, attention_backend=request.param)


def row_state(llm) -> tuple[torch.Tensor, ...]:
    """Every row's committed length and last token, and the round's carried draft state (copies)."""
    w = llm.engine.strategy
    committed, last = llm.engine.runner.row_state.gather(torch.arange(llm.engine.limits.num_rows))
    return committed.clone(), last.clone(), w.topk_ids.clone(), w.hidden.clone()


def assert_unchanged(before, after):
    for b, a in zip(before, after):
        assert torch.equal(b, a)


def run_phase(llm, index: int, *previous):
    """Phase `index` of the N-wide round (0 draft, 1 verify, 2 extend) over 0 requests, as a decode step runs it."""
    worker = llm.engine.strategy
    worker.fill_rows([])
    name, fn, plan = worker._phases[N][index]
    return llm.engine.runner.graphs.run(name, fn, 0, 1, *previous, plan=plan)


def test_prefill_of_no_chunks(llm):
    before = row_state(llm)
    out = llm.engine.strategy.prefill([], SamplingTensors.greedy())
    assert out.shape == (0, llm.engine.limits.step_result_width)
    assert_unchanged(before, row_state(llm))


def test_plain_decode_of_no_requests(llm):
    out = PlainDecoding(llm.engine.runner).decode([], 1, SamplingTensors.greedy())
    assert out.shape == (0, llm.engine.limits.plain_result_width)


def test_draft_decode_phase_of_no_requests(llm):
    tree = run_phase(llm, 0)
    assert tree.tokens.shape == (0, N) and tree.masks.shape[:2] == (0, N)


def test_verify_phase_of_no_requests(llm):
    verified = run_phase(llm, 1, run_phase(llm, 0))
    assert verified.logits.shape == (0, llm.engine.runner.model_config.vocab_size)
    assert verified.features.shape[0] == 0


def test_draft_extend_phase_of_no_requests(llm):
    before = row_state(llm)
    out = run_phase(llm, 2, run_phase(llm, 1, run_phase(llm, 0)))
    assert out.shape == (0, llm.engine.limits.step_result_width)
    assert_unchanged(before, row_state(llm))


@pytest.mark.parametrize("sampled", [False, True])
def test_round_of_no_requests(llm, sampled):
    """A whole round; sampled: the eager selection and acceptance between verify and extend run too."""
    empty = torch.zeros(0)
    sampling = (SamplingTensors(empty, empty, empty.long(), empty.long(), all_greedy=False) if sampled
                else SamplingTensors.greedy())
    before = row_state(llm)
    out = llm.engine.strategy.decode([], 1, sampling)
    assert out.shape == (0, llm.engine.limits.step_result_width)
    assert_unchanged(before, row_state(llm))
