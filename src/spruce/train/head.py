"""The EAGLE-3 head as a trainable module, unrolled for training-time test (TTT).

Parameter names are the published checkpoint's (what SGLang's llama_eagle3.py loads): fc, midlayer.*, norm,
lm_head, plus the d2t / t2d buffers. Attention is dense: training sees whole windows.

Unroll step k at window index p plays the draft node at position p+k of an inference-time chain rooted at
p: its feature is step k-1's output hidden at p (step 0: fc of the target's aux states at p), its token is
the one at p+k+1, and it attends to the committed prefix (step-0 keys at indices <= p) plus its own chain
(the step-i keys at index p, i = 1..k): exactly what spruce's tree attention gives a draft node, the
committed prefix plus its ancestors and itself. Its logits predict token p+k+2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spruce.models.rope import attention_factor, inv_frequencies
from spruce.ops.fused import rms_norm_reference

TTT_POSITION_HEADROOM = 256  # positions past a window the rope tables cover: unroll step k rotates at position + k


class Norm(nn.Module):
    """RMSNorm with the engine's rounding (normalize in float32, cast back, then scale)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps)


class Eagle3Head(nn.Module):
    """EAGLE-3 draft head (one midlayer) in the published parameter layout; see the module docstring."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 target_hidden: int, num_aux: int, draft_vocab: int, target_vocab: int, rope_theta: float,
                 rope_scaling: dict | None, max_positions: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.fc = nn.Linear(num_aux * target_hidden, hidden, bias=False)
        self.midlayer = m = nn.Module()
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
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))  # [Vd]
        self.register_buffer("t2d", torch.ones(target_vocab, dtype=torch.bool))  # [V]
        freqs = torch.outer(torch.arange(max_positions + TTT_POSITION_HEADROOM, dtype=torch.float32),
                            inv_frequencies(head_dim, rope_theta, rope_scaling))  # [P, D/2]
        magnitude = attention_factor(rope_scaling)  # YaRN scales cos/sin (1 otherwise), as the engine's Rotary
        self.register_buffer("cos", freqs.cos() * magnitude, persistent=False)
        self.register_buffer("sin", freqs.sin() * magnitude, persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, L, h, D] rotated (rotate-half) at positions [L], in float32 like the engine's rotary."""
        c, s = self.cos[positions][None, :, None, :], self.sin[positions][None, :, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.midlayer.mlp
        return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))

    def forward(self, embed_weight: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor,
                ttt_length: int) -> list[torch.Tensor]:
        """input_ids [B, L] target ids, features [B, L, A*Ht] the target's aux states, embed_weight [V, H] the
        (frozen) target embedding. Returns the logits of each unroll step k < ttt_length, [B, L, Vd] each:
        at index p they predict token p+k+2 (indices past L-k-2 see padding and must not be scored)."""
        b, length = input_ids.shape
        m, att = self.midlayer, self.midlayer.self_attn
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        pos = torch.arange(length, device=input_ids.device)
        h = self.fc(features)  # [B, L, H] the first step's feature
        keys, values = [], []  # per step [B, L, Hkv, D]: step 0 = the committed prefix, later = the ancestors
        logits = []
        for k in range(ttt_length):
            tok = F.pad(input_ids[:, k + 1:], (0, k + 1))  # [B, L] token p+k+1 at index p
            x = torch.cat([m.input_layernorm(F.embedding(tok, embed_weight)), m.hidden_norm(h)], dim=-1)  # [B, L, 2H]
            q = self._rope(att.q_proj(x).view(b, length, hq, d), pos + k)  # [B, L, Hq, D]
            keys.append(self._rope(att.k_proj(x).view(b, length, hk, d), pos + k))
            values.append(att.v_proj(x).view(b, length, hk, d))
            out = self._attend(q, keys, values)  # [B, L, Hq*D]
            h_mid = h + att.o_proj(out)  # residual: the un-normed feature
            h = h_mid + self._mlp(m.post_attention_layernorm(h_mid))  # [B, L, H] next step's feature
            logits.append(self.lm_head(self.norm(h)))  # [B, L, Vd]
        return logits

    def _attend(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """Step k = len(keys) - 1 attention. Keys are laid out as k+1 blocks of L (block i = step i's keys);
        query p sees block 0 at indices <= p (causal) and index p of blocks 1..k (its chain), through one
        masked scaled_dot_product_attention. q [B, L, Hq, D] -> [B, L, Hq*D]."""
        b, length, hq, d = q.shape
        steps = len(keys)
        group = hq // keys[0].shape[2]
        idx = torch.arange(length, device=q.device)
        causal = idx[None, :] <= idx[:, None]  # [L, L]
        mask = torch.cat([causal] + [idx[None, :] == idx[:, None]] * (steps - 1), dim=1)  # [L, steps*L]

        def kv(blocks):  # steps x [B, L, Hkv, D] -> [B, Hq, steps*L, D]
            return torch.cat(blocks, dim=1).transpose(1, 2).repeat_interleave(group, dim=1)

        out = F.scaled_dot_product_attention(q.transpose(1, 2), kv(keys), kv(values), attn_mask=mask,
                                             scale=d ** -0.5)  # [B, Hq, L, D]
        return out.transpose(1, 2).reshape(b, length, hq * d)
