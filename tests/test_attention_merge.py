"""Attention backends as plugins (DESIGN §13), on CPU: prefix + scratch merged by log-sum-exp equals one masked
attention on every phase (MHA, GQA and MLA; page sizes 1/4/16/64), the registry drives the config and CLI, the
plan hook runs where the contract says, and the whole engine gives the same greedy tokens on `torch-split`."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from spruce.attention import registry
from spruce.attention.backend import AttentionBackend, create_backend
from spruce.attention.merge import attend_prefix, attend_scratch, merge_states
from spruce.attention.metadata import Phase
from spruce.attention.torch_backend import TorchAttention
from spruce.config import EngineConfig
from spruce.errors import ConfigError, InvariantError
from test_torch_attention import make_case

PAGE_SIZES = [1, 4, 16, 64]
MHA = dict(heads=4, kv_heads=4, head_dim=16)
GQA = dict(heads=8, kv_heads=2, head_dim=16)
MLA = dict(heads=4, key_dim=24, value_dim=16)  # one latent KV head: Dk = 16 + 8 rope, value = its first 16


# every phase shape: (phase, prefixes, q_lens, make_case keywords)
PHASES = {
    "extend": (Phase.EXTEND, [0, 37, 5, 0], [23, 9, 1, 40], {}),
    "decode": (Phase.DECODE, [0, 50, 13], [1, 1, 1], dict(pad_rows=2)),
    "verify": (Phase.VERIFY, [9, 0, 70], [12, 12, 12], dict(width=70, pad_rows=1)),  # two mask words
    "draft_decode": (Phase.DRAFT_DECODE, [0, 21], [4, 4], dict(width=20, scratch_offset=8)),
    "draft_extend": (Phase.DRAFT_EXTEND, [6, 30, 0], [4, 4, 4], dict(real_counts=[1, 4, 2], pad_rows=1)),
}


def split_forward(case, page_size: int, latent_value_dim: int | None = None):
    """The split backend and the torch reference on copies of the pools: (split output, reference output)."""
    q, k, v, kc, vc, start, batch, table = case
    scale = q.shape[-1] ** -0.5
    split = create_backend("torch-split", page_size)
    split.plan(batch, table)
    ref_k, ref_v = kc.clone(), vc.clone()
    if latent_value_dim is None:
        ref = TorchAttention(page_size).forward(q, k, v, ref_k, ref_v, start, batch, table, scale)
        out = split.forward(q, k, v, kc, vc, start, batch, table, scale)
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), "KV store differs"
    else:
        ref = TorchAttention(page_size).forward_latent(q, k[:, 0], ref_k[:, 0], latent_value_dim, start, batch,
                                                       table, scale)
        out = split.forward_latent(q, k[:, 0], kc[:, 0], latent_value_dim, start, batch, table, scale)
        assert torch.equal(kc, ref_k), "latent store differs"
    assert out.shape == ref.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    return out, ref


def latent_case(phase, prefixes, q_lens, page_size, *, heads, key_dim, value_dim, **kw):
    return make_case(phase, prefixes, q_lens, page_size, heads=heads, kv_heads=1, head_dim=key_dim, **kw), value_dim


# --- merge of two halves == one masked attention, every phase -----------------------------------------------------
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("kind", ["mha", "gqa", "mla"])
def test_split_equals_one_masked_attention(phase, page_size, kind):
    ph, prefixes, q_lens, kw = PHASES[phase]
    if kind == "mla":
        case, value_dim = latent_case(ph, prefixes, q_lens, page_size, **MLA, **kw, seed=page_size)
    else:
        case, value_dim = make_case(ph, prefixes, q_lens, page_size, **(MHA if kind == "mha" else GQA), **kw,
                                    seed=page_size), None
    out, ref = split_forward(case, page_size, value_dim)
    assert (out - ref).abs().max().item() < 1e-5
    batch = case[6]
    silent = (batch.kv_lens == 0) & (batch.tree_mask == 0).all(dim=1)  # padding tokens see nothing
    assert torch.all(out[silent] == 0)


def test_padding_only_and_empty_batches():
    case = make_case(Phase.VERIFY, [5], [3], 4, width=8, pad_rows=3, seed=5)
    case[6].kv_lens.zero_()
    case[6].tree_mask.zero_()
    out, ref = split_forward(case, 4)
    assert torch.all(out == 0) and torch.all(ref == 0)
    for latent in (None, 8):
        empty = make_case(Phase.EXTEND, [], [], 4, kv_heads=1 if latent else 2)
        out, _ = split_forward(empty, 4, latent)
        assert out.shape[0] == 0


# --- the halves themselves --------------------------------------------------------------------------------------
def naive_partial(q, k_cache, v_cache, slots_of, scale):
    """Per token and head: (o, lse base 2) over the key slots slots_of(t), by the definition."""
    t_count, heads = q.shape[:2]
    group = heads // k_cache.shape[1]
    o = torch.zeros(t_count, heads, v_cache.shape[-1])
    lse = torch.full((t_count, heads), -math.inf)
    for t in range(t_count):
        slots = slots_of(t)
        if not slots:
            continue
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        vals = v_cache[slots].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[t].float(), keys) * scale
        lse[t] = torch.logsumexp(s, dim=-1) / math.log(2)
        o[t] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vals)
    return o, lse


@pytest.mark.parametrize("page_size", [1, 16])
def test_halves_are_prefix_and_scratch_with_base2_lse(page_size):
    """attend_prefix sees kv_lens only, attend_scratch the ancestor bits only; both LSEs are log2-sum-exp."""
    q, k, v, kc, vc, start, batch, table = make_case(Phase.VERIFY, [9, 0, 33], [6, 6, 6], page_size, width=10,
                                                     **GQA, pad_rows=1, seed=11)
    kc[batch.out_slots], vc[batch.out_slots] = k, v
    scale = 0.25
    rows, w = batch.token_rows, batch.scratch_width

    def prefix_slots(t):
        row = int(rows[t])
        return [int(table[row, p // page_size]) * page_size + p % page_size for p in range(int(batch.kv_lens[t]))]

    def scratch_slots(t):
        row, mask = int(rows[t]), int(batch.tree_mask[t, 0])
        return [start + row * w + j for j in range(w) if (mask >> j) & 1]

    for got, (want_o, want_lse) in (
        (attend_prefix(q, kc, vc, batch, table, page_size, scale), naive_partial(q, kc, vc, prefix_slots, scale)),
        (attend_scratch(q, kc, vc, batch, start, scale), naive_partial(q, kc, vc, scratch_slots, scale)),
    ):
        o, lse = got
        assert o.dtype == lse.dtype == torch.float32
        assert (o - want_o).abs().max() < 1e-5
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
        finite = torch.isfinite(want_lse)
        assert (lse[finite] - want_lse[finite]).abs().max() < 1e-5


def test_merge_states_edge_rows():
    """One half empty: the other unchanged; both empty: zeros and -inf; otherwise the LSE-weighted mix."""
    g = torch.Generator().manual_seed(0)
    o_a, o_b = torch.randn(4, 2, 3, generator=g), torch.randn(4, 2, 3, generator=g)
    inf = math.inf
    lse_a = torch.tensor([[1.0, -inf], [-inf, -inf], [0.5, 2.0], [30.0, -3.0]])
    lse_b = torch.tensor([[-inf, 0.0], [-inf, -inf], [1.5, 2.0], [-20.0, 40.0]])
    o_b[0, 0] = o_a[0, 1] = o_a[1] = o_b[1] = 0.0  # an empty half's output is zeros
    o, lse = merge_states(o_a, lse_a, o_b, lse_b)
    assert torch.equal(o[0, 0], o_a[0, 0]) and torch.equal(o[0, 1], o_b[0, 1])
    assert torch.all(o[1] == 0) and torch.all(lse[1] == -inf)
    want_lse = torch.log2(torch.exp2(lse_a) + torch.exp2(lse_b))  # fine in float64 range for these rows
    assert torch.allclose(lse[2:], want_lse[2:].float(), atol=1e-5)
    w_a = torch.exp2(lse_a[2] - want_lse[2])[:, None]
    assert torch.allclose(o[2], w_a * o_a[2] + (1 - w_a) * o_b[2], atol=1e-6)
    assert torch.isfinite(o).all()


# --- registry, config and CLI ---------------------------------------------------------------------------------
def test_registry_lists_backends_without_importing_them():
    code = ("import sys; from spruce.attention import registry; print(','.join(registry.choices())); "
            "print(sorted(m for m in ('torch', 'triton', 'flashinfer') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    names, imported = run.stdout.split()
    assert names.split(",")[-1] == "auto" and {"torch", "triton", "torch-split"} <= set(names.split(","))
    assert imported == "[]"


def test_config_choices_and_errors_come_from_the_registry():
    with pytest.raises(ConfigError, match=r"attention_backend='flash' is not supported; expected one of 'torch', "
                                          r"'triton', 'torch-split'.*'auto'"):
        EngineConfig(model="m", attention_backend="flash")
    assert EngineConfig(model="m").resolved_attention_backend == "torch"
    assert EngineConfig(model="m", attention_backend="auto").resolved_attention_backend == "torch"
    assert EngineConfig(model="m", attention_backend="torch-split").resolved_attention_backend == "torch-split"
    assert registry.resolve(None, "cuda") == registry.resolve("auto", "cuda:1") == "triton"
    assert registry.describe_choice(None, "cuda") == "attention_backend='triton' (the default on cuda: 'auto')"
    assert registry.graph_backends() == ("triton", "flashinfer")


def test_flashinfer_is_registered_with_its_limits(monkeypatch):
    """Listed everywhere; refused with the install hint when the package is missing; no float32."""
    monkeypatch.setattr("spruce.config._check_device_available", lambda device: None)
    info = registry.get_info("flashinfer")
    assert "flashinfer" in registry.choices() and info.cuda_graphs and info.mla
    monkeypatch.setattr(registry, "_importable", lambda package: package != "flashinfer")
    with pytest.raises(ConfigError, match=r"attention_backend='flashinfer' needs flashinfer, which is not installed: "
                                          r"pip install 'spruce\[flashinfer\]'"):
        EngineConfig(model="m", device="cuda", attention_backend="flashinfer")
    monkeypatch.setattr(registry, "_importable", lambda package: True)
    with pytest.raises(ConfigError, match=r"attention_backend='flashinfer' does not support dtype='float32'"):
        EngineConfig(model="m", device="cuda", attention_backend="flashinfer", dtype="float32")
    registry.check_model("flashinfer", mla=True, what="the target")
    with pytest.raises(ConfigError, match=r"does not support head_dim=96"):
        registry.check_model("flashinfer", head_dim=96)


def test_cuda_graph_rule_names_the_capable_backends(monkeypatch):
    monkeypatch.setattr("spruce.config._check_device_available", lambda device: None)  # a CUDA-less machine
    with pytest.raises(ConfigError, match=r"cuda_graph=True needs an attention backend with CUDA graphs "
                                          r"\('triton', 'flashinfer'\);"
                                          r" attention_backend='torch-split' runs eagerly"):
        EngineConfig(model="m", device="cuda", attention_backend="torch-split", cuda_graph=True)
    assert not EngineConfig(model="m", device="cuda", attention_backend="torch").use_cuda_graph


def test_a_plugged_in_backend_is_checked_by_its_capabilities(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register(registry.BackendInfo("fake", "spruce.attention.torch_backend:TorchAttention", "test",
                                           mla=False, dtypes=("bfloat16",), head_dims=(64, 128), needs_cuda=True))
    assert "fake" in registry.choices()
    with pytest.raises(ConfigError, match=r"attention_backend='fake' needs a CUDA device, got device='cpu'; choose "
                                          r"attention_backend="):
        EngineConfig(model="m", attention_backend="fake")
    with pytest.raises(ConfigError, match="has no MLA .latent. attention, which the target needs"):
        registry.check_model("fake", mla=True, what="the target")
    with pytest.raises(ConfigError, match=r"does not support head_dim=96 \(the draft\); it supports 64, 128"):
        registry.check_model("fake", head_dim=96, what="the draft")
    registry.check_model("fake", head_dim=128)
    with pytest.raises(ConfigError, match="reserved"):
        registry.register(registry.BackendInfo("auto", "x:y", "no"))
    registry.register(registry.BackendInfo("needs-pkg", "x:y", "test", requires="no_such_package_spruce"))
    with pytest.raises(ConfigError, match=r"attention_backend='needs-pkg' needs no_such_package_spruce, which is not "
                                          r"installed: pip install 'spruce\[no_such_package_spruce\]'"):
        create_backend("needs-pkg", 16)


def test_cli_choices_include_auto_and_split(capsys):
    from spruce.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--attention-backend", "flash"])
    err = capsys.readouterr().err
    assert "invalid choice: 'flash'" in err and "'torch-split'" in err and "'auto'" in err


# --- the plan hook ----------------------------------------------------------------------------------------------
def test_split_backend_refuses_an_unplanned_forward():
    q, k, v, kc, vc, start, batch, table = make_case(Phase.DECODE, [3, 8], [1, 1], 4, seed=1)
    split = create_backend("torch-split", 4)
    with pytest.raises(InvariantError, match="decode: attention forward over a batch of layout"):
        split.forward(q, k, v, kc, vc, start, batch, table, 0.25)
    split.plan(batch, table)
    split.forward(q, k, v, kc, vc, start, batch, table, 0.25)


def test_bucket_graphs_plan_before_eager_runs_and_replays():
    """run() plans outside the phase: (bs, max_kv) before an eager fn, (bucket, real max_kv) before a replay."""
    from spruce.limits import Limits
    from spruce.runtime.cuda_graph import BucketGraphs

    graphs = BucketGraphs(Limits(max_running_requests=8, page_size=4, context_length=64, num_pages=40,
                                 chunked_prefill_size=64, graph_max_bs=4), torch.device("cpu"), enabled=False)
    events = []

    def plan(rows, max_kv):
        events.append(("plan", rows, max_kv, graphs.phase))

    def fn(rows, max_kv):
        events.append(("fn", rows, max_kv, graphs.phase))
        return "eager"

    class Graph:
        def replay(self):
            events.append(("replay", graphs.phase))

    assert graphs.run("decode", fn, 3, 20, plan=plan) == "eager"
    graphs.enabled = True
    graphs.graphs[("decode", 4)] = (Graph(), "static")
    assert graphs.run("decode", fn, 3, 20, plan=plan) == "static"
    assert graphs.run("decode", fn, 6, 30, plan=plan) == "eager"  # above the largest bucket
    assert events == [("plan", 3, 20, None), ("fn", 3, 20, "decode"), ("plan", 4, 20, None), ("replay", None),
                      ("plan", 6, 30, None), ("fn", 6, 30, "decode")]
    assert graphs.phase is None


# --- the whole engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    from spruce.config import builtin_model_path
    from checkpoints import write_eagle3_checkpoint

    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("d") / "e3", builtin_model_path(), seed=1))


PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class A:\n    def", "x = [1, 2,"]


def test_engine_on_split_backend_equals_torch(eagle3):
    """Greedy spec decoding (K=4 S=3 N=8, page 16) and plain decoding give identical tokens on torch-split and
    torch; every forward on torch-split ran under a plan of its layout (the split backend and the runner check)."""
    from spruce import LLM, SamplingParams

    spec = dict(draft_model=eagle3, speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs, planned = {}, {}
    for backend in ("torch", "torch-split"):
        for kind, kw in (("spec", spec), ("plain", {})):
            llm = LLM(attention_backend=backend, page_size=16, **kw)
            outs[backend, kind] = [o.token_ids for o in llm.generate(PROMPTS if kind == "spec" else PROMPTS[:2],
                                                                     params)]
            assert llm.engine.runner.backend.name == backend
            planned[kind] = set(getattr(llm.engine.runner.backend, "planned", ()))
    assert outs["torch", "spec"] == outs["torch-split", "spec"]
    assert outs["torch", "plain"] == outs["torch-split", "plain"] == outs["torch", "spec"][:2]
    assert all(len(t) == 12 for t in outs["torch", "spec"])
    assert planned == {"spec": {Phase.EXTEND, Phase.DRAFT_DECODE, Phase.VERIFY, Phase.DRAFT_EXTEND},
                       "plain": {Phase.EXTEND, Phase.DECODE}}


def test_runner_refuses_a_phase_forward_its_plan_did_not_cover(eagle3):
    from spruce import LLM

    llm = LLM(attention_backend="torch-split", draft_model=eagle3, speculative_num_steps=3, speculative_eagle_topk=4,
              speculative_num_draft_tokens=8)
    r = llm.engine.runner
    rows = torch.tensor([0, 1])
    zeros = torch.zeros(2, dtype=torch.int64)
    r.planner(Phase.DECODE)(2, 9)
    with r.graphs.running("decode"):
        r.target_forward(r.builder.decode(rows, zeros, zeros, 9))  # planned: fine
        with pytest.raises(InvariantError, match="phase 'decode': decode forward over a batch of layout .* but "
                                                 "the phase planned"):
            r.target_forward(r.builder.decode(rows, zeros, zeros, 10))  # another max_kv_len: not planned
    r.target_forward(r.builder.decode(rows, zeros, zeros, 10))  # outside a phase: planned right before it
    assert isinstance(r.backend, AttentionBackend) and r.backend.limits is r.limits


def test_engine_on_split_backend_equals_torch_mla(make_llm, tmp_path):
    """An MLA target (random DeepSeek-V3, latent KV) with its own MTP layer drafting trees (NEXTN, K=4 S=3 N=8,
    page 16): identical greedy tokens on torch-split and torch, target and draft both through forward_latent."""
    pytest.importorskip("transformers")
    from spruce import SamplingParams
    from checkpoints import write_deepseek_checkpoint
    from mtp_checkpoints import add_mtp_layers

    target = write_deepseek_checkpoint(tmp_path / "t", version=3, layers=2, seed=4, init_std=0.05)
    model = add_mtp_layers(target, tmp_path / "t-mtp", num_layers=1, seed=5, std=0.05)
    prompts = [[5, 9, 33, 70, 2, 11, 12, 90], [100, 3, 4]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "torch-split"):
        llm = make_llm(model, attention_backend=backend, page_size=16, speculative_algorithm="NEXTN",
                       speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["torch"] == outs["torch-split"] and all(len(t) == 12 for t in outs["torch"])
    runner = llm.engine.runner
    assert type(runner.target_kv).__name__ == type(runner.draft_kv).__name__ == "LatentKVPool"


# --- the flashinfer backend's split, with torch standing in for FlashInfer (DESIGN §13) ---------------------------
def request_floors(batch, seed: int, exact: bool = False) -> torch.Tensor:
    """A host-known floor per request: <= every kv length its real tokens attend to (0 for padding); random in
    that range, or (exact) the largest, as without overlap scheduling. [bs] int32 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    starts = [int(x) for x in batch.qo_indptr.cpu()]
    lens = batch.kv_lens.cpu()
    floors = []
    for b in range(batch.batch_size):
        real = lens[starts[b]:starts[b + 1]]
        real = real[real > 0]
        top = int(real.min()) if real.numel() else 0
        floors.append(top if exact or not top else int(torch.randint(0, top + 1, (1,), generator=g)))
    return torch.tensor(floors, dtype=torch.int32)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("phase", ["decode", "verify", "draft_decode", "draft_extend"])
