"""EAGLE / EAGLE-3 drafts: checkpoint round trip, and the paged forward equal to a naive dense forward
written from the raw checkpoint tensors (so the fused-weight mapping is checked too)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from spruce.attention.backend import create_backend
from spruce.errors import ModelLoadError
from spruce.models.eagle import DraftConfig
from spruce.models.hf_config import ModelConfig
from spruce.models.loader import load_eagle_draft, load_target
from checkpoints import (PagedCache, read_config, read_tensors, write_eagle3_checkpoint, write_eagle_checkpoint,
                         write_llama_checkpoint)

pytest.importorskip("transformers")  # the target checkpoint is written by transformers
TOL = 1e-4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("t") / "target", layers=6, seed=3)


def load_pair(target_dir, draft_dir):
    """(target, draft) as the engine loads them: the target captures the aux layers the draft asks for."""
    backend = create_backend("torch", 4)
    dcfg = DraftConfig.from_dir(draft_dir, ModelConfig.from_dir(target_dir))
    target = load_target(target_dir, torch.float32, CPU, backend, aux_layers=dcfg.target_aux_layers)
    draft = load_eagle_draft(draft_dir, target, target.config, torch.float32, CPU, backend)
    return target, draft


# --- naive reference: dense causal attention over one sequence, weights straight from the checkpoint --------
def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta=10000.0):  # x [T, H, D]
    d = x.shape[-1]
    f = pos[:, None].float() * (1.0 / theta ** (torch.arange(0, d, 2).float() / d))[None]  # [T, D/2]
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def attention(w, p, x, pos, cfg):
    t, hq, hkv, d = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = rope((x @ w[f"{p}.q_proj.weight"].T).view(t, hq, d), pos)
    k = rope((x @ w[f"{p}.k_proj.weight"].T).view(t, hkv, d), pos).repeat_interleave(hq // hkv, 1)
    v = (x @ w[f"{p}.v_proj.weight"].T).view(t, hkv, d).repeat_interleave(hq // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, -1) @ w[f"{p}.o_proj.weight"].T


def mlp(w, p, x):
    gate, up = x @ w[f"{p}.gate_proj.weight"].T, x @ w[f"{p}.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{p}.down_proj.weight"].T


def naive_eagle3(w, cfg, embed, ids, feats, sglang=True):
    """-> (pre-norm hidden [T, H], logits [T, draft vocab]). Layers after the midlayer follow SGLang's
    llama_eagle3.py: each reads only the previous layer's MLP output (the previous residual is dropped);
    sglang=False: a textbook residual stream instead (to show the tests tell the two apart)."""
    pos = torch.arange(len(ids))
    h = feats if feats.shape[-1] == cfg["hidden_size"] else feats @ w["fc.weight"].T
    x = torch.cat([rms(embed[ids], w["midlayer.input_layernorm.weight"]), rms(h, w["midlayer.hidden_norm.weight"])], -1)
    residual = h + attention(w, "midlayer.self_attn", x, pos, cfg)
    out = mlp(w, "midlayer.mlp", rms(residual, w["midlayer.post_attention_layernorm.weight"]))
    for k in range(cfg["num_hidden_layers"] - 1):
        p = f"additional_layers.{k}"
        out = out if sglang else out + residual
        residual = out + attention(w, f"{p}.self_attn", rms(out, w[f"{p}.hidden_norm.weight"]), pos, cfg)
        out = mlp(w, f"{p}.mlp", rms(residual, w[f"{p}.post_attention_layernorm.weight"]))
    h = out + residual
    return h, rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


def naive_eagle(w, cfg, embed, lm_head, ids, feats):
    pos = torch.arange(len(ids))
    h = torch.cat([embed[ids], feats], -1) @ w["fc.weight"].T + w.get("fc.bias", 0.0)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        x = h if i == 0 else rms(h, w[f"{p}.input_layernorm.weight"])
        h = h + attention(w, f"{p}.self_attn", x, pos, cfg)
        h = h + mlp(w, f"{p}.mlp", rms(h, w[f"{p}.post_attention_layernorm.weight"]))
    return h, h @ lm_head.T


def paged_draft(draft, seqs: list[list[int]], feats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the draft over each sequence in two chunks (the second reads the first's KV from the pages)."""
    cache = PagedCache.for_model(draft, rows=len(seqs))
    rows = [cache.add_row(len(s)) for s in seqs]
    cuts = [len(s) // 3 for s in seqs]
    chunks = [[(0, c), (c, len(s))] for s, c in zip(seqs, cuts)]  # per sequence: [lo, hi) of each forward
    out = [[] for _ in seqs]
    for step in range(2):
        spans = [c[step] for c in chunks]
        b = cache.batch(rows, [lo for lo, _ in spans], [s[lo:hi] for s, (lo, hi) in zip(seqs, spans)])
        f = torch.cat([x[lo:hi] for x, (lo, hi) in zip(feats, spans)])
        h = draft(b.input_ids, f, b, cache.kv, cache.table)  # [T, H]
        for i, part in enumerate(h.split([hi - lo for lo, hi in spans])):
            out[i].append(part)
    return [torch.cat(o) for o in out]


def check(paged, naive_fn, draft, seqs, feats):
    worst = 0.0
    for i, (ids, f) in enumerate(zip(seqs, feats)):
        h_ref, logits_ref = naive_fn(torch.tensor(ids), f)
        worst = max(worst, (paged[i] - h_ref).abs().max().item(),
                    (draft.compute_logits(paged[i]) - logits_ref).abs().max().item())
    return worst


def inputs(width, lens=(23, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 320, (n,), generator=g).tolist() for n in lens]
    return seqs, [torch.randn(n, width, generator=g) for n in lens]


EAGLE3_CASES = [
    dict(),
    dict(with_embed=True, draft_vocab_size=100),
    dict(draft_vocab_size=57, aux_layer_ids=[0, 2, 4, 5], midlayer_name="layers.0"),
    dict(with_embed=True, hidden=96, draft_vocab_size=100),  # draft hidden != target hidden
]


@pytest.mark.parametrize("case", EAGLE3_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_eagle3_paged_forward_equals_naive(tmp_path, target_dir, case):
    d = write_eagle3_checkpoint(tmp_path / "d", target_dir, seed=5, **case)
    target, draft = load_pair(target_dir, d)
    w = {k.replace("layers.0.", "midlayer."): v for k, v in read_tensors(d).items()}
    cfg = read_config(d)
    dv = case.get("draft_vocab_size", 320)
    assert draft.draft_vocab_size == dv and draft.num_layers == 1
    assert (draft.embed_tokens is None) == (not case.get("with_embed", False))
    embed = w["embed_tokens.weight"] if case.get("with_embed") else target.embed_tokens.weight
    assert torch.equal(draft.embed(torch.arange(320)), embed)
    n_aux = len(case.get("aux_layer_ids", [0, 0, 0]))
    assert draft.feature_width_first_step == n_aux * 64 == len(target.aux_layers) * 64
    seqs, feats = inputs(draft.feature_width_first_step)
    with torch.no_grad():
        paged = paged_draft(draft, seqs, feats)
        worst = check(paged, lambda ids, f: naive_eagle3(w, cfg, embed, ids, f), draft, seqs, feats)
        # a later draft step feeds the draft's own (pre-norm) hidden back: width H, no fc
        own = [p.clone() for p in paged]
        worst = max(worst, check(paged_draft(draft, seqs, own), lambda ids, f: naive_eagle3(w, cfg, embed, ids, f),
                                 draft, seqs, own))
    print(f"EAGLE-3 {case}: max abs diff {worst:.2e}")
    assert worst < TOL
    d2t = w.get("d2t", torch.zeros(dv, dtype=torch.int64))
    assert torch.equal(draft.draft_to_target(torch.arange(dv)), torch.arange(dv) + d2t)


@pytest.mark.parametrize("case", [dict(), dict(layers=2, with_lm_head=True, fc_bias=True), dict(with_embed=True)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_eagle_paged_forward_equals_naive(tmp_path, target_dir, case):
    d = write_eagle_checkpoint(tmp_path / "d", target_dir, seed=6, **case)
    target, draft = load_pair(target_dir, d)
    w, cfg = read_tensors(d), read_config(d)
    assert draft.num_layers == case.get("layers", 1) and draft.draft_vocab_size == 320
    assert (draft.lm_head is None) == (not case.get("with_lm_head", False))
    embed = w["embed_tokens.weight"] if case.get("with_embed") else target.embed_tokens.weight
    lm_head = w["lm_head.weight"] if case.get("with_lm_head") else target.lm_head.weight
    seqs, feats = inputs(64)
    with torch.no_grad():
        paged = paged_draft(draft, seqs, feats)
        worst = check(paged, lambda ids, f: naive_eagle(w, cfg, embed, lm_head, ids, f), draft, seqs, feats)
        h = torch.randn(3, 64)
        if not case.get("with_lm_head"):
            assert torch.equal(draft.compute_logits(h), target.compute_logits(h))
    print(f"EAGLE {case}: max abs diff {worst:.2e}")
    assert worst < TOL
    assert draft.draft_to_target(torch.arange(320)).tolist() == list(range(320))


def test_target_features_feed_the_draft(tmp_path, target_dir):
    """Shapes line up end to end: target aux [T, 3H] -> EAGLE-3 draft; target hidden [T, H] -> EAGLE draft."""
    seqs, _ = inputs(1)
    for d, eagle3 in ((write_eagle3_checkpoint(tmp_path / "e3", target_dir), True),
                      (write_eagle_checkpoint(tmp_path / "e1", target_dir), False)):
        target, draft = load_pair(target_dir, d)
        tc, dc = PagedCache.for_model(target, rows=2), PagedCache.for_model(draft, rows=2)
        rows = [tc.add_row(len(s)) for s in seqs]
        assert [dc.add_row(len(s)) for s in seqs] == rows
        with torch.no_grad():
            b = tc.batch(rows, [0, 0], seqs)
            hidden, aux = target(b, tc.kv, tc.table)
            feats = aux if eagle3 else hidden
            assert feats.shape == (b.num_tokens, draft.feature_width_first_step)
            out = draft(b.input_ids, feats, dc.batch(rows, [0, 0], seqs), dc.kv, dc.table)
            assert out.shape == (b.num_tokens, 64)
            assert draft.compute_logits(out).shape == (b.num_tokens, draft.draft_vocab_size)
            empty = dc.batch([], [], [])
            assert draft(empty.input_ids, torch.zeros(0, draft.feature_width_first_step), empty, dc.kv,
                         dc.table).shape == (0, 64)


def test_eagle3_aux_layers_follow_sglang(tmp_path, target_dir):
    """Configured ids name layer outputs (input of id+1); the default is the inputs of [2, L//2, L-3]."""
    tcfg = ModelConfig.from_dir(target_dir)  # L = 6
    d = write_eagle3_checkpoint(tmp_path / "a", target_dir)
    assert DraftConfig.from_dir(d, tcfg).target_aux_layers == (2, 3, 3)
    d = write_eagle3_checkpoint(tmp_path / "b", target_dir, aux_layer_ids=[0, 3, 5])
    assert DraftConfig.from_dir(d, tcfg).target_aux_layers == (1, 4, 6)


# --- multi-layer EAGLE-3 heads (midlayer + SGLang's additional layers) ------------------------------------------
def sglang_names(tensors: dict) -> dict:
    """`layers.0.*` -> `midlayer.*`, `layers.{i}.*` -> `additional_layers.{i-1}.*` (the test's own mapping)."""
    out = {}
    for k, v in tensors.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.*)", k)
        if m:
            i = int(m.group(1))
            k = f"midlayer.{m.group(2)}" if i == 0 else f"additional_layers.{i - 1}.{m.group(2)}"
        out[k] = v
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("naming", ["midlayer", "layers.0"])
def test_eagle3_multilayer_paged_forward_equals_naive(tmp_path, target_dir, n, naming):
    d = write_eagle3_checkpoint(tmp_path / "d", target_dir, seed=7, num_layers=n, midlayer_name=naming,
                                draft_vocab_size=100)
    raw = read_tensors(d)
    extra = [k for k in raw if k.startswith("additional_layers." if naming == "midlayer" else "layers.")
             and not k.startswith("layers.0.")]
    assert len({k.split(".")[1] for k in extra}) == n - 1  # the checkpoint really names n - 1 extra layers
    target, draft = load_pair(target_dir, d)
    w, cfg = sglang_names(raw), read_config(d)
    assert cfg["num_hidden_layers"] == n and draft.num_layers == n and draft.step_layer(2) == 0
    # every attention layer caches in its own layer of the draft's pool
    assert [draft.midlayer.self_attn.layer_id] + [b.self_attn.layer_id for b in draft.additional_layers] == \
        list(range(n))
    assert PagedCache.for_model(draft).kv.num_layers == n
    embed = target.embed_tokens.weight
    seqs, feats = inputs(draft.feature_width_first_step)
    ref = lambda ids, f: naive_eagle3(w, cfg, embed, ids, f)  # noqa: E731
    with torch.no_grad():
        paged = paged_draft(draft, seqs, feats)  # two chunks: the second reads every layer's KV from the pages
        worst = check(paged, ref, draft, seqs, feats)
        own = [p.clone() for p in paged]
        worst = max(worst, check(paged_draft(draft, seqs, own), ref, draft, seqs, own))
        # the quirk matters: a textbook residual stream through the later layers is another head
        textbook, _ = naive_eagle3(w, cfg, embed, torch.tensor(seqs[0]), feats[0], sglang=False)
        assert (paged[0] - textbook).abs().max() > 1000 * TOL
    print(f"EAGLE-3 {n} layers ({naming}): max abs diff {worst:.2e}")
    assert worst < TOL


def test_eagle3_multilayer_namings_load_the_same(tmp_path, target_dir):
    """Same seed, both namings: the same tensors land in the same parameters."""
    a = write_eagle3_checkpoint(tmp_path / "a", target_dir, seed=9, num_layers=3)
    b = write_eagle3_checkpoint(tmp_path / "b", target_dir, seed=9, num_layers=3, midlayer_name="layers.0")
    assert sglang_names(read_tensors(b)).keys() == read_tensors(a).keys()
    sa, sb = load_pair(target_dir, a)[1].state_dict(), load_pair(target_dir, b)[1].state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(k.startswith("additional_layers.1.") for k in sa)


def test_eagle3_single_layer_checkpoint_unchanged(tmp_path, target_dir):
    """num_layers=1 (the default) writes exactly what the writer wrote before it had the argument."""
    a = read_tensors(write_eagle3_checkpoint(tmp_path / "a", target_dir, seed=2))
    b = read_tensors(write_eagle3_checkpoint(tmp_path / "b", target_dir, seed=2, num_layers=1))
    three = read_tensors(write_eagle3_checkpoint(tmp_path / "c", target_dir, seed=2, num_layers=3))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], three[k]) for k in a)  # extra layers are drawn after everything else
    assert read_config(tmp_path / "a")["num_hidden_layers"] == 1


