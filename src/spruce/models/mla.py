"""Multi-head latent attention (DeepSeek-V2/V3) over the latent KV cache, in the absorbed form for every phase.

Per token the cache holds latent = [kv_a_layernorm(c), rope(k_pe)] (C + R values, shared by all heads). With
W_kv_b = [W_UK; W_UV] per head ([nope + v, C]), head h's score against a cached token is
    q_nope_h . (W_UK_h c) + q_pe_h . k_pe  =  (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe
so the query is absorbed once, [W_UK_h^T q_nope_h, q_pe_h] ([C + R]), attention runs as multi-query attention
over the latents with value = c, and W_UV_h maps the [C] output back to head h's v. Every phase (extend,
decode, verify, draft) uses it, so one backend method (`forward_latent`) serves the tree scratch and paged
prefix exactly as for MHA. `dense_causal` is the expanded textbook form over whole windows (training).

Interleaved rope (DeepSeek's (x0, x1), (x2, x3), ... pairs) is turned into spruce's rotate-half layout by
permuting the rope rows of q_b_proj / q_proj and kv_a_proj_with_mqa at load time (`rope_row_permutation`):
both sides of every dot product get the same permutation, so scores are unchanged and no kernel knows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spruce.attention.backend import AttentionBackend
from spruce.attention.metadata import ForwardBatch
from spruce.distributed.checkpoint import CheckpointSlice
from spruce.distributed.layers import column_parallel_linear, row_parallel_linear
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import RMSNorm
from spruce.models.rope import Rotary
from spruce.ops.fp8 import FP8_DTYPE, fp8_cache_inputs, fp8_cache_output

LORA_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


def rope_row_permutation(rope_dim: int) -> torch.Tensor:
    """Row order taking interleaved rope pairs (x0, x1), (x2, x3), ... to rotate-half halves (evens, odds)."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def rope_rows_to_rotate_half(name: str, tensor: torch.Tensor, cfg: ModelConfig, inverse: bool = False) -> torch.Tensor:
    """An interleaved-rope checkpoint tensor with the rope rows of its q / k_pe projection reordered to
    rotate-half (identity for any other tensor or layout); `inverse` maps spruce's order back (export)."""
    mla = cfg.mla
    if mla is None or not mla.rope_interleave:
        return tensor
    perm = rope_row_permutation(mla.qk_rope_head_dim)
    if inverse:
        perm = torch.argsort(perm)
    if isinstance(tensor, CheckpointSlice):  # not read yet (a tensor-parallel load): permute what is read
        return tensor.map(lambda t: rope_rows_to_rotate_half(name, t, cfg, inverse))
    if name.endswith((".q_b_proj.weight", ".q_proj.weight")):  # whole heads (all, or a tensor-parallel rank's)
        heads = tensor.view(-1, mla.qk_nope_head_dim + mla.qk_rope_head_dim, tensor.shape[-1])
        rope = heads[:, mla.qk_nope_head_dim:][:, perm]
        return torch.cat([heads[:, :mla.qk_nope_head_dim], rope], dim=1).reshape(tensor.shape)
    if name.endswith(".kv_a_proj_with_mqa.weight"):
        c = mla.kv_lora_rank
        return torch.cat([tensor[:c], tensor[c:][perm]])
    return tensor


class MLAttention(nn.Module):
    """x [T, H] -> [T, H]; stores each token's latent in a LatentKVPool layer at batch.out_slots.

    With a tensor-parallel group `tp` the heads are split (q_b_proj / q_proj and kv_b_proj column-parallel by
    head, o_proj row-parallel with one all-reduce) and the latent path (q_a_proj, kv_a_proj_with_mqa, their
    norms) and the latent cache are replicated, as SGLang does: every rank caches the same latents and
    attends with its own heads. `num_heads` is then this rank's count."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend, layer_id: int, tp=None):
        super().__init__()
        mla = cfg.mla
        h, all_heads = cfg.hidden_size, cfg.num_heads
        heads = all_heads if tp is None else tp.shard(all_heads, "num_attention_heads")
        self.num_heads = heads
        self.nope, self.rope, self.v_dim, self.kv_rank = (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
                                                          mla.kv_lora_rank)
        self.qk_dim = self.nope + self.rope
        if mla.q_lora_rank is None:
            self.q_proj = column_parallel_linear(h, all_heads * self.qk_dim, tp, "num_attention_heads")
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = column_parallel_linear(mla.q_lora_rank, all_heads * self.qk_dim, tp, "num_attention_heads")
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LORA_NORM_EPS)
        self.kv_b_proj = column_parallel_linear(self.kv_rank, all_heads * (self.nope + self.v_dim), tp,
                                                "num_attention_heads")
        self.o_proj = row_parallel_linear(all_heads * self.v_dim, h, tp, "num_attention_heads")
        self.rotary = rotary
        self.backend = backend
        self.layer_id = layer_id
        self.scale = mla.softmax_scale
        self.k_scale = 1.0  # an FP8 latent cache's scale (the checkpoint's k_scale)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H] -> q_nope [T, Hq, nope], q_pe [T, Hq, R] (rotated), latent [T, C + R] (k_pe rotated)."""
        t = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.qk_dim)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        k_pe = self.rotary(k_pe.reshape(t, 1, self.rope), positions)  # [T, 1, R]
        latent = torch.cat([self.kv_a_layernorm(c), k_pe[:, 0]], dim=-1)  # [T, C + R]
        return q_nope, self.rotary(q_pe.contiguous(), positions), latent

    def kv_b_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [Hq, nope, C] and W_UV [Hq, v, C]: views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv, page_table: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q_nope, q_pe, latent = self.project(x, batch.positions)
        w_uk, w_uv = self.kv_b_heads()
        q_absorbed = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, Hq, C]
        query = torch.cat([q_absorbed, q_pe], dim=-1)  # [T, Hq, C + R]
        cache = kv.layer(self.layer_id)
        fp8_cache = cache.dtype == FP8_DTYPE  # holds latent / k_scale (ops/fp8.py); the value shares the scale
        if fp8_cache:
            query, latent, _ = fp8_cache_inputs(query, latent, None, self.k_scale, self.k_scale)
        out = self.backend.forward_latent(query, latent, cache, self.kv_rank, kv.scratch_start,
                                          batch, page_table, self.scale)  # [T, Hq, C]
        if fp8_cache:
            out = fp8_cache_output(out, self.k_scale)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, Hq, v]
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))

    def dense_causal(self, x: torch.Tensor, positions: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """The same attention, expanded (per-head keys and values), over `batch` dense causal windows of
        `length` tokens: x [B*L, H] -> [B*L, H]. Training windows use it instead of the paged cache."""
        t = x.shape[0]
        q_nope, q_pe, latent = self.project(x, positions)
        c, k_pe = latent.split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(t, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, Hq, qk]
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.num_heads, -1)], dim=-1)  # [T, Hq, qk]

        def windows(y):  # [T, Hq, d] -> [B, Hq, L, d]
            return y.reshape(batch, length, self.num_heads, y.shape[-1]).transpose(1, 2)

        o = F.scaled_dot_product_attention(windows(q), windows(k), windows(v), is_causal=True, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(t, self.num_heads * self.v_dim))
