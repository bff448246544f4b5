"""GPU-only: the flashinfer backend (DESIGN §13) equals the torch reference on every phase and shape class, the
engine's greedy speculative output equals plain output on it, and its CUDA graphs equal eager for every bucket.

Run on the device with `pytest -m gpu tests/test_gpu_flashinfer.py` (flashinfer-python installed);
SPRUCE_GPU_REPORT=FILE adds the measured figures to that JSON file.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import test_torch_attention
from spruce.attention.metadata import Phase
from spruce.attention.torch_backend import TorchAttention
from test_attention_merge import request_floors
from test_gpu import divergences, draft19m, generate, prompts19m, write_report  # noqa: F401 (fixtures)

pytestmark = pytest.mark.gpu
flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None

SHAPES = {"gqa-hd64": dict(heads=8, kv_heads=2, head_dim=64), "gqa-hd128": dict(heads=32, kv_heads=8, head_dim=128)}


def phase_cases(topk: int):
    """(phase, prefixes, q_lens, make_case keywords) for every phase; long prefixes so FlashInfer splits kv."""
    steps, n = 5, {1: 6, 4: 16, 8: 32}[topk]
    return {
        "extend": (Phase.EXTEND, [0, 700, 1500, 5], [300, 45, 1, 64], {}),
        "decode": (Phase.DECODE, [1900, 3, 640], [1, 1, 1], dict(pad_rows=2)),
        "verify": (Phase.VERIFY, [1500, 9, 333], [n] * 3, dict(width=n, pad_rows=1)),
        "draft_decode": (Phase.DRAFT_DECODE, [1200, 40], [topk] * 2, dict(width=topk * steps, scratch_offset=topk)),
        "draft_extend": (Phase.DRAFT_EXTEND, [1000, 77, 6], [steps + 1] * 3,
                         dict(real_counts=[1, steps + 1, 3], pad_rows=1)),
    }


def to_cuda(case):
    q, k, v, kc, vc, start, batch, table = case
    moved = {f.name: getattr(batch, f.name).cuda() for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return (q.cuda(), k.cuda(), v.cuda(), kc.cuda(), vc.cuda(), start, dataclasses.replace(batch, **moved),
            table.cuda())


def with_host_fields(batch, table, floors: str, seed: int):
    """The host fields the engine gives a batch: EXTEND's rows and lengths; a decode phase's rows and floors
    (none: as at graph capture; random: <= every real token's kv length; exact: the committed length)."""
    bs = batch.batch_size
    starts = [int(x) for x in batch.qo_indptr.cpu()]
    rows = tuple(int(r) for r in batch.req_rows.cpu())
    if batch.phase == Phase.EXTEND:
        q_lens = tuple(starts[b + 1] - starts[b] for b in range(bs))
        kv = tuple(int(batch.kv_lens[starts[b + 1] - 1]) if q_lens[b] else 0 for b in range(bs))
        return dataclasses.replace(batch, host_q_lens=q_lens, host_kv_lens=kv, host_rows=rows)
    if floors == "none":
        return batch
    return dataclasses.replace(batch, host_rows=rows,
                               host_kv_floor=tuple(request_floors(batch, seed, exact=floors == "exact").tolist()))


def limits_for(table, page_size: int, bs: int):
    """The Limits fields the backend sizes its buffers from (padding rows share the table's dummy row)."""
    return SimpleNamespace(page_size=page_size, num_rows=max(table.shape[0], bs), max_pages_per_request=table.shape[1],
                           dummy_row=table.shape[0] - 1)


@pytest.mark.parametrize("floors", ["none", "random", "exact"])
@pytest.mark.parametrize("topk", [1, 4, 8])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_flashinfer_equals_torch_every_phase(shape, page, topk, floors, monkeypatch):
    from spruce.attention.flashinfer_backend import FlashInferAttention

    monkeypatch.setattr(test_torch_attention, "MAX_PAGES", 2048)
    worst = {}
    for name, (phase, prefixes, q_lens, kw) in phase_cases(topk).items():
        if topk != 4 and phase in (Phase.EXTEND, Phase.DECODE):
            continue  # topk only shapes the tree phases
        case = test_torch_attention.make_case(phase, prefixes, q_lens, page, **SHAPES[shape], **kw,
                                              dtype=torch.bfloat16, seed=page + topk)
        q, k, v, kc, vc, start, batch, table = to_cuda(case)
        batch = with_host_fields(batch, table, floors, seed=page)
        scale = q.shape[-1] ** -0.5
        ref_k, ref_v = kc.float(), vc.float()
        ref = TorchAttention(page).forward(q.float(), k.float(), v.float(), ref_k, ref_v, start, batch, table, scale)
        backend = FlashInferAttention(page)
        backend.allocate(limits_for(table, page, batch.batch_size), "cuda")
        backend.plan(batch, table)
        out = backend.forward(q, k, v, kc, vc, start, batch, table, scale)
        silent = (batch.kv_lens == 0) & (batch.tree_mask == 0).all(dim=1)
        stored = torch.ones(kc.shape[0], dtype=torch.bool, device="cuda")
        stored[batch.out_slots[silent]] = False  # padding tokens all write the dummy slot, in any order
        assert torch.equal(kc[stored].float(), ref_k[stored]) and torch.equal(vc[stored].float(), ref_v[stored]), \
            f"{name}: KV store differs"
        assert torch.isfinite(out).all(), name
        assert torch.all(out[silent] == 0), f"{name}: padding tokens must produce zeros"
        worst[name] = (out.float() - ref).abs().max().item()
        assert worst[name] < 2e-2, (name, worst[name])
    write_report({f"flashinfer_vs_torch[{shape},page={page},topk={topk},floors={floors}]": worst})


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_flashinfer_spec_greedy_matches_plain(pycode19m, draft19m, prompts19m, k, page):
    """bf16, graphs and overlap on: EAGLE-3 tree speculation == plain decoding on the flashinfer backend, and
    plain decoding on flashinfer == on triton; any divergence must be a near-tie of the float32 target."""
    transformers = pytest.importorskip("transformers")
    n = 48
    s, nd = (5, 6) if k == 1 else (5, 16 if k == 4 else 32)
    kw = dict(dtype="bfloat16", page_size=page, attention_backend="flashinfer")
    plain, _ = generate(pycode19m, prompts19m, n, **kw)
    spec, stats = generate(pycode19m, prompts19m, n, **kw, draft_model=draft19m, speculative_num_steps=s,
                           speculative_eagle_topk=k, speculative_num_draft_tokens=nd)
    triton_plain, _ = generate(pycode19m, prompts19m, n, dtype="bfloat16", page_size=page)
    hf = transformers.AutoModelForCausalLM.from_pretrained(pycode19m, dtype=torch.float32).cuda().eval()
    report = {}
    for name, other in (("spec_vs_plain", spec), ("plain_vs_triton", triton_plain)):
        rate, gaps = divergences(hf, prompts19m, plain, other)
        report[name] = {"token_match_rate": rate, "top2_gaps_at_divergence": gaps}
        assert all(g < 0.5 for g in gaps), (name, gaps)
    report["spec"] = stats["spec"]
    write_report({f"flashinfer_K={k},page={page}": report})


@pytest.mark.parametrize("spec", [False, True])
def test_flashinfer_graphs_equal_eager_every_bucket(pycode19m, draft19m, prompts19m, spec):
    """Every bucket incl. padded ones; bf16 (FlashInfer has no float32), so graphs and eager must plan the same
    kernels: the replay's plan uses the same per-bucket wrapper as capture."""
    kw = dict(dtype="bfloat16", page_size=16, max_running_requests=16, attention_backend="flashinfer")
    if spec:
        kw.update(draft_model=draft19m, speculative_num_steps=4, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=12)
    for bs in [1, 3, 8, 13, 16]:
        ps = prompts19m[:bs]
        eager, _ = generate(pycode19m, ps, 24, cuda_graph=False, **kw)
        graph, _ = generate(pycode19m, ps, 24, cuda_graph=True, **kw)
        assert graph == eager, f"bs={bs}"


@pytest.mark.parametrize("floors", ["none", "random", "exact"])
@pytest.mark.parametrize("topk", [1, 8])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("heads", [16, 128])
def test_flashinfer_mla_equals_torch_every_phase(heads, page, topk, floors, monkeypatch):
    """DeepSeek's absorbed MLA (latent 512 + rope 64) through FlashInfer's MLA kernel + the Triton latent tail."""
    from spruce.attention.flashinfer_backend import FlashInferAttention

    monkeypatch.setattr(test_torch_attention, "MAX_PAGES", 2048)
    worst = {}
    for name, (phase, prefixes, q_lens, kw) in phase_cases(topk).items():
        case = test_torch_attention.make_case(phase, prefixes, q_lens, page, heads=heads, kv_heads=1, head_dim=576,
                                              **kw, dtype=torch.bfloat16, seed=page + topk)
        q, k, v, kc, vc, start, batch, table = to_cuda(case)
        batch = with_host_fields(batch, table, floors, seed=page)
        scale = 192 ** -0.5  # DeepSeek's qk head dim (128 + 64), as the model passes it
        cache = kc[:, 0]  # [slots, 576]
        ref_cache = cache.float()
        ref = TorchAttention(page).forward_latent(q.float(), k[:, 0].float(), ref_cache, 512, start, batch, table,
                                                  scale)
        backend = FlashInferAttention(page)
        backend.allocate(limits_for(table, page, batch.batch_size), "cuda")
        backend.plan(batch, table)
        out = backend.forward_latent(q, k[:, 0], cache, 512, start, batch, table, scale)
        silent = (batch.kv_lens == 0) & (batch.tree_mask == 0).all(dim=1)
        assert torch.isfinite(out).all(), name
        assert torch.all(out[silent] == 0), f"{name}: padding tokens must produce zeros"
        worst[name] = (out.float() - ref).abs().max().item()
        assert worst[name] < 2e-2, (name, worst[name])
    write_report({f"flashinfer_mla_vs_torch[heads={heads},page={page},topk={topk},floors={floors}]": worst})


@pytest.mark.parametrize("spec", [False, True])
def test_flashinfer_mla_graphs_equal_eager_every_bucket(pycodemla, spec):
    """pycode-mla (MLA + MoE) on flashinfer, bf16: graphs == eager for every bucket, plain and NEXTN trees."""
    kw = dict(dtype="bfloat16", page_size=16, max_running_requests=16, attention_backend="flashinfer")
    if spec:
        kw.update(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=8)
    prompts = [[100 + 7 * i + j for j in range(20 + 5 * i)] for i in range(16)]
    for bs in [1, 3, 8, 13, 16]:
        eager, _ = generate(pycodemla, prompts[:bs], 24, cuda_graph=False, **kw)
        graph, _ = generate(pycodemla, prompts[:bs], 24, cuda_graph=True, **kw)
        assert graph == eager, f"bs={bs}"
