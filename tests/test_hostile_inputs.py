"""The offline API under hostile input (issue 76): every bad prompt or parameter raises spruce's own
InvalidRequestError naming the field (never the tokenizer library's TypeError or OverflowError, never silently
accepted), the tokenizer refuses ids it cannot decode, text_offset widths follow the decoded text, and a
tensor-parallel engine nothing refers to any more leaves its process group so that another can be built.

The server side of the same inputs (a live `spruce serve`) is in tests/test_server_fuzz.py.
"""

from __future__ import annotations

import re

import pytest

from conftest import assert_no_leaks
from spruce import LLM, InvalidRequestError, SamplingParams
from spruce.errors import ConfigError

VOCAB = 4096  # the bundled demo model's


@pytest.fixture(scope="module")
def llm():
    return LLM(page_size=4)


@pytest.mark.parametrize("prompts,params,field,says", [
    ("int a\ud800b", {}, "prompt", "lone surrogate (U+D800) at character 5"),
    (["def ok():", "x\udfff"], {}, "prompt", "lone surrogate (U+DFFF) at character 1"),
    (5, {}, "prompt", "got int"),
    (None, {}, "prompt", "got NoneType"),
    ({"def f": 1}, {}, "prompt", "got dict"),
    ("def f", {"stop": ["a\ud800"]}, "stop", "lone surrogate"),
    ("def f", {"stop_token_ids": [2**70]}, "stop_token_ids", f"[0, {VOCAB}), got [{2**70}]"),
    ("def f", {"stop": 7}, "stop", "a string or a list of strings, got int"),
    ("def f", {"stop_token_ids": {5: 1}}, "stop_token_ids", "a list of token ids, got dict"),
    ("def f", {"ignore_eos": "yes"}, "ignore_eos", "True or False"),
])
def test_bad_input_raises_spruce_errors(llm, prompts, params, field, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as e:
        llm.generate(prompts, SamplingParams(max_tokens=2, **params))
    assert e.value.field == field
    assert_no_leaks(llm)


def test_decode_refuses_ids_it_cannot_take(llm):
    tok = llm.tokenizer
    for ids in ([-1], [2**40], [2**70], [3, VOCAB]):
        with pytest.raises(InvalidRequestError, match=re.escape(f"[0, {VOCAB})")):
            tok.decode(ids)


def test_text_widths_follow_the_decoded_text(llm):
    """Each token's width is what it adds to the decoded text: 0 for <|begin_of_text|> (decode leaves it out) and
    for the first byte of a two-token character; the widths sum to the text's length, with or without context."""
    tok = llm.tokenizer
    ids = tok.encode('def f(x):\n    return "héllo→"')
    widths = tok.text_widths(ids)
    assert ids[0] == tok.bos_token_id and widths[0] == 0
    assert sum(widths) == len(tok.decode(ids))
    split = [i for i, t in enumerate(ids) if tok.token_text(t) == "\ufffd"]
    assert split and any(widths[i] == 0 for i in split)  # é spans two byte tokens: the first adds nothing yet
    assert sum(tok.text_widths(ids[5:], ids[:5])) == len(tok.decode(ids)) - len(tok.decode(ids[:5]))


def test_collected_tp_engine_leaves_its_group():
    """tp_size=2 on the CPU (gloo): a second engine while the first is open is refused at once, naming shutdown();
    after `del llm` a second LLM(tp_size=2) in the same process builds and generates the same tokens."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(tp_size=2, page_size=4)
    try:
        with pytest.raises(ConfigError, match=re.escape("shutdown()")):
            LLM(tp_size=2, page_size=4)
        want = llm.generate("def f(", params)[0].token_ids
    except BaseException:
        llm.shutdown()
        raise
    del llm
    again = LLM(tp_size=2, page_size=4)
    try:
        assert again.generate("def f(", params)[0].token_ids == want
    finally:
        again.shutdown()
