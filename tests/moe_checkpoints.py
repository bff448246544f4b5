"""Tiny random MoE targets written by transformers' own save_pretrained (the published layouts by
construction): Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss and Llama 4 (text)."""

from __future__ import annotations

from pathlib import Path

import torch

CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM"),
}


def moe_config_kwargs(variant: str, experts: int, top_k: int) -> dict:
    """The expert fields each architecture names its own way."""
    if variant in ("mixtral", "gpt_oss"):
        return dict(num_local_experts=experts, num_experts_per_tok=top_k)
    if variant == "llama4":
        return dict(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size_mlp=96)
    kw = dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=32, norm_topk_prob=True)
    if variant == "qwen2_moe":
        kw["shared_expert_intermediate_size"] = 48
    return kw


def write_moe_checkpoint(path, variant: str, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                         kv_heads: int = 2, vocab: int = 256, experts: int = 8, top_k: int = 2,
                         intermediate: int = 64, init_std: float = 0.2, max_pos: int = 512, **extra) -> Path:
    """A random `variant` model (CONFIGS) saved by transformers; `extra` goes to its config (decoder_sparse_step,
    mlp_only_layers, norm_topk_prob, sliding_window, layer_types, rope_parameters...). Every 1-d parameter
    (norms, biases, attention sinks) and gpt-oss's expert biases are perturbed away from their init so that a
    mis-loaded one shows."""
    import transformers

    path = Path(path)
    cfg_name, model_name = CONFIGS[variant]
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
              max_position_embeddings=max_pos, initializer_range=init_std, rms_norm_eps=1e-5, bos_token_id=0,
              eos_token_id=1, tie_word_embeddings=False, **moe_config_kwargs(variant, experts, top_k))
    kw.update(extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("experts.gate_up_proj_bias") or name.endswith("experts.down_proj_bias"):
                p.add_(torch.randn_like(p) * 0.1)  # gpt-oss's expert biases [E, 2I] / [E, H] start at zero too
            elif p.dim() == 3 and variant in ("gpt_oss", "llama4"):  # fused expert banks start at zero in its init
                p.normal_(0.0, init_std)
            elif p.dim() == 2 and variant == "gpt_oss" and p.shape[-1] == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def engine_case(root, variant: str, prompt_lengths, max_new: int, **extra):
    """(target dir, EAGLE-3 draft dir, prompts, transformers' greedy continuations) for a random `variant`
    target under `root`: random prompts of `prompt_lengths` tokens, `max_new` tokens each (eos ignored), and a
    random EAGLE-3 head reading the target's layer outputs 0, 0, 1."""
    import transformers

    from checkpoints import write_eagle3_checkpoint

    target = write_moe_checkpoint(Path(root) / "target", variant, **extra)
    draft = write_eagle3_checkpoint(Path(root) / "draft", target, draft_vocab_size=128, seed=3,
                                    aux_layer_ids=[0, 0, 1])
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in prompt_lengths]
    want = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=None, pad_token_id=None)
            want.append(out[0, len(p):].tolist())
    return str(target), str(draft), prompts, want
