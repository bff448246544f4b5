"""Tokenizer vs transformers' AutoTokenizer; chat template; incremental detokenization."""

import pytest

from spruce.models.hf_config import ModelConfig
from spruce.models.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def toks(pycode19m):
    return Tokenizer.from_dir(pycode19m, ModelConfig.from_dir(pycode19m)), \
        transformers.AutoTokenizer.from_pretrained(pycode19m)


def test_encode_decode_match_transformers(toks, heldout_prompts):
    ours, hf = toks
    for text in heldout_prompts[:6] + ["", "héllo wörld ✓ 🙂", "def f():\n\treturn 1\n"]:
        assert ours.encode(text) == hf(text)["input_ids"]
        ids = hf(text)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens(toks):
    ours, hf = toks
    assert ours.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in ours.eos_token_ids


def test_chat_template_matches_transformers(toks):
    ours, hf = toks
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write fib"}]
    assert ours.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_incremental_detokenizer_equals_full_decode(toks):
    ours, _ = toks
    ids = ours.encode("emoji 🙂 and ünïcode\n    return x")
    det = IncrementalDetokenizer(ours)
    text = "".join(det.add([i]) for i in ids)
    assert text == ours.decode(ids)