def test_prefix_floor_plus_triton_tail_equals_one_attention(phase, page_size):
    """[0, floor) by a paged kernel (torch here, FlashInfer on the GPU) merged with the Triton kernel's
    [floor, kv_len) + scratch half (kv_start, LSE out) equals one masked attention, LSE included."""
    pytest.importorskip("triton")
    from spruce.attention.triton_backend import TritonAttention

    ph, prefixes, q_lens, kw = PHASES[phase]
    q, k, v, kc, vc, start, batch, table = make_case(ph, prefixes, q_lens, page_size, **GQA, **kw, seed=3)
    scale = q.shape[-1] ** -0.5
    ref = TorchAttention(page_size).forward(q, k, v, kc, vc, start, batch, table, scale)  # also stores K/V
    floors = request_floors(batch, seed=page_size)
    o_prefix, lse_prefix = attend_prefix(q, kc, vc, batch, table, page_size, scale, kv_stop=floors)
    o_tail, lse_tail = TritonAttention(page_size).attend(q, kc, vc, start, batch, table, scale, kv_start=floors,
                                                         return_lse=True)
    want_o, want_lse = merge_states(*attend_prefix(q, kc, vc, batch, table, page_size, scale, kv_start=floors),
                                    *attend_scratch(q, kc, vc, batch, start, scale))
    seen = torch.isfinite(want_lse)
    assert torch.equal(seen, torch.isfinite(lse_tail))
    assert (lse_tail[seen] - want_lse[seen]).abs().max() < 1e-4 and (o_tail - want_o).abs().max() < 1e-4
    out, lse = merge_states(o_prefix, lse_prefix, o_tail, lse_tail)
    out = torch.where(torch.isfinite(lse)[..., None], out, 0.0)  # what the backend does: padding gets zeros
    assert (out - ref).abs().max().item() < 1e-5
    assert bool((floors > 0).any()), "the case must exercise a non-empty prefix half"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("phase", ["decode", "verify", "draft_decode", "draft_extend"])
