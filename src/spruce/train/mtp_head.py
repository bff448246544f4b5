"""One MTP layer (DeepSeek's multi-token prediction, served as speculative_algorithm="NEXTN") as a trainable
module, unrolled for training-time test (TTT) exactly as the EAGLE-3 head is (head.py).

The module is spruce's own inference model, an MTPDraft with one layer (models/mtp.py: enorm, hnorm, eh_proj,
the target family's decoder layer, shared_head.norm / head, embed_tokens), trained in place: what is saved is
`mtp_checkpoint_tensors` of that very module, and the forward below reuses its submodules (projections, norms,
MLP or MoE), so training and serving cannot drift apart; only attention is written here, because training
windows are dense and TTT needs chains (tests/test_train_draft.py checks it against the engine's NEXTN draft).

Unroll step k at window index p plays the draft node at position p+k of a NEXTN chain rooted at p:
    step 0: feature = the target's final normed hidden state at p, token = t[p+1]   (the draft extend's pair)
    step k: feature = step k-1's output at p (shared_head.norm(...), what MTPLayer.forward returns),
            token = t[p+k+1], attending to the committed prefix (step-0 keys at indices <= p) plus its own chain
            (the step-i keys at index p, i = 1..k)
and its logits (shared_head.head, the full target vocabulary) predict t[p+k+2]. One MTP layer is reused at
every step, as spruce's NEXTN drafting runs a one-layer checkpoint.

Warm start (init_mtp_head); every parameter then trains, the embedding and shared_head.head included (the
published layout gives the MTP layer its own copies):
    decoder layer        a copy of the target's last layer (names and shapes that match; the rest random)
    shared_head.norm     the target's final norm;  shared_head.head: the target's lm_head (tied: embedding)
    embed_tokens         the target's embedding
    eh_proj              N(0, 0.02);  enorm / hnorm: ones
Measured on pycode-6m (300 steps of 4 x 128 tokens of spruce's own source, TTT 3, 8 held-out files, mean
accept length of K=1,S=3 / K=4,S=3,N=16): training the embedding lowered the loss on all 3 seeds (-0.2) and
raised accept by +0.02 / +0.06 on average, for one more [V, H] of gradient and Adam state; freezing
shared_head.head cost 0.3 loss and 0.03 / 0.09 accept; eh_proj started as [0 | I], or a random decoder, did no
better (those three measured with the embedding frozen, one seed).

Spruce's fused ops dispatch to Triton kernels on CUDA tensors; those have no backward (rotary's runs in
place), so the differentiable forward runs under `torch_reference_ops()`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from spruce.attention.backend import create_backend
from spruce.models.hf_config import ModelConfig
from spruce.models.mla import MLAttention
from spruce.models.mtp import MTPDraft


@contextmanager
def torch_reference_ops():
    """Inside: every spruce fused op (RMSNorm, rotary, SiLU-and-mul, fused MoE, top-k) runs its torch
    reference, which autograd can differentiate. They all dispatch through spruce.ops.fused._use_triton."""
    from spruce.ops import fused

    saved = fused.HAS_TRITON
    fused.HAS_TRITON = False
    try:
        yield
    finally:
        fused.HAS_TRITON = saved


def _project(attn: nn.Module, x: torch.Tensor, positions: torch.Tensor):
    """The attention module's per-head q [T, Hq, Dqk], k [T, Hk, Dqk], v [T, Hk, Dv] (rotated at `positions`):
    MHA's fused qkv (q/k norms included), or MLA expanded as its dense_causal does."""
    if not isinstance(attn, MLAttention):
        return attn.project_qkv(x, positions)
    t = x.shape[0]
    q_nope, q_pe, latent = attn.project(x, positions)
    c, k_pe = latent.split([attn.kv_rank, attn.rope], dim=-1)
    k_nope, v = attn.kv_b_proj(c).view(t, attn.num_heads, attn.nope + attn.v_dim).split([attn.nope, attn.v_dim], -1)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, attn.num_heads, -1)], dim=-1)
    return torch.cat([q_nope, q_pe], dim=-1), k, v