def test_eagle3_multilayer_missing_or_extra_tensor(tmp_path, target_dir):
    d = write_eagle3_checkpoint(tmp_path / "d", target_dir, num_layers=3)
    f = d / "model.safetensors"
    full = load_file(f)
    for name in ("additional_layers.1.hidden_norm.weight", "additional_layers.0.self_attn.k_proj.weight",
                 "additional_layers.1.mlp.up_proj.weight"):
        save_file({k: v for k, v in full.items() if k != name}, str(f))
        with pytest.raises(ModelLoadError, match=re.escape(repr(name))):
            load_pair(target_dir, d)
    save_file(full, str(f))
    cfg = read_config(d)
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))  # one layer fewer than the tensors
    with pytest.raises(ModelLoadError, match="'additional_layers.1.hidden_norm.weight' has no place"):
        load_pair(target_dir, d)
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 0}))
    with pytest.raises(ModelLoadError, match="num_hidden_layers=0; it needs at least 1"):
        load_pair(target_dir, d)


def test_eagle3_two_layer_head_greedy_equals_plain(tmp_path, make_llm):
    """Engine end to end with a random 2-layer head on the bundled target: greedy speculative == plain greedy,
    both with the head's own (mostly rejected) proposals and with an oracle that makes 60% of them right
    (so accepted tokens are committed and every layer's draft KV is extended over them)."""
    from spruce import SamplingParams
    from spruce.config import builtin_model_path
    from oracle_draft import install_oracle

    target = builtin_model_path()
    d = write_eagle3_checkpoint(tmp_path / "d", target, draft_vocab_size=1024, seed=1, num_layers=2)
    prompts = ["def fib(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n",
               "for i in range(10):", "x = ["]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    plain = make_llm(target, page_size=16, max_running_requests=4)
    ref = plain.generate(prompts, params)
    for oracle in (None, 0.6):
        llm = make_llm(target, page_size=16, max_running_requests=4, draft_model=str(d),
                       speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=4,
                       speculative_num_draft_tokens=8)
        runner = llm.engine.runner
        assert runner.draft.num_layers == 2 and runner.draft_kv.num_layers == 2
        if oracle is not None:
            o = install_oracle(llm, oracle)
            for r in ref:
                o.add_reference(r.prompt_token_ids, r.token_ids)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], oracle
        if oracle is not None:
            assert max(a for a, c in enumerate(llm.engine.stats()["spec"]["accept_length_counts"]) if c) >= 2
