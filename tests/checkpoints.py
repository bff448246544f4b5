"""Test helpers: tiny random checkpoints in the Hugging Face, EAGLE and EAGLE-3 layouts, a hand-driven paged
cache (page table + KV pool + ForwardBatch built without any runtime code) to run models on them, and prompts of
real Python for the bundled demo model."""

from __future__ import annotations

import importlib
import inspect
import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from spruce.attention.metadata import ForwardBatch, Phase
from spruce.limits import Limits
from spruce.memory.kv_pool import KVPool, LatentKVPool

VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def write_llama_checkpoint(path, variant: str = "llama", tie: bool = False, sharded: bool = False,
                           rope_style: str = "rope_theta", rope_scaling: dict | None = None, seed: int = 0,
                           hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2, vocab: int = 320,
                           intermediate: int = 128, head_dim: int | None = None, init_std: float = 0.2,
                           max_pos: int = 512, **extra) -> Path:
    """A random model written by transformers' own save_pretrained (the HF format by construction).

    rope_style: "rope_theta" rewrites config.json in the older rope_theta + rope_scaling style,
    "rope_parameters" keeps transformers 5's style. Norm weights and biases are perturbed away from their
    ones/zeros init so that a mis-loaded one shows. `extra` goes to the transformers config (attention_bias...)."""
    import transformers

    path = Path(path)
    cfg_cls, model_cls = (getattr(transformers, n) for n in VARIANTS[variant])
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
              tie_word_embeddings=tie, initializer_range=init_std, rms_norm_eps=1e-5, bos_token_id=0,
              eos_token_id=1, head_dim=head_dim or hidden // heads)
    if variant == "qwen2":
        kw["use_sliding_window"] = False
    if variant == "mistral":
        kw["sliding_window"] = None
    kw.update(extra)
    torch.manual_seed(seed)
    cfg = cfg_cls(**kw)
    theta = 10000.0
    params = {"rope_type": "default", "rope_theta": theta} if rope_scaling is None else {**rope_scaling,
                                                                                          "rope_theta": theta}
    cfg.rope_parameters = params
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms (ones) and biases (zeros)
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size="200KB" if sharded else "5GB")
    raw = json.loads((path / "config.json").read_text())
    if rope_style == "rope_theta":  # rewrite in the older style: rope_theta + rope_scaling
        rp = raw.pop("rope_parameters", None) or params
        raw["rope_theta"] = rp.get("rope_theta", theta)
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        raw["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


PROMPT_MODULES = ("textwrap", "heapq", "bisect", "fractions", "shlex", "colorsys", "difflib")


def python_source_prompts(chars: int = 2000) -> list[str]:
    """Prompts of real Python, present on every machine (the fixture model's held-out prompts are not): `chars`
    characters of each PROMPT_MODULES standard-library module's source, from its first top-level def or class."""
    prompts = []
    for name in PROMPT_MODULES:
        src = inspect.getsource(importlib.import_module(name))
        start = min(i for i in (src.find("\ndef "), src.find("\nclass ")) if i >= 0) + 1
        prompts.append(src[start:start + chars])
    return prompts


def bundled_model_with_draft(tmp_path: Path, num_prompts: int) -> tuple[Path, Path]:
    """The bundled demo model copied under `tmp_path` with `num_prompts` held-out prompts of real Python (what the
    in-process benchmarks read), and a random EAGLE-3 head for it: (model dir, draft dir)."""
    from spruce.config import builtin_model_path

    model = Path(tmp_path) / "model"
    shutil.copytree(builtin_model_path(), model)
    (model / "heldout_prompts.jsonl").write_text("".join(json.dumps({"text": text}) + "\n"
                                                         for text in python_source_prompts()[:num_prompts]))
    return model, write_eagle3_checkpoint(Path(tmp_path) / "draft", builtin_model_path(), seed=1)


def read_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def read_tensors(model_dir) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, by name."""
    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _rand(g, *shape, std=0.05):
    return torch.randn(*shape, generator=g) * std


def _norm(g, h):
    return 1.0 + _rand(g, h, std=0.1)


def _layer_tensors(g, prefix: str, h: int, inter: int, heads: int, kv: int, hd: int, in_width: int) -> dict:
    return {
        f"{prefix}.self_attn.q_proj.weight": _rand(g, heads * hd, in_width),
        f"{prefix}.self_attn.k_proj.weight": _rand(g, kv * hd, in_width),
        f"{prefix}.self_attn.v_proj.weight": _rand(g, kv * hd, in_width),
        f"{prefix}.self_attn.o_proj.weight": _rand(g, h, heads * hd),
        f"{prefix}.post_attention_layernorm.weight": _norm(g, h),
        f"{prefix}.mlp.gate_proj.weight": _rand(g, inter, h),
        f"{prefix}.mlp.up_proj.weight": _rand(g, inter, h),
        f"{prefix}.mlp.down_proj.weight": _rand(g, h, inter),
    }


def _draft_shape(target_dir, hidden):
    t = read_config(target_dir)
    heads = t["num_attention_heads"]
    return t, hidden or t["hidden_size"], heads, t.get("num_key_value_heads", heads), \
        t.get("head_dim") or t["hidden_size"] // heads


def write_eagle3_checkpoint(path, target_dir, draft_vocab_size: int | None = None, with_embed: bool = False,
                            aux_layer_ids: list[int] | None = None, seed: int = 0, hidden: int | None = None,
                            target_hidden: int | None = None, with_lm_head: bool = True,
                            midlayer_name: str = "midlayer", num_layers: int = 1, intermediate: int | None = None,
                            head_dim: int | None = None, config: dict | None = None) -> Path:
    """A random LlamaForCausalLMEagle3 head for the target in `target_dir` (SGLang's tensor names).

    draft_vocab_size < the target vocab: a random sorted draft vocabulary with d2t/t2d. hidden: the draft's own
    hidden size (default the target's; a different one needs with_embed=True). target_hidden: the target hidden
    size the draft claims (default the real one; another makes a draft that does not fit). aux_layer_ids: written to
    eagle_config.eagle_aux_hidden_state_layer_ids (fc then reads len(ids) target states). midlayer_name:
    "midlayer" or the newer "layers.0". num_layers > 1 adds SGLang's plain layers after the midlayer
    (hidden_norm, self_attn over H, post_attention_layernorm, mlp), named `additional_layers.{k}` (k = 0..n-2), or
    `layers.{k+1}` when midlayer_name is "layers.0"; they are drawn last, so the other tensors do not change.
    intermediate / head_dim: the MLP width and head size (default the target's); `config` is laid over the
    config.json written (model_type, rope, intermediate_size_mlp...)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    t, h, heads, kv, hd = _draft_shape(target_dir, hidden)
    hd = head_dim or hd
    th = target_hidden or t["hidden_size"]
    vocab, inter = t["vocab_size"], intermediate or t["intermediate_size"]
    dv = draft_vocab_size or vocab
    n_aux = len(aux_layer_ids) if aux_layer_ids is not None else 3
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "fc.weight": _rand(g, h, n_aux * th),
        f"{midlayer_name}.input_layernorm.weight": _norm(g, h),
        f"{midlayer_name}.hidden_norm.weight": _norm(g, h),
        "norm.weight": _norm(g, h),
        **_layer_tensors(g, midlayer_name, h, inter, heads, kv, hd, 2 * h),
    }
    if with_lm_head:
        tensors["lm_head.weight"] = _rand(g, dv, h, std=0.5)
    if dv < vocab:
        keep = torch.randperm(vocab, generator=g)[:dv].sort().values  # the draft vocabulary, as target ids
        tensors["d2t"] = (keep - torch.arange(dv)).to(torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[keep] = True
        tensors["t2d"] = t2d
    if with_embed:
        tensors["embed_tokens.weight"] = _rand(g, vocab, h)
    for k in range(num_layers - 1):
        p = f"layers.{k + 1}" if midlayer_name == "layers.0" else f"additional_layers.{k}"
        tensors[f"{p}.hidden_norm.weight"] = _norm(g, h)
        tensors.update(_layer_tensors(g, p, h, inter, heads, kv, hd, h))
    save_file(tensors, str(path / "model.safetensors"))
    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=h, intermediate_size=inter,
               num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, num_hidden_layers=num_layers,
               rms_norm_eps=t.get("rms_norm_eps", 1e-5), vocab_size=vocab, draft_vocab_size=dv,
               max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
    if h != th or target_hidden is not None:
        cfg["target_hidden_size"] = th
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    cfg.update(config or {})
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}, indent=2))
    return path


def write_eagle_checkpoint(path, target_dir, seed: int = 0, layers: int = 1, with_lm_head: bool = False,
                           with_embed: bool = False, fc_bias: bool = False) -> Path:
    """A random LlamaForCausalLMEagle (EAGLE-1/2) head: fc over [embeds, feature], decoder `layers.*` whose
    first has no input_layernorm; lm_head / embed_tokens only when asked (else the target's are used)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    t, h, heads, kv, hd = _draft_shape(target_dir, None)
    g = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _rand(g, h, 2 * h)}
    if fc_bias:
        tensors["fc.bias"] = _rand(g, h)
    for i in range(layers):
        tensors.update(_layer_tensors(g, f"layers.{i}", h, t["intermediate_size"], heads, kv, hd, h))
        if i > 0:
            tensors[f"layers.{i}.input_layernorm.weight"] = _norm(g, h)
    if with_lm_head:
        tensors["lm_head.weight"] = _rand(g, t["vocab_size"], h)
    if with_embed:
        tensors["embed_tokens.weight"] = _rand(g, t["vocab_size"], h)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = dict(architectures=["LlamaForCausalLMEagle"], model_type="llama", hidden_size=h,
               intermediate_size=t["intermediate_size"], num_attention_heads=heads, num_key_value_heads=kv,
               head_dim=hd, num_hidden_layers=layers, rms_norm_eps=t.get("rms_norm_eps", 1e-5),
               vocab_size=t["vocab_size"], max_position_embeddings=2048, rope_theta=10000.0)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


class PagedCache:
    """A page table and KV pool for one model, driven by hand: rows get shuffled (non-contiguous) pages and
    `batch` builds a ForwardBatch for tokens at given positions (causal over each row's paged cache)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int = 4, rows: int = 4,
                 num_pages: int = 256, dtype: torch.dtype = torch.float32, seed: int = 0, latent_dim: int = 0):
        self.page_size = page_size
        self.limits = Limits(max_running_requests=rows, page_size=page_size, context_length=num_pages * page_size,
                             num_pages=num_pages, chunked_prefill_size=num_pages * page_size)
        if latent_dim:  # MLA: one latent per token
            self.kv = LatentKVPool(self.limits, num_layers, latent_dim, 0, dtype, torch.device("cpu"))
        else:
            self.kv = KVPool(self.limits, num_layers, num_kv_heads, head_dim, 0, dtype, torch.device("cpu"))
        self.table = torch.zeros(rows + 1, num_pages, dtype=torch.int32)  # [rows, max pages]; 0 = dummy page
        self.free_pages = list(range(1, num_pages))
        random.Random(seed).shuffle(self.free_pages)
        self.rows = 0

    @staticmethod
    def for_model(model, **kw) -> "PagedCache":
        """A cache shaped for a target (has .config: MHA or MLA) or an EagleDraft."""
        c = getattr(model, "config", None)
        if getattr(c, "mla", None) is not None:
            return PagedCache(c.num_layers, 1, 1, latent_dim=c.mla.latent_dim, **kw)
        if hasattr(c, "num_kv_heads"):
            return PagedCache(c.num_layers, c.num_kv_heads, c.head_dim, **kw)
        return PagedCache(model.num_layers, model.num_kv_heads, model.head_dim, **kw)

    def add_row(self, capacity: int) -> int:
        """A new request row with pages for `capacity` positions."""
        row = self.rows
        self.rows += 1
        n = -(-capacity // self.page_size)
        self.table[row, :n] = torch.tensor([self.free_pages.pop() for _ in range(n)], dtype=torch.int32)
        return row

    def batch(self, rows: list[int], starts: list[int], tokens: list[list[int]]) -> ForwardBatch:
        """tokens[i] at positions starts[i].. of rows[i]: each attends to its row's positions <= its own."""
        lens = [len(t) for t in tokens]
        ids = torch.tensor([x for t in tokens for x in t], dtype=torch.int64)
        pos = torch.tensor([s + j for s, m in zip(starts, lens) for j in range(m)], dtype=torch.int64)
        trow = torch.tensor([r for r, m in zip(rows, lens) for _ in range(m)], dtype=torch.int64)
        pages = self.table[trow, pos // self.page_size].long()
        indptr = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        return ForwardBatch(
            phase=Phase.EXTEND, batch_size=len(rows), num_tokens=len(ids), input_ids=ids, positions=pos,
            out_slots=pages * self.page_size + pos % self.page_size, token_rows=trow,
            kv_lens=(pos + 1).to(torch.int32), tree_mask=torch.zeros(len(ids), 1, dtype=torch.int64),
            req_rows=torch.tensor(rows, dtype=torch.int64), qo_indptr=indptr,
            max_kv_len=max((s + m for s, m in zip(starts, lens)), default=0), max_q_len=max(lens, default=0),
            scratch_width=0,
        )


def write_deepseek_checkpoint(path, version: int = 3, seed: int = 0, hidden: int = 64, layers: int = 3,
                              heads: int = 4, vocab: int = 256, q_lora_rank: int | None = 32, kv_lora_rank: int = 48,
                              nope: int = 16, rope: int = 8, v_dim: int = 16, experts: int = 8, top_k: int = 2,
                              shared: int = 1, init_std: float = 0.2, max_pos: int = 512,
                              rope_scaling: dict | None = None, **extra) -> Path:
    """A random DeepSeek-V2/V3 model written by transformers' save_pretrained (published per-expert layout).

    Norm weights and the V3 router bias are perturbed so a mis-loaded one shows; `extra` goes to the config
    (n_group, topk_group, first_k_dense_replace, routed_scaling_factor, topk_method, rope_interleave...)."""
    import transformers

    path = Path(path)
    name = "DeepseekV3" if version == 3 else "DeepseekV2"
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=32,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
              n_routed_experts=experts, n_shared_experts=shared, num_experts_per_tok=top_k, q_lora_rank=q_lora_rank,
              kv_lora_rank=kv_lora_rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim,
              max_position_embeddings=max_pos, initializer_range=init_std, bos_token_id=0, eos_token_id=1,
              n_group=2, topk_group=1)
    kw.update(extra)
    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{name}Config")(**kw)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})}
    model = getattr(transformers, f"{name}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(path)
    return path
