"""Write tiny random checkpoints in the Hugging Face, EAGLE and EAGLE-3 layouts (test helpers)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def write_llama_checkpoint(path, variant: str = "llama", tie: bool = False, sharded: bool = False,
                           rope_style: str = "rope_theta", rope_scaling: dict | None = None, seed: int = 0,
                           hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2, vocab: int = 320,
                           intermediate: int = 128, init_std: float = 0.2, max_pos: int = 512) -> Path:
    """A random model written by transformers' own save_pretrained (the HF format by construction)."""
    import transformers

    path = Path(path)
    cfg_cls, model_cls = (getattr(transformers, n) for n in VARIANTS[variant])
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
              tie_word_embeddings=tie, initializer_range=init_std, rms_norm_eps=1e-5, bos_token_id=0,
              eos_token_id=1, head_dim=hidden // heads)
    if variant == "qwen2":
        kw["use_sliding_window"] = False
    if variant == "mistral":
        kw["sliding_window"] = None
    torch.manual_seed(seed)
    cfg = cfg_cls(**kw)
    theta = 10000.0
    params = {"rope_type": "default", "rope_theta": theta} if rope_scaling is None else {**rope_scaling,
                                                                                          "rope_theta": theta}
    cfg.rope_parameters = params
    model = model_cls(cfg).eval()
    model.save_pretrained(path, max_shard_size="200KB" if sharded else "5GB")
    raw = json.loads((path / "config.json").read_text())
    if rope_style == "rope_theta":  # rewrite in the older style: rope_theta + rope_scaling
        rp = raw.pop("rope_parameters", None) or params
        raw["rope_theta"] = rp.get("rope_theta", theta)
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        raw["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def _target_shape(target_dir) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def _rand(g, *shape, std=0.05):
    return torch.randn(*shape, generator=g) * std


def _layer_tensors(g, prefix: str, h: int, inter: int, heads: int, kv: int, hd: int, in_width: int) -> dict:
    return {
        f"{prefix}.self_attn.q_proj.weight": _rand(g, heads * hd, in_width),
        f"{prefix}.self_attn.k_proj.weight": _rand(g, kv * hd, in_width),
        f"{prefix}.self_attn.v_proj.weight": _rand(g, kv * hd, in_width),
        f"{prefix}.self_attn.o_proj.weight": _rand(g, h, heads * hd),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
        f"{prefix}.mlp.gate_proj.weight": _rand(g, inter, h),
        f"{prefix}.mlp.up_proj.weight": _rand(g, inter, h),
        f"{prefix}.mlp.down_proj.weight": _rand(g, h, inter),
    }


def write_eagle3_checkpoint(path, target_dir, draft_vocab_size: int | None = None, seed: int = 0,
                            with_embed: bool = False, aux_layer_ids: list[int] | None = None,
                            target_hidden: int | None = None, hidden: int | None = None) -> Path:
    """A random LlamaForCausalLMEagle3 head for the target in `target_dir` (SGLang's tensor names)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    t = _target_shape(target_dir)
    th = target_hidden or t["hidden_size"]
    h = hidden or t["hidden_size"]
    heads = t["num_attention_heads"]
    kv = t.get("num_key_value_heads", heads)
    hd = t.get("head_dim") or h // heads
    vocab = t["vocab_size"]
    dv = draft_vocab_size or vocab
    inter = t["intermediate_size"]
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "fc.weight": _rand(g, h, 3 * th),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": _rand(g, dv, h, std=0.5),
        **_layer_tensors(g, "midlayer", h, inter, heads, kv, hd, 2 * h),
    }
    keep = torch.randperm(vocab, generator=g)[:dv].sort().values  # the draft vocabulary (target ids)
    tensors["d2t"] = (keep - torch.arange(dv)).to(torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    tensors["t2d"] = t2d
    if with_embed:
        tensors["embed_tokens.weight"] = _rand(g, vocab, h)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=h, intermediate_size=inter,
               num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, num_hidden_layers=1,
               rms_norm_eps=t.get("rms_norm_eps", 1e-5), vocab_size=vocab, draft_vocab_size=dv,
               max_position_embeddings=t.get("max_position_embeddings", 2048), rope_theta=10000.0,
               tie_word_embeddings=False)
    if target_hidden is not None:
        cfg["target_hidden_size"] = target_hidden
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def write_eagle_checkpoint(path, target_dir, seed: int = 0, with_lm_head: bool = False, layers: int = 1) -> Path:
    """A random LlamaForCausalLMEagle (EAGLE-1/2) head: fc over [embeds, feature], decoder layers."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    t = _target_shape(target_dir)
    h, heads = t["hidden_size"], t["num_attention_heads"]
    kv = t.get("num_key_value_heads", heads)
    hd = t.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _rand(g, h, 2 * h)}
    for i in range(layers):
        tensors.update(_layer_tensors(g, f"layers.{i}", h, t["intermediate_size"], heads, kv, hd, h))
        if i > 0:
            tensors[f"layers.{i}.input_layernorm.weight"] = torch.ones(h)
    if with_lm_head:
        tensors["lm_head.weight"] = _rand(g, t["vocab_size"], h)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = dict(architectures=["LlamaForCausalLMEagle"], model_type="llama", hidden_size=h,
               intermediate_size=t["intermediate_size"], num_attention_heads=heads, num_key_value_heads=kv,
               head_dim=hd, num_hidden_layers=layers, rms_norm_eps=t.get("rms_norm_eps", 1e-5),
               vocab_size=t["vocab_size"], max_position_embeddings=t.get("max_position_embeddings", 2048),
               rope_theta=10000.0)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
