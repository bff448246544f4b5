"""NEXTN / MTP drafts: the target checkpoint's own MTP layers as the EAGLE machinery's draft.

pycode-mla (DeepSeek-V3 architecture, one trained MTP layer): greedy NEXTN == plain for (S, K, N) in
{(1,1,2), (3,1,4), (3,4,8), (5,8,16)} x page {1, 16, 64}, requests joining mid-flight, preemption; a tiny random
DeepSeek checkpoint with 2 MTP layers checks per-step layer selection; loading checks the published layout
(export and reload round-trip) and refuses a checkpoint without MTP layers. The lossless-sampling test of
NEXTN is in tests/test_spec_sampling.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spruce import SamplingParams
from spruce.errors import ConfigError
from checkpoints import write_deepseek_checkpoint, write_llama_checkpoint
from conftest import generate_joining
from mtp_checkpoints import add_mtp_layers

MAX_NEW = 24
CONFIGS = [(1, 1, 2), (3, 1, 4), (3, 4, 8), (5, 8, 16)]


@pytest.fixture(scope="module")
def prompts(pycodemla):
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    texts = [json.loads(line)["text"] for line in (pycodemla / "heldout_prompts.jsonl").read_text().splitlines()]
    tok = Tokenizer.from_dir(pycodemla, ModelConfig.from_dir(pycodemla))
    return [tok.encode(t)[: 20 + 17 * i] for i, t in enumerate(texts[:4])]


@pytest.fixture(scope="module")
def plain(pycodemla, prompts):
    from spruce import LLM

    llm = LLM(pycodemla, page_size=16, max_running_requests=4)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))]


def nextn(make_llm, target, s, k, n, page, **kw):
    return make_llm(target, page_size=page, speculative_algorithm="NEXTN", speculative_num_steps=s,
                    speculative_eagle_topk=k, speculative_num_draft_tokens=n, **kw)


@pytest.mark.parametrize("s,k,n", CONFIGS, ids=[f"S{s}-K{k}-N{n}" for s, k, n in CONFIGS])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_nextn_greedy_equals_plain(make_llm, pycodemla, prompts, plain, s, k, n, page):
    llm = nextn(make_llm, pycodemla, s, k, n, page, max_running_requests=4)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))] == plain
    stats = llm.engine.stats()["spec"]
    assert stats["mean_accept_length"] > 1.2, stats  # the trained MTP layer drafts well
    assert llm.engine.info()["speculative"].startswith("NEXTN")


def test_alias_and_defaults(make_llm, pycodemla):
    llm = make_llm(pycodemla, speculative_algorithm="mtp")
    spec = llm.engine.config.speculative
    assert (spec.algorithm, spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) == ("NEXTN", 3, 1, 4)
    assert spec.draft_model == str(pycodemla)


def test_nextn_joining_mid_flight_and_preemption(make_llm, pycodemla, prompts, plain):
    llm = nextn(make_llm, pycodemla, 5, 8, 16, 4, max_running_requests=3, max_total_tokens=170)
    eng = llm.engine
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    done = generate_joining(eng, prompts, params)
    assert done == dict(enumerate(plain))
    assert eng.stats()["preemptions"] > 0


def test_export_round_trips_the_published_layout(pycodemla):
    from safetensors.torch import load_file

    from spruce.attention.backend import create_backend
    from spruce.models.hf_config import ModelConfig
    from spruce.models.loader import load_mtp_draft
    from spruce.models.mtp import mtp_checkpoint_tensors

    cfg = ModelConfig.from_dir(pycodemla)
    draft = load_mtp_draft(pycodemla, cfg, torch.float32, torch.device("cpu"), create_backend("torch", 16))
    exported = mtp_checkpoint_tensors(draft)
    published = load_file(str(pycodemla / "model-mtp.safetensors"))
    assert set(exported) == set(published)
    assert all(torch.equal(exported[k], published[k].float()) for k in published)


@pytest.fixture(scope="module")
def two_layer_mtp(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("mtp2")
    target = write_deepseek_checkpoint(root / "t", version=3, layers=2, seed=4, init_std=0.05)
    return add_mtp_layers(target, root / "t-mtp", num_layers=2, seed=5, std=0.05)


def test_two_mtp_layers_one_per_step(make_llm, two_layer_mtp):
    """Step j runs layer min(j, 1); the extend runs both (the chain), so each layer's cache covers every
    committed position; output == plain greedy."""
    prompts = [[5, 9, 33, 70, 2, 11, 12, 90], [100, 3, 4]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in make_llm(two_layer_mtp).generate(prompts, params)]
    llm = nextn(make_llm, two_layer_mtp, 3, 2, 6, 4)
    draft = llm.engine.runner.draft
    assert draft.num_layers == 2 and [draft.step_layer(j) for j in range(4)] == [0, 1, 1, 1]
    calls = {0: [], 1: []}
    for j, layer in enumerate(draft.layers):
        layer.register_forward_hook(lambda mod, args, out, j=j: calls[j].append(args[2].phase.value))
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert set(calls[0]) == {"extend", "draft_extend"}  # prefill extends and post-verify extends only
    assert "draft_decode" in calls[1] and {"extend", "draft_extend"} <= set(calls[1])
    assert llm.engine.runner.draft_kv.num_layers == 2


def test_nextn_on_a_llama_target_with_mtp_layers(make_llm, tmp_path):
    """MTP layers of a Llama target (what `spruce train-draft --draft-arch mtp` writes): MHA decoder layer."""
    pytest.importorskip("transformers")
    target = write_llama_checkpoint(tmp_path / "t", layers=2, seed=3)
    with_mtp = add_mtp_layers(target, tmp_path / "t-mtp", num_layers=1, seed=6)
    prompts = [[5, 9, 33, 70], [100, 3, 4, 7, 8]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in make_llm(target).generate(prompts, params)]
    spec = make_llm(target, page_size=16, speculative_algorithm="NEXTN", draft_model=with_mtp,
                    speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    assert [o.token_ids for o in spec.generate(prompts, params)] == plain


def test_checkpoint_without_mtp_layers_is_refused(tmp_path):
    pytest.importorskip("transformers")
    from spruce import LLM

    target = write_llama_checkpoint(tmp_path / "t", layers=2, seed=3)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=0.*train-draft --draft-arch mtp"):
        LLM(target, speculative_algorithm="NEXTN")


def test_mtp_position_convention_is_immaterial(pycodemla):
    """Pairs (h[p], t[p+1]) at position p (spruce) or p + 1 (vLLM): rope is relative, so outputs are equal."""
    from spruce.attention.backend import create_backend
    from spruce.models.hf_config import ModelConfig
    from spruce.models.loader import load_mtp_draft
    from checkpoints import PagedCache

    cfg = ModelConfig.from_dir(pycodemla)
    draft = load_mtp_draft(pycodemla, cfg, torch.float32, torch.device("cpu"), create_backend("torch", 4))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=g).tolist()
    feats = torch.randn(30, cfg.hidden_size, generator=g)
    outs = []
    cos, sin = draft.rotary.cos, draft.rotary.sin
    for shift in (0, 1):  # tables shifted by one row: every token at its position + 1
        draft.rotary.cos, draft.rotary.sin = cos[shift:], sin[shift:]
        cache = PagedCache(1, 1, 1, latent_dim=cfg.mla.latent_dim, page_size=4, rows=1)
        row = cache.add_row(40)
        batch = cache.batch([row], [0], [ids])
        with torch.no_grad():
            outs.append(draft(batch.input_ids, feats, batch, cache.kv, cache.table, 0))
    assert (outs[0] - outs[1]).abs().max() < 1e-4