def test_latent_prefix_floor_plus_triton_tail_equals_one_attention(phase, page_size):
    """The MLA form of the split above: the latent as one KV head whose value is its first Dv columns."""
    pytest.importorskip("triton")
    from spruce.attention.triton_backend import TritonAttention

    ph, prefixes, q_lens, kw = PHASES[phase]
    case, value_dim = latent_case(ph, prefixes, q_lens, page_size, **MLA, **kw, seed=4)
    q, k, v, kc, vc, start, batch, table = case
    scale = q.shape[-1] ** -0.5
    cache = kc[:, 0]  # [slots, Dk]
    ref = TorchAttention(page_size).forward_latent(q, k[:, 0], cache, value_dim, start, batch, table, scale)
    keys, vals = cache[:, None, :], cache[:, None, :value_dim]
    floors = request_floors(batch, seed=page_size)
    o_prefix, lse_prefix = attend_prefix(q, keys, vals, batch, table, page_size, scale, kv_stop=floors)
    o_tail, lse_tail = TritonAttention(page_size).attend_latent(q, cache, value_dim, start, batch, table, scale,
                                                                kv_start=floors, return_lse=True)
    out, lse = merge_states(o_prefix, lse_prefix, o_tail, lse_tail)
    out = torch.where(torch.isfinite(lse)[..., None], out, 0.0)
    assert (out - ref).abs().max().item() < 1e-5
    assert bool((floors > 0).any())
