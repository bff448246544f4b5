"""Named model shapes for benchmarks with random weights (speed does not depend on the values)."""

from __future__ import annotations

import json
from pathlib import Path

# what Llama-3.1-8B and -70B share (they differ in width, depth and query heads)
_LLAMA_31 = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=8, head_dim=128, vocab_size=128256,
    rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
    eos_token_id=128001, rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)

TARGET_SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(**_LLAMA_31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32),
    # Llama-3.1-70B: 141 GB of bf16 weights, more than one GPU holds (tensor parallelism: --tp-size 2 on H200s)
    "llama-3.1-70b": dict(**_LLAMA_31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    # DeepSeek-V2-Lite: 15.7B parameters, 2.4B active (MLA without q_lora, 64 routed experts top-6 + 2 shared)
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        moe_layer_freq=1, n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0, scoring_func="softmax", vocab_size=102400, rms_norm_eps=1e-6,
        max_position_embeddings=163840, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
        rope_theta=10000.0,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                          mscale=0.707, mscale_all_dim=0.707),
    ),
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active (48 layers, 128 routed experts top-8, no shared expert, GQA 32/4)
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        attention_bias=False, hidden_act="silu", vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=40960,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, rope_theta=1000000.0, rope_scaling=None,
        use_sliding_window=False, sliding_window=None,
    ),
    # gpt-oss-20b: 21B parameters, 3.6B active (24 layers alternating a 128-token sliding window and full attention,
    # attention sinks, 32 experts top-4 with biases and the clamped SwiGLU); bf16 experts here, both engines
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, experts_per_token=4, attention_bias=True, hidden_act="silu", swiglu_limit=7.0,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, vocab_size=201088,
        rms_norm_eps=1e-5, max_position_embeddings=131072, initial_context_length=4096, tie_word_embeddings=False,
        bos_token_id=199998, eos_token_id=200002, pad_token_id=199999, rope_theta=150000.0,
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                          original_max_position_embeddings=4096, truncate=False),
    ),
}


def eagle3_shape(target: dict, draft_vocab_size: int = 32000) -> dict:
    """An EAGLE-3 head shaped like the published ones for `target` (one decoder layer, draft vocab)."""
    return dict(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=target["hidden_size"],
        intermediate_size=target["intermediate_size"], num_hidden_layers=1,
        num_attention_heads=target["num_attention_heads"], num_key_value_heads=target["num_key_value_heads"],
        head_dim=target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"], vocab_size=target["vocab_size"], draft_vocab_size=draft_vocab_size,
        rms_norm_eps=target["rms_norm_eps"], max_position_embeddings=target["max_position_embeddings"],
        rope_theta=target["rope_theta"], rope_scaling=target.get("rope_scaling"), tie_word_embeddings=False,
    )


def write_shape_dirs(name: str, root: Path, tokenizer: bool = False) -> tuple[Path, Path]:
    """config.json-only directories for the target shape and its EAGLE-3 draft (load_format='dummy'), no weights;
    with `tokenizer`, the target's directory also gets a word-level tokenizer of its vocabulary
    (`write_word_tokenizer`), so that servers take text and clients make random prompts at that vocabulary."""
    if name not in TARGET_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(TARGET_SHAPES)}")
    target = dict(TARGET_SHAPES[name], torch_dtype="bfloat16")
    tdir, ddir = root / name, root / f"{name}-eagle3"
    for d, cfg in ((tdir, target), (ddir, dict(eagle3_shape(target), torch_dtype="bfloat16"))):
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer:
        write_word_tokenizer(tdir, target["vocab_size"], target["bos_token_id"], target["eos_token_id"])
    return tdir, ddir


def word(token_id: int) -> str:
    """The word of token `token_id` in `write_word_tokenizer`'s vocabulary: 'w<id>'."""
    return f"w{token_id}"


def write_word_tokenizer(directory: Path, vocab_size: int, bos_token_id: int, eos_token_id: int) -> None:
    """tokenizer.json + tokenizer_config.json of a word-level tokenizer: token i is the word 'w<i>', words split at
    whitespace (any text of such words encodes to as many tokens as it has words, and decoding joins them with
    spaces), bos/eos the model's. Vocabulary-exact and cheap: a benchmark's random token ids round-trip as text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": word(bos_token_id),
        "eos_token": word(eos_token_id), "model_max_length": 1 << 20}))


def main(argv: list[str] | None = None) -> int:
    """`python -m spruce.bench.shapes NAME DIR`: write the shape's config-only target (with its word tokenizer) and
    EAGLE-3 draft directories under DIR; print their paths."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m spruce.bench.shapes", description=main.__doc__, allow_abbrev=False)
    ap.add_argument("name", choices=sorted(TARGET_SHAPES))
    ap.add_argument("root", type=Path)
    args = ap.parse_args(argv)
    target, draft = write_shape_dirs(args.name, args.root, tokenizer=True)
    print(target, draft)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
