"""GPU-only, DeepSeek-V3-architecture target (pycode-mla: MLA + MoE): CUDA graphs equal eager for every bucket
(plain and EAGLE-3 trees), the Triton path (MLA kernel + fused MoE) equals the torch reference token for token
in float32, and bf16 speculative greedy matches plain bf16 greedy (divergences reported with their top-2 gap).

SPRUCE_GPU_REPORT=FILE appends the measured match rates to that JSON file."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import write_eagle3_checkpoint
from test_gpu import generate, near_tie_gap, write_report

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def draft_mla(pycodemla, tmp_path_factory):
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("d") / "e3", pycodemla, draft_vocab_size=2048, seed=11))


@pytest.fixture(scope="module")
def prompts_mla(pycodemla):
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    texts = [json.loads(line)["text"] for line in (pycodemla / "heldout_prompts.jsonl").read_text().splitlines()]
    tok = Tokenizer.from_dir(pycodemla, ModelConfig.from_dir(pycodemla))
    return [tok.encode(t)[: 40 + 13 * i] for i, t in enumerate(texts[:16])]


@pytest.mark.parametrize("spec", [False, True])
def test_mla_cuda_graph_equals_eager_every_bucket(pycodemla, draft_mla, prompts_mla, spec):
    kw = dict(dtype="float32", page_size=16, max_running_requests=16)
    if spec:
        kw.update(draft_model=draft_mla, speculative_num_steps=4, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=12)
    for bs in [1, 2, 3, 7, 13, 16]:  # every bucket (1, 2, 4, 8, 16), most of them padded
        ps = prompts_mla[:bs]
        eager, _ = generate(pycodemla, ps, 24, cuda_graph=False, accepts=True, **kw)  # (tokens, accept counts)
        graph, _ = generate(pycodemla, ps, 24, cuda_graph=True, accepts=True, **kw)
        assert graph == eager, f"bs={bs}"


@pytest.mark.parametrize("page", [1, 64])
def test_mla_triton_equals_torch_reference(pycodemla, draft_mla, prompts_mla, page):
    kw = dict(dtype="float32", page_size=page, max_running_requests=8, cuda_graph=False, draft_model=draft_mla,
              speculative_num_steps=3, speculative_eagle_topk=8, speculative_num_draft_tokens=16)
    ref, _ = generate(pycodemla, prompts_mla[:8], 24, attention_backend="torch", **kw)
    fast, _ = generate(pycodemla, prompts_mla[:8], 24, **kw)
    assert fast == ref


@pytest.mark.parametrize("k,page", [(4, 16), (8, 64), (8, 4)])
def test_mla_bf16_spec_greedy_matches_plain(pycodemla, draft_mla, prompts_mla, k, page):
    n = 48
    plain, _ = generate(pycodemla, prompts_mla, n, dtype="bfloat16", page_size=page)
    # eager: the oracle runs on the host, so captured graphs would replay the unwrapped draft
    spec, stats = generate(pycodemla, prompts_mla, n, oracle_refs=plain, dtype="bfloat16", page_size=page,
                           cuda_graph=False, draft_model=draft_mla, speculative_num_steps=5, speculative_eagle_topk=k,
                           speculative_num_draft_tokens=16)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(pycodemla, dtype=torch.float32).cuda().eval()
    gaps = []
    for p, a, b in zip(prompts_mla, plain, spec):
        if a != b:
            i = next(j for j in range(len(a)) if a[j] != b[j])
            gaps.append(near_tie_gap(hf, p + a[:i]))
    matched = sum(a == b for a, b in zip(plain, spec))
    write_report({f"mla_bf16_K{k}_page{page}": {"requests": len(plain), "identical": matched,
                                                 "divergence_top2_gaps": gaps,
                                                 "mean_accept_length": stats["spec"]["mean_accept_length"]}})
    assert all(g < 0.5 for g in gaps), gaps  # any divergence is a bf16 near-tie of the float32 reference


NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=4,
             speculative_num_draft_tokens=8)


def test_nextn_cuda_graph_equals_eager_every_bucket(pycodemla, prompts_mla):
    """The checkpoint's trained MTP layer drafts: each request's tokens and accept length counts are equal (the
    target keeps the tokens right whatever the draft does; only the accept lengths show draft-side damage)."""
    kw = dict(dtype="float32", page_size=16, max_running_requests=16, **NEXTN)
    for bs in [1, 2, 3, 7, 13, 16]:  # every bucket (1, 2, 4, 8, 16), most of them padded
        ps = prompts_mla[:bs]
        eager, _ = generate(pycodemla, ps, 24, cuda_graph=False, accepts=True, **kw)
        graph, stats = generate(pycodemla, ps, 24, cuda_graph=True, accepts=True, **kw)
        assert graph == eager, f"bs={bs}"
        assert stats["spec"]["mean_accept_length"] > 1.5


def test_nextn_eager_above_largest_bucket(pycodemla, prompts_mla):
    """12 requests with graphs captured up to 4: the batch runs every phase eagerly, reading eager outputs
    only (the fix toggle eager_reads_eager_outputs), and equals the graph-free run; overlap on."""
    kw = dict(dtype="float32", page_size=64, max_running_requests=12, speculative_algorithm="NEXTN",
              speculative_num_steps=5, speculative_eagle_topk=8, speculative_num_draft_tokens=16)
    ref, _ = generate(pycodemla, prompts_mla[:12], 32, cuda_graph=False, accepts=True, **kw)
    mixed, _ = generate(pycodemla, prompts_mla[:12], 32, cuda_graph=True, cuda_graph_max_bs=4, accepts=True, **kw)
    assert mixed == ref


def test_mla_prefill_graphs_equal_eager(pycodemla, prompts_mla):
    """MLA + fused MoE prefills replayed from graphs (padded to their token bucket) against eager prefills:
    one short prompt, then a ragged batch, then prefix-cache hits of a few new tokens each."""
    kw = dict(dtype="float32", page_size=16, max_running_requests=8, chunked_prefill_size=128)
    ps = [p[:9 + i] for i, p in enumerate(prompts_mla[:4])] + [prompts_mla[15] + p[:4 + i] for i, p in enumerate(prompts_mla[:3])]
    outs = {}
    for max_tokens in (0, 64):
        runs = [generate(pycodemla, batch, 16, cuda_graph_max_prefill_tokens=max_tokens, **kw)[0]
                for batch in (ps[:1], ps[1:4], ps[4:5], ps[5:])]
        outs[max_tokens] = runs
    assert outs[64] == outs[0]
