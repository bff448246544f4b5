"""The EAGLE-3 head as a trainable module, with training-time test (TTT) unrolling.

Parameter names are the published checkpoint's (SGLang's llama_eagle3.py loads them): fc, midlayer.*,
norm, lm_head, plus the d2t / t2d buffers. Attention is dense here (training sees whole sequences).
Unroll step k at sequence index p plays the draft node at position p+k: its input is the previous step's
output hidden at p and the token at p+k+1; it attends to the real prefix (step-0 keys at positions <= p)
and to its own chain (step-i keys at index p, i = 1..k) - exactly the committed prefix plus the ancestors
an inference-time tree node sees.
"""

from __future__ import annotations

import torch
from torch import nn

from spruce.models.rope import inv_frequencies
from spruce.ops.fused import rms_norm_reference


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm_reference(x, self.weight, self.eps)


class Eagle3Head(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 target_hidden: int, draft_vocab: int, target_vocab: int, rope_theta: float, rope_scaling,
                 max_positions: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm, m.hidden_norm, m.post_attention_layernorm = (Norm(hidden, eps) for _ in range(3))
        m.self_attn = nn.Module()
        m.self_attn.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        m.self_attn.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        m.self_attn.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        m.self_attn.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        m.mlp = nn.Module()
        m.mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        m.mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
        m.mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.norm = Norm(hidden, eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(target_vocab, dtype=torch.bool))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                            inv_frequencies(head_dim, rope_theta, rope_scaling))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def _rope(self, x, positions):  # x [B, L, H, D], positions [L]
        c, s = self.cos[positions][None, :, None, :], self.sin[positions][None, :, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    def forward(self, embed, input_ids: torch.Tensor, features: torch.Tensor, ttt_length: int) -> list[torch.Tensor]:
        """input_ids [B, L] (target ids), features [B, L, 3*Ht] (target aux states at each position).

        Returns the draft logits of each unroll step k, [B, L, Vd]: at index p they predict token p+k+2."""
        b, length = input_ids.shape
        m, att = self.midlayer, self.midlayer.self_attn
        pos = torch.arange(length, device=input_ids.device)
        h = self.fc(features)  # [B, L, H]
        k0 = v0 = None
        chain_k, chain_v, logits = [], [], []
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        group = self.heads // self.kv_heads
        for k in range(ttt_length):
            tok = torch.nn.functional.pad(input_ids[:, k + 1:], (0, k + 1))  # token p+k+1 at index p
            x = torch.cat([m.input_layernorm(embed(tok)), m.hidden_norm(h)], dim=-1)
            q = self._rope(att.q_proj(x).view(b, length, self.heads, self.head_dim), pos + k)
            kk = self._rope(att.k_proj(x).view(b, length, self.kv_heads, self.head_dim), pos + k)
            vv = att.v_proj(x).view(b, length, self.kv_heads, self.head_dim)
            kk, vv = kk.repeat_interleave(group, 2), vv.repeat_interleave(group, 2)
            if k == 0:
                k0, v0 = kk, vv
            else:
                chain_k.append(kk)
                chain_v.append(vv)
            scale = self.head_dim ** -0.5
            s0 = torch.einsum("blhd,bmhd->bhlm", q, k0).float() * scale
            s0 = s0.masked_fill(~causal, float("-inf"))
            sc = [torch.einsum("blhd,blhd->bhl", q, c).float()[..., None] * scale for c in chain_k]
            probs = torch.cat([s0] + sc, dim=-1).softmax(dim=-1).to(q.dtype)  # [B, H, L, L + k]
            out = torch.einsum("bhlm,bmhd->blhd", probs[..., :length], v0)
            for i, c in enumerate(chain_v):
                out = out + probs[..., length + i].permute(0, 2, 1)[..., None] * c
            h_mid = h + att.o_proj(out.reshape(b, length, -1))
            mlp_in = m.post_attention_layernorm(h_mid)
            h = h_mid + m.mlp.down_proj(torch.nn.functional.silu(m.mlp.gate_proj(mlp_in)) * m.mlp.up_proj(mlp_in))
            logits.append(self.lm_head(self.norm(h)))
        return logits
