"""load_format='dummy' (`--load-format dummy`): a target and an EAGLE-3 head built from config.json alone, random
weights, no safetensors read; the bench shapes' config-only directories and their word-level tokenizer."""

from __future__ import annotations

import json
import math

import pytest

from spruce import SamplingParams
from spruce.bench.shapes import TARGET_SHAPES, eagle3_shape, write_shape_dirs, write_word_tokenizer
from spruce.errors import ModelLoadError
from spruce.models.hf_config import ModelConfig

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
            rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, rope_theta=10000.0)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A config-only tiny Llama (with a word tokenizer) and a config-only EAGLE-3 head for it."""
    root = tmp_path_factory.mktemp("tiny")
    target, draft = root / "target", root / "draft"
    for d, cfg in ((target, TINY), (draft, dict(eagle3_shape(TINY, draft_vocab_size=128)))):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    write_word_tokenizer(target, TINY["vocab_size"], TINY["bos_token_id"], TINY["eos_token_id"])
    return target, draft


def test_dummy_weights_need_no_safetensors_and_run_finite_in_bfloat16(tiny_dirs):
    from spruce import LLM

    target, draft = tiny_dirs
    with pytest.raises(ModelLoadError, match="no \\*.safetensors files"):  # the same directory, loaded for real
        LLM(target)
    llm = LLM(target, dtype="bfloat16", load_format="dummy", draft_model=draft, speculative_num_steps=3,
              speculative_eagle_topk=2, speculative_num_draft_tokens=4, speculative_synthetic_acceptance_length=2.5,
              max_running_requests=4, context_length=128)
    out = llm.generate(["w5 w77 w300", "w9"], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1))
    for o in out:
        assert len(o.token_ids) == 12 and all(0 <= t < TINY["vocab_size"] for t in o.token_ids)
        values = [lp.logprob for entry in o.logprobs for lp in entry.values()]
        assert len(values) >= 12 and all(math.isfinite(v) for v in values), values
        assert o.spec_stats["rounds"] > 0
    assert out[0].prompt_token_ids[-3:] == [5, 77, 300]


def test_dummy_weights_are_seeded(tiny_dirs):
    from spruce import LLM

    target, _ = tiny_dirs
    runs = [LLM(target, load_format="dummy", max_running_requests=2, context_length=64).generate(
        ["w3 w4"], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_word_tokenizer_round_trips_ids(tiny_dirs):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_dirs[0] / "tokenizer.json"))
    assert tok.encode("w5 w77  w300").ids == [5, 77, 300]
    assert tok.decode([5, 77, 300]) == "w5 w77 w300"
    assert tok.get_vocab_size() == TINY["vocab_size"]


@pytest.mark.parametrize("name", sorted(TARGET_SHAPES))
def test_shape_dirs_hold_configs_only(tmp_path, name):
    target, draft = write_shape_dirs(name, tmp_path)
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]
    assert sorted(p.name for p in draft.iterdir()) == ["config.json"]
    cfg = ModelConfig.from_dir(target)
    assert cfg.vocab_size == TARGET_SHAPES[name]["vocab_size"]
    assert json.loads((draft / "config.json").read_text())["hidden_size"] == TARGET_SHAPES[name]["hidden_size"]


SHRINK = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=3,
              max_position_embeddings=512, sliding_window=8)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_moe_shapes_serve_dummy_weights_with_an_eagle3_head(tmp_path, name):
    """The MoE bench shapes, narrowed (same architecture and config keys, 4 layers, 4 experts top-2), run with dummy weights
    and their EAGLE-3-shaped head, past the gpt-oss window."""
    from spruce import LLM

    shape = TARGET_SHAPES[name]
    cfg = {**shape, **{k: v for k, v in SHRINK.items() if k in shape}, "num_hidden_layers": 4}
    for experts in ("num_experts", "num_local_experts"):
        if experts in cfg:
            cfg[experts] = 4
    cfg["num_experts_per_tok"] = cfg["experts_per_token"] = 2
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:4]
    target, draft = tmp_path / "target", tmp_path / "draft"
    for d, c in ((target, cfg), (draft, eagle3_shape(cfg, draft_vocab_size=128))):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
    write_word_tokenizer(target, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    llm = LLM(target, dtype="bfloat16", load_format="dummy", draft_model=draft, speculative_num_steps=2,
              speculative_eagle_topk=1, speculative_num_draft_tokens=3, speculative_synthetic_acceptance_length=2.0,
              max_running_requests=2, context_length=64)
    out = llm.generate([" ".join(f"w{i}" for i in range(5, 17))], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8 and out[0].spec_stats["rounds"] > 0
