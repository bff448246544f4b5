"""Rope tables cover every position a forward can reach, by Limits (Limits.rope_positions); speculative_num_steps is
bounded; the Triton rotary kernel reads nothing past its table (CPU: Triton's interpreter, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

import spruce.ops.fused as F
from spruce import LLM, SamplingParams
from spruce.config import MAX_NUM_STEPS, builtin_draft_path, builtin_model_path, make_speculative_config
from spruce.errors import ConfigError
from spruce.models.rope import Rotary

TARGET = builtin_model_path()


def rope_tables(llm) -> set[int]:
    """The row counts of every rope table of the engine's target and draft."""
    r = llm.engine.runner
    models = [r.target] + ([r.draft] if r.draft is not None else [])
    return {m.num_positions for model in models for m in model.modules() if isinstance(m, Rotary)}


@pytest.mark.parametrize("steps", [3, MAX_NUM_STEPS])
def test_rope_tables_are_sized_by_limits(steps):
    """The target's and the draft's tables have Limits.rope_positions rows: the context plus the lookahead past it
    that a round reaches (S+1 per step ahead), whatever the model's max_position_embeddings (2048)."""
    llm = LLM(TARGET, draft_model=str(builtin_draft_path()), speculative_num_steps=steps, speculative_eagle_topk=1,
              speculative_num_draft_tokens=2, page_size=16, context_length=256)
    lim = llm.engine.limits
    assert lim.rope_positions >= lim.context_length + lim.lookahead
    assert rope_tables(llm) == {lim.rope_positions}


def test_deep_round_at_the_end_of_the_context():
    """A prompt 6 tokens short of the context, rounds of a deep chain (S=31, K=1, N=2) under overlap: draft and tree
    tokens reach up to 2 (S+1) positions past the context (tables of context_length rows would not hold them); the
    request ends at the context."""
    llm = LLM(TARGET, draft_model=str(builtin_draft_path()), speculative_num_steps=31, speculative_eagle_topk=1,
              speculative_num_draft_tokens=2, page_size=16, context_length=64)
    prompt = [(7 * i) % 500 + 5 for i in range(58)]
    out = llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert len(out.token_ids) == 6
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("steps", [0, MAX_NUM_STEPS + 1, 262])
def test_speculative_num_steps_is_bounded(steps):
    with pytest.raises(ConfigError, match=rf"speculative_num_steps={steps} is outside \[1, {MAX_NUM_STEPS}\]"):
        make_speculative_config("EAGLE3", str(builtin_draft_path()), steps, 1, 2)


@pytest.fixture
def force_triton():
    pytest.importorskip("triton")
    F._FORCE_TRITON[0] = True
    yield
    F._FORCE_TRITON[0] = False


def test_rotary_kernel_reads_nothing_past_its_table(force_triton):
    """The tables are the first 8 rows of a larger buffer whose further rows hold a sentinel: positions 8 and 9 (past
    the table) read none of it, their rows turn NaN; the others equal the torch reference."""
    rot = Rotary(16, 10, 10000.0, None)
    sentinel = torch.full((2, 8), 1e30)
    cos, sin = (torch.cat([t[:8], sentinel])[:8] for t in (rot.cos, rot.sin))  # [8, 8] views of [10, 8] buffers
    x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 7, 8, 9])
    out = F.rotary_(x.clone(), cos, sin, pos)
    inside = pos < 8
    assert torch.equal(out[inside], F.rotary_reference(x[inside], cos, sin, pos[inside]))
    assert out[~inside].isnan().all()
