"""The offline API refuses malformed calls with an error naming what is wrong, and loses nothing."""

from __future__ import annotations

import pytest

from spruce import LLM, InvalidRequestError, SamplingParams
from conftest import assert_no_leaks


@pytest.fixture(scope="module")
def llm():
    return LLM(page_size=4)


@pytest.mark.parametrize("prompts,params,field,words", [
    ("a", {"max_tokens": 4}, "sampling_params", "not a dict"),
    ("a", [{"max_tokens": 4}], "sampling_params", "must be SamplingParams"),
    (b"def f():", None, "prompt", "bytes"),
    (["a", "b"], [SamplingParams()], "sampling_params", "one per prompt"),
])
def test_malformed_generate_is_refused(llm, prompts, params, field, words):
    with pytest.raises(InvalidRequestError, match=words) as e:
        llm.generate(prompts, params)
    assert e.value.field == field
    assert_no_leaks(llm)
    assert len(llm.generate("def ok():", SamplingParams(max_tokens=3))[0].token_ids) == 3
