"""Tokenizer vs transformers' AutoTokenizer; chat templates; incremental detokenization."""

from __future__ import annotations

import json
import shutil

import pytest

from spruce.config import builtin_model_path
from spruce.errors import InvalidRequestError
from spruce.models.hf_config import ModelConfig
from spruce.models.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["", "héllo wörld ✓ 🙂", "def f():\n\treturn 1\n", "  leading spaces and 日本語テキスト 🇯🇵👩‍💻 end"]
MODEL_CONFIG = ModelConfig.from_dir(builtin_model_path())


@pytest.fixture(scope="module")
def toks(pycode19m):
    return Tokenizer.from_dir(pycode19m, ModelConfig.from_dir(pycode19m)), \
        transformers.AutoTokenizer.from_pretrained(pycode19m)


def tokenizer_dir(tmp_path, source, **config_changes):
    """A copy of `source`'s tokenizer files with tokenizer_config.json edited (None removes a key)."""
    d = tmp_path / "tok"
    d.mkdir(exist_ok=True)
    shutil.copy(source / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((source / "tokenizer_config.json").read_text())
    cfg.update(config_changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def both(d):
    return Tokenizer.from_dir(d, MODEL_CONFIG), transformers.AutoTokenizer.from_pretrained(d)


def test_encode_decode_match_transformers(toks, heldout_prompts):
    ours, hf = toks
    for text in heldout_prompts[:6] + TEXTS:
        ids = hf(text)["input_ids"]
        assert ours.encode(text) == ids
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_special_tokens(toks):
    ours, hf = toks
    assert ours.bos_token_id == hf.bos_token_id == 0
    assert hf.eos_token_id in ours.eos_token_ids


@pytest.mark.parametrize("flags", [dict(add_bos_token=True), dict(add_bos_token=False), dict(add_bos_token=None),
                                   dict(add_bos_token=True, add_eos_token=True)])
def test_bos_eos_flags_match_transformers(tmp_path, pycode19m, flags):
    """With a post-processor in tokenizer.json, it alone decides (transformers 5 ignores the flags too)."""
    ours, hf = both(tokenizer_dir(tmp_path, pycode19m, **flags))
    for text in TEXTS[1:]:
        assert ours.encode(text) == hf(text)["input_ids"], flags


def test_add_bos_token_without_post_processor(tmp_path, pycode19m):
    """No post-processor: add_bos_token=true prepends bos (transformers 4 did; 5 drops the flag), else nothing."""
    d = tokenizer_dir(tmp_path, pycode19m, add_bos_token=None)
    raw = json.loads((d / "tokenizer.json").read_text())
    (d / "tokenizer.json").write_text(json.dumps({**raw, "post_processor": None}))
    ours, hf = both(d)
    plain = hf("hi there")["input_ids"]
    assert ours.encode("hi there") == plain and plain[0] != ours.bos_token_id
    d = tokenizer_dir(tmp_path, pycode19m, add_bos_token=True)
    (d / "tokenizer.json").write_text(json.dumps({**raw, "post_processor": None}))
    ours = Tokenizer.from_dir(d, MODEL_CONFIG)
    assert ours.encode("hi there") == [ours.bos_token_id] + plain
    assert ours.encode("hi there", add_special_tokens=False) == plain


def test_chat_template_matches_transformers(toks):
    ours, hf = toks
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write fib"}]
    for gen in (True, False):
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
            hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


TEMPLATE = """{%- for m in messages %}
{%- if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}
{%- if loop.index > 3 %}{% break %}{% endif %}
{{ bos_token }}{{ m['role'] }}: {{ m['content'] | tojson }}
{% endfor %}
{%- if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"""


def test_chat_template_file_and_errors(tmp_path, pycode19m):
    d = tokenizer_dir(tmp_path, pycode19m, chat_template=None)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_dir(d, MODEL_CONFIG).apply_chat_template([{"role": "user", "content": "hi"}])
    (d / "chat_template.jinja").write_text(TEMPLATE)
    ours, hf = both(d)
    msgs = [{"role": "user", "content": f"<b>{i} & 'ü'</b>"} for i in range(5)]
    text = ours.apply_chat_template(msgs)
    assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "\"<b>0 & 'ü'</b>\"" in text and "3 &" not in text  # plain JSON (no HTML escapes); loop break
    with pytest.raises(InvalidRequestError, match="tool messages are not supported"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def stream(tok, ids, chunk=1):
    det = IncrementalDetokenizer(tok)
    parts = [det.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return parts, det.flush()


def test_incremental_detokenizer_equals_full_decode(toks, heldout_prompts):
    ours, _ = toks
    for text in TEXTS + heldout_prompts[:2]:
        ids = ours.encode(text)
        for chunk in (1, 3):
            parts, rest = stream(ours, ids, chunk)
            assert "".join(parts) + rest == ours.decode(ids)
            assert not any("\ufffd" in p for p in parts)  # multi-token characters are never split
    emoji = ours.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1 and stream(ours, emoji)[0][:-1] == [""] * (len(emoji) - 1)
    parts, rest = stream(ours, emoji[:-1])  # ends inside a character: flush gives what decode gives
    assert "".join(parts) + rest == ours.decode(emoji[:-1])


@pytest.fixture(scope="module")
def sentencepiece_style(tmp_path_factory):
    """A Llama-2-style tokenizer (Metaspace '▁', byte fallback <0xNN>, leading-space strip) trained here."""
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, models, normalizers, processors, trainers

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "def main(): return 0"] * 20
    tok = HFTok(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    trained = json.loads(tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    sp = HFTok(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    sp.normalizer = tok.normalizer
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    sp.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", 1)])
    d = tmp_path_factory.mktemp("sp")
    sp.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "bos_token": "<s>", "eos_token": "</s>"}))
    return d


def test_sentencepiece_style_tokenizer(sentencepiece_style):
    ours, hf = both(sentencepiece_style)
    assert ours.bos_token_id == 1 and 2 in ours.eos_token_ids
    for text in TEXTS + ["hello world  the fox", " leading space", "ünïcödé → 🙂 done"]:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        parts, rest = stream(ours, ids)
        assert "".join(parts) + rest == ours.decode(ids)
        assert not any("\ufffd" in p for p in parts)


def test_the_library_stream_adds_what_the_python_windows_add(toks, sentencepiece_style, heldout_prompts):
    """IncrementalDetokenizer.add runs the library's DecodeStream where it decodes as decode() does: chunk by chunk,
    every add returns what the Python window decode returns, after a prompt's tail as context and with special
    tokens in the stream, for a byte-level BPE and a SentencePiece-style tokenizer (byte fallback, leading-space
    strip); a tokenizer that cleans up spaces keeps the windows."""
    import random

    rng = random.Random(0)
    for tok in (toks[0], Tokenizer.from_dir(sentencepiece_style, MODEL_CONFIG)):
        for text in TEXTS + heldout_prompts[:2]:
            ids = tok.encode(text)
            ids = ids[:3] + [next(iter(tok.eos_token_ids))] + ids[3:]  # a special token mid-stream
            context = tok.encode(heldout_prompts[2])[-10:]
            fast, slow = IncrementalDetokenizer(tok, context), IncrementalDetokenizer(tok, context)
            slow._step = None
            assert fast._step is not None
            k = 0
            while k < len(ids):
                n = rng.randrange(1, 6)
                assert fast.add(ids[k:k + n]) == slow.add(ids[k:k + n])
                k += n
            assert fast.flush() == slow.flush()
    cleaning = Tokenizer.from_dir(sentencepiece_style, MODEL_CONFIG)
    cleaning._cleanup = True
    assert IncrementalDetokenizer(cleaning)._step is None
