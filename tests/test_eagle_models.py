"""EAGLE / EAGLE-3 drafts: checkpoint round trip and the paged forward equal to a naive dense forward."""

from __future__ import annotations

import pytest
import torch

from spruce import LLM
from spruce.config import builtin_model_path
from checkpoints import write_eagle3_checkpoint, write_eagle_checkpoint

DEMO = builtin_model_path()


def naive_attention(attn, x, positions):
    """Dense causal attention of one sequence with the module's weights: the obviously-correct path."""
    t = x.shape[0]
    q, k, v = attn.qkv(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = attn.rotary(q.reshape(t, attn.num_heads, attn.head_dim), positions)
    k = attn.rotary(k.reshape(t, attn.num_kv_heads, attn.head_dim), positions)
    v = v.reshape(t, attn.num_kv_heads, attn.head_dim)
    g = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * attn.scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return attn.o_proj(torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, -1))


def naive_eagle3(draft, ids, feats, positions):
    mid = draft.midlayer
    h = draft.fc(feats)
    x = torch.cat([mid.input_layernorm(draft.embed(ids)), mid.hidden_norm(h)], dim=-1)
    h = h + naive_attention(mid.self_attn, x, positions)
    return h + mid.mlp(mid.post_attention_layernorm(h))


@pytest.mark.parametrize("with_embed", [False, True])
def test_eagle3_paged_forward_equals_naive(tmp_path, with_embed):
    d = write_eagle3_checkpoint(tmp_path / "d", DEMO, draft_vocab_size=700, with_embed=with_embed, seed=3)
    llm = LLM(DEMO, draft_model=str(d), speculative_algorithm="EAGLE3", page_size=4)
    r = llm.engine.runner
    draft = r.draft
    assert draft.draft_vocab_size == 700 and (draft.embed_tokens is None) == (not with_embed)
    ids = list(range(5, 40))
    row = r.page_table.alloc_row()
    r.page_table.append_pages(row, r.allocator.alloc(r.limits.pages_for(len(ids))))
    feats = torch.randn(len(ids), draft.feature_width)
    batch = r.builder.extend([row], [0], [ids])
    paged = r.draft_forward(batch, feats)
    naive = naive_eagle3(draft, torch.tensor(ids), feats, torch.arange(len(ids)))
    assert (paged - naive).abs().max().item() < 1e-4
    mapped = draft.draft_to_target(torch.arange(700))
    assert mapped.min() >= 0 and mapped.max() < 4096 and len(set(mapped.tolist())) == 700
    r.allocator.free(r.page_table.release_row(row))


def test_eagle_checkpoint_shares_target_head(tmp_path):
    d = write_eagle_checkpoint(tmp_path / "d", DEMO, layers=2)
    llm = LLM(DEMO, draft_model=str(d), speculative_algorithm="EAGLE")
    draft = llm.engine.runner.draft
    assert draft.lm_head is None and draft.embed_tokens is None and draft.num_layers == 2
    h = torch.randn(3, draft.hidden_size)
    target = llm.engine.runner.target
    assert torch.equal(draft.compute_logits(h), target.compute_logits(h))
    assert draft.draft_to_target(torch.arange(10)).tolist() == list(range(10))


def test_eagle3_aux_layers_follow_sglang(tmp_path):
    """Configured ids name layer outputs (input of id+1); the default is the inputs of [2, L//2, L-3]."""
    d = write_eagle3_checkpoint(tmp_path / "a", DEMO)
    assert LLM(DEMO, draft_model=str(d)).engine.runner.target.aux_layers == (2, 3, 4)  # L = 7
    d = write_eagle3_checkpoint(tmp_path / "b", DEMO, aux_layer_ids=[0, 3, 5])
    assert LLM(DEMO, draft_model=str(d)).engine.runner.target.aux_layers == (1, 4, 6)