def chain_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], batch: int, length: int,
                    scale: float) -> torch.Tensor:
    """Step k = len(keys) - 1 attention over `batch` windows of `length` (head.py's mask): keys are k+1 blocks
    of L (block i = step i's keys); query p sees block 0 at indices <= p and index p of blocks 1..k.
    q [B*L, Hq, D], keys / values k+1 x [B*L, Hk, D(v)] -> [B*L, Hq*Dv]."""
    idx = torch.arange(length, device=q.device)
    mask = torch.cat([idx[None, :] <= idx[:, None]] + [idx[None, :] == idx[:, None]] * (len(keys) - 1), dim=1)

    def windows(blocks):  # k+1 x [B*L, h, d] -> [B, h, (k+1)*L, d]
        return torch.cat([y.reshape(batch, length, y.shape[1], y.shape[2]) for y in blocks], dim=1).transpose(1, 2)

    qw = q.reshape(batch, length, q.shape[1], q.shape[2]).transpose(1, 2)  # [B, Hq, L, D]
    out = F.scaled_dot_product_attention(qw, windows(keys), windows(values), attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != keys[0].shape[1])  # [B, Hq, L, Dv]
    return out.transpose(1, 2).reshape(batch * length, -1)


class MTPHead(nn.Module):
    """An MTPDraft of one layer (checkpoint index = the target's num_hidden_layers), trained; module docstring.

    Build it on the training device (`make_mtp_head`): the rotary tables are plain attributes, not buffers."""

    target_feature = "hidden"  # the TargetOutputs field step 0 reads (EAGLE-3: "aux")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.draft = MTPDraft(cfg, create_backend("torch", 1), num_layers=1, first_index=cfg.num_layers)

    @property
    def layer(self):
        return self.draft.layers[0]

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, ttt_length: int) -> list[torch.Tensor]:
        """input_ids [B, L] target ids, features [B, L, H] the target's final normed hidden states. Returns the
        logits of each unroll step k < ttt_length, [B, L, V] each: at index p they predict token p+k+2 (indices
        past L-k-2 see padding and must not be scored)."""
        b, length = input_ids.shape
        mtp = self.layer
        dec, attn = mtp.decoder, mtp.decoder.self_attn
        pos = torch.arange(length, device=input_ids.device).repeat(b)  # [B*L]
        h = features.reshape(b * length, -1)
        keys, values, logits = [], [], []
        with torch_reference_ops():
            for k in range(ttt_length):
                tok = F.pad(input_ids[:, k + 1:], (0, k + 1)).reshape(-1)  # token p+k+1 at index p
                embeds = self.draft.embed(tok)  # [B*L, H]
                x = mtp.eh_proj(torch.cat([mtp.enorm(embeds), mtp.hnorm(h.to(embeds.dtype))], dim=-1))  # MTPLayer
                q, key, value = _project(attn, dec.input_layernorm(x), pos + k)
                keys.append(key)
                values.append(value)
                x = x + attn.o_proj(chain_attention(q, keys, values, b, length, attn.scale))
                x = x + dec.mlp(dec.post_attention_layernorm(x))
                h = mtp.shared_head.norm(x)  # [B*L, H] the next step's feature
                logits.append(mtp.shared_head.head(h).view(b, length, -1))  # [B, L, V]
        return logits


def make_mtp_head(cfg: ModelConfig, device: torch.device) -> MTPHead:
    """An MTPHead for target config `cfg`, float32, built on `device`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device(device):
            return MTPHead(cfg)
    finally:
        torch.set_default_dtype(previous)


def init_mtp_head(head: MTPHead, target, seed: int) -> None:
    """The warm start of the module docstring, from a FrozenTarget: random matrices (std 0.02) and unit norms,
    then the copies (decoder <- the target's last layer, shared_head <- its final norm and lm_head, embedding)."""
    g = torch.Generator().manual_seed(seed)
    m = target.model
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
        mtp = head.layer
        last = m.layers[-1].state_dict()
        for name, t in mtp.decoder.state_dict().items():
            if name in last and last[name].shape == t.shape:
                t.copy_(last[name])
        mtp.shared_head.norm.weight.copy_(m.norm.weight)
        mtp.shared_head.head.weight.copy_(target.output_weight)
        head.draft.embed_tokens.weight.copy_(m.embed_tokens.weight)
