"""GPU-only: CUDA graphs equal eager for every bucket; bf16 speculative greedy matches plain greedy.

Run on the device with `pytest -m gpu`; SPRUCE_GPU_REPORT=FILE writes the measured match rates as JSON.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from spruce import LLM, SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from checkpoints import write_eagle3_checkpoint
from oracle_draft import install_oracle

pytestmark = pytest.mark.gpu
REPORT: dict = {}


@pytest.fixture(scope="module")
def draft19m(pycode19m, tmp_path_factory):
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("d") / "e3", pycode19m, seed=11))


@pytest.fixture(scope="module")
def prompts19m(pycode19m, heldout_prompts):
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(pycode19m, ModelConfig.from_dir(pycode19m))
    return [tok.encode(t)[: 40 + 13 * i] for i, t in enumerate(heldout_prompts[:16])]


def generate(model, prompts, n, oracle_refs=None, accepts=False, **kw):
    """Greedy outputs (token ids) and engine stats of a fresh CUDA engine (triton unless `kw` says otherwise),
    leak-checked. With `oracle_refs`, the draft is wrapped by the oracle, which runs on the host: such an engine
    must run eagerly (cuda_graph=False), or its captured graphs replay the unwrapped draft. `accepts`: each output
    is (token ids, the request's accept length counts): the target's verification keeps the tokens of a corrupted
    draft right, only the accept lengths show the damage."""
    llm = LLM(model, device="cuda", **{"attention_backend": "triton", **kw})
    if oracle_refs is not None:
        o = install_oracle(llm, 0.7)
        for p, out in zip(prompts, oracle_refs):
            o.add_reference(p, out)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    stats = llm.engine.stats()
    llm.engine.check_no_leaks()
    del llm
    torch.cuda.empty_cache()
    if accepts:
        return [(o.token_ids, (o.spec_stats or {}).get("accept_length_counts")) for o in outs], stats
    return [o.token_ids for o in outs], stats


SPEC = dict(speculative_num_steps=4, speculative_eagle_topk=4, speculative_num_draft_tokens=12)


@pytest.mark.parametrize("case", ["plain", "random-head", "trained-head"])
def test_cuda_graph_equals_eager_every_bucket(pycode19m, draft19m, prompts19m, heldout_prompts, case):
    """float32 so that a different kv split count cannot flip an argmax; every bucket incl. padded ones. Each
    request's tokens and accept length counts are equal; "trained-head": the bundled model with its trained EAGLE-3
    head, whose drafts are accepted, so draft-side damage under padding (a stale draft state for padded rows)
    lowers the accept lengths."""
    model, prompts = pycode19m, prompts19m
    kw = dict(dtype="float32", page_size=16, max_running_requests=16)
    if case == "random-head":
        kw.update(draft_model=draft19m, **SPEC)
    if case == "trained-head":
        model, prompts = builtin_model_path(), [t[: 120 + 40 * i] for i, t in enumerate(heldout_prompts[:16])]
        kw.update(draft_model=str(builtin_draft_path()), **SPEC)
    for bs in [1, 2, 3, 4, 7, 8, 13, 16]:
        ps = prompts[:bs]
        eager, _ = generate(model, ps, 24, cuda_graph=False, accepts=True, **kw)
        graph, stats = generate(model, ps, 24, cuda_graph=True, accepts=True, **kw)
        assert graph == eager, f"bs={bs}"
        if case == "trained-head":
            assert stats["spec"]["mean_accept_length"] > 1.5, f"bs={bs}"


def near_tie_gap(model, prefix: list[int]) -> float:
    """Top-2 logit gap of the target (transformers, float32) after `prefix`."""
    with torch.no_grad():
        logits = model(torch.tensor([prefix], device="cuda")).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def divergences(hf, prompts, reference, other) -> tuple[float, list[float]]:
    """Token match rate of `other` against `reference` (greedy outputs per prompt), and the float32 target's
    top-2 gap at each first divergence."""
    matched = total = 0
    gaps = []
    for p, a, b in zip(prompts, reference, other):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        total += len(a)
        matched += len(a) if first is None else first
        if first is not None:
            gaps.append(near_tie_gap(hf, p + a[:first]))
    return matched / total, gaps


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_bf16_spec_greedy_matches_plain(pycode19m, draft19m, prompts19m, k, page):
    transformers = pytest.importorskip("transformers")
    n = 48
    s, nd = (5, 6) if k == 1 else (5, 16 if k == 4 else 32)
    plain, _ = generate(pycode19m, prompts19m, n, dtype="bfloat16", page_size=page)
    # eager: the oracle wraps the draft after construction, so it must not be baked into captured graphs
    spec, stats = generate(pycode19m, prompts19m, n, oracle_refs=plain, dtype="bfloat16", page_size=page,
                           cuda_graph=False,
                           draft_model=draft19m, speculative_num_steps=s, speculative_eagle_topk=k,
                           speculative_num_draft_tokens=nd)
    hf = transformers.AutoModelForCausalLM.from_pretrained(pycode19m, dtype=torch.float32).cuda().eval()
    rate, gaps = divergences(hf, prompts19m, plain, spec)
    write_report({f"K={k},page={page}": {"token_match_rate": rate, "divergences": len(gaps),
                                         "top2_gaps_at_divergence": gaps, "spec": stats["spec"]}})
    assert all(g < 0.5 for g in gaps), gaps  # a divergence is only acceptable on a near-tie


def write_report(entries: dict) -> None:
    """Add `entries` to the JSON file SPRUCE_GPU_REPORT names (kept across test modules)."""
    REPORT.update(entries)
    path = os.environ.get("SPRUCE_GPU_REPORT")
    if path:
        old = json.loads(open(path).read()) if os.path.exists(path) else {}
        with open(path, "w") as f:
            json.dump({**old, **REPORT}, f, indent=2)


def test_overlap_equals_synchronous_loop_with_graphs(pycode19m, draft19m, prompts19m):
    """Overlap on the GPU (pinned result buffers, events, graph replays) gives the synchronous loop's tokens."""
    kw = dict(dtype="float32", page_size=16, max_running_requests=16, cuda_graph=True, draft_model=draft19m,
              speculative_num_steps=4, speculative_eagle_topk=4, speculative_num_draft_tokens=12)
    ps = prompts19m[:13]
    sync, _ = generate(pycode19m, ps, 32, disable_overlap_schedule=True, **kw)
    overlap, stats = generate(pycode19m, ps, 32, **kw)
    assert overlap == sync
    REPORT["overlap_vs_sync_bs13"] = {"equal": True, "spec": stats["spec"]}
    write_report({})


@pytest.mark.parametrize("case", ["plain", "random-head", "trained-head"])
def test_eager_above_largest_bucket_under_overlap(pycode19m, draft19m, prompts19m, heldout_prompts, case):
    """12 requests with graphs captured up to 4: the full batch runs every phase eagerly (reading eager
    outputs, never a graph's buffers), smaller batches replay graphs as requests finish; equal to no graphs, tokens
    and each request's accept length counts ("trained-head": the bundled model's EAGLE-3 head, whose accept lengths
    fall when a phase reads a stale draft state, SGLang #22832's class)."""
    model, ps = pycode19m, prompts19m[:12]
    kw = dict(dtype="float32", page_size=16, max_running_requests=12)
    if case == "random-head":
        kw.update(draft_model=draft19m, **SPEC)
    if case == "trained-head":
        model, ps = builtin_model_path(), [t[: 120 + 40 * i] for i, t in enumerate(heldout_prompts[:12])]
        kw.update(draft_model=str(builtin_draft_path()), **SPEC)
    lengths = [8 + 3 * i for i in range(12)]  # requests finish one by one: the batch shrinks through the buckets
    outs = {}
    for graphs in (False, True):
        llm = LLM(model, device="cuda", attention_backend="triton", cuda_graph=graphs, cuda_graph_max_bs=4, **kw)
        got = llm.generate(ps, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
        outs[graphs] = [(o.token_ids, (o.spec_stats or {}).get("accept_length_counts")) for o in got]
        llm.engine.check_no_leaks()
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("spec", [False, True])
def test_prefill_graphs_equal_eager(pycode19m, draft19m, prompts19m, spec):
    """float32, prefills replayed from graphs (padded to their token bucket, up to 64 tokens) against the same
    engine with every prefill eager: same tokens and prompt logprobs; ragged batches of new prompts, prefix-cache
    hits (a few new tokens past a cached prefix) and prompts larger than the largest bucket (eager) all meet."""
    kw = dict(dtype="float32", page_size=16, max_running_requests=16, chunked_prefill_size=128)
    if spec:
        kw.update(draft_model=draft19m, speculative_num_steps=4, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=12)
    short = [p[:10 + i] for i, p in enumerate(prompts19m[:6])]  # 10-15 tokens each
    cached = [prompts19m[15] + p[:5 + i] for i, p in enumerate(prompts19m[:4])]  # a shared 235-token prefix
    params = SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    outs, replays = {}, {}
    for max_tokens in (0, 64):
        llm = LLM(pycode19m, device="cuda", attention_backend="triton", cuda_graph_max_prefill_tokens=max_tokens, **kw)
        graphs = llm.engine.runner.prefill_graphs
        assert graphs.enabled == bool(max_tokens)
        counted = []
        run = graphs.run
        graphs.run = lambda name, fn, bucket, *a, **k: counted.append(bucket) or run(name, fn, bucket, *a, **k)
        got = [o for batch in ([short[0]], short[1:4], short[4:], cached[:1], cached[1:])
               for o in llm.generate(batch, params)]
        outs[max_tokens] = [(o.token_ids, [None if d is None else {t: round(v.logprob, 3) for t, v in d.items()}
                                           for d in o.prompt_logprobs]) for o in got]
        replays[max_tokens] = counted
        llm.engine.check_no_leaks()
        del llm
        torch.cuda.empty_cache()
    assert [t for t, _ in outs[64]] == [t for t, _ in outs[0]]
    for (_, lp_graph), (_, lp_eager) in zip(outs[64], outs[0]):
        assert [None if d is None else list(d) for d in lp_graph] == [None if d is None else list(d) for d in lp_eager]
    assert replays[0] == [] and {16, 48} <= set(replays[64]), replays[64]  # short[1:4]: 36 tokens
    REPORT.setdefault("prefill_graph_buckets_replayed", {})[str(spec)] = sorted(set(replays[64]))

