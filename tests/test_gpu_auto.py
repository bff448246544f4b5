"""GPU-only: `auto` (the CUDA default) picks each phase's backend from this GPU's packaged kernel table (DESIGN
§13), the engine's greedy speculative output equals plain output on it, and a composite that mixes triton and
flashinfer over the phases keeps graphs == eager.

Run on the device (flashinfer-python installed): `pytest -m gpu tests/test_gpu_auto.py`
(or `MODE=auto bash bench/device_flashinfer.sh`); SPRUCE_GPU_REPORT=FILE adds the match rates to that file.
"""

from __future__ import annotations

import json

import pytest
import torch

from spruce import LLM
from spruce.attention import kernel_table
from spruce.attention.metadata import Phase
from test_gpu import divergences, draft19m, generate, prompts19m, write_report  # noqa: F401 (fixtures)

pytestmark = pytest.mark.gpu
flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None

H100 = "NVIDIA H100 80GB HBM3"
SPEC = dict(speculative_num_steps=4, speculative_eagle_topk=4, speculative_num_draft_tokens=12)


def fastest_by_sum(bench_rows: list[dict], phase: str) -> str:
    """The rule, computed here from the bench rows directly: the backend of the lower summed time."""
    rows = [r for r in bench_rows if r["phase"] == phase]
    return min(("triton", "flashinfer"), key=lambda b: sum(r[f"{b}_ms"] for r in rows))


def test_auto_on_the_h100_runs_the_tables_choice(pycode19m):
    """On the H100 the default backend runs, per phase, the backend of the lower summed time in the committed
    bench table (flashinfer in every phase), builds exactly those, and names them in the engine's info."""
    name = torch.cuda.get_device_name()
    if name != H100:
        pytest.skip(f"the committed kernel table is for {H100!r}, this is {name!r}")
    rows = json.loads(kernel_table.find_table(H100).path.read_text())["rows"]
    want = {p: fastest_by_sum(rows, p.value) for p in Phase}
    assert set(want.values()) == {"flashinfer"}
    llm = LLM(pycode19m, device="cuda", dtype="bfloat16")  # attention_backend: the default, auto
    backend = llm.engine.runner.backend
    assert {p: backend.backend_for(p).name for p in Phase} == want
    named = ", ".join(f"{p.value}={b}" for p, b in want.items())
    assert llm.engine.info()["attention_backend"] == f"auto ({named})"
    del llm, backend
    torch.cuda.empty_cache()  # the engine sized its KV cache from the free memory: give it back


def test_auto_spec_greedy_matches_plain(pycode19m, draft19m, prompts19m):
    """bf16, graphs and overlap on, the default backend: EAGLE-3 tree speculation == plain decoding; any
    divergence must be a near-tie of the float32 target."""
    transformers = pytest.importorskip("transformers")
    kw = dict(dtype="bfloat16", page_size=16, attention_backend="auto")
    plain, _ = generate(pycode19m, prompts19m, 48, **kw)
    spec, stats = generate(pycode19m, prompts19m, 48, **kw, draft_model=draft19m, **SPEC)
    hf = transformers.AutoModelForCausalLM.from_pretrained(pycode19m, dtype=torch.float32).cuda().eval()
    rate, gaps = divergences(hf, prompts19m, plain, spec)
    write_report({"auto_spec_vs_plain": {"token_match_rate": rate, "top2_gaps_at_divergence": gaps,
                                         "spec": stats["spec"]}})
    assert all(g < 0.5 for g in gaps), gaps


def test_mixed_composite_graphs_equal_eager_and_spec_matches_plain(pycode19m, draft19m, prompts19m, monkeypatch,
                                                                  tmp_path):
    """A table for this GPU that gives the tree phases to triton and the rest to flashinfer: every bucket's
    graphs equal eager (each phase's graph holds one backend's kernels), and spec == plain up to near-ties.
    Triton's kv split count follows the kv bound (the Limits' in a graph, the batch's eagerly), which moves bf16
    roundings (DESIGN §9); it is held at 1 here so that graphs and eager run the same kernels bit for bit."""
    from spruce.attention.triton_backend import TritonAttention

    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(TritonAttention, "num_splits", lambda self, *args: 1)
    faster = dict(extend="flashinfer", decode="flashinfer", verify="triton", draft_decode="triton",
                  draft_extend="flashinfer")
    rows = [{"phase": p, "bs": 1, "context": 1024, "triton_ms": 1.0 if b == "triton" else 2.0,
             "flashinfer_ms": 1.0 if b == "flashinfer" else 2.0} for p, b in faster.items()]
    (tmp_path / "mixed.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
    monkeypatch.setattr(kernel_table, "TABLES_DIR", tmp_path)
    kw = dict(dtype="bfloat16", page_size=16, max_running_requests=16, attention_backend="auto")
    llm = LLM(pycode19m, device="cuda", cuda_graph=False, **kw)
    assert {p.value: llm.engine.runner.backend.backend_for(p).name for p in Phase} == faster
    del llm
    torch.cuda.empty_cache()
    for bs in [1, 3, 8, 13]:
        ps = prompts19m[:bs]
        eager, _ = generate(pycode19m, ps, 24, cuda_graph=False, draft_model=draft19m, **SPEC, **kw)
        graph, _ = generate(pycode19m, ps, 24, cuda_graph=True, draft_model=draft19m, **SPEC, **kw)
        assert graph == eager, f"bs={bs}"
    plain, _ = generate(pycode19m, prompts19m, 48, **kw)
    spec, _ = generate(pycode19m, prompts19m, 48, draft_model=draft19m, **SPEC, **kw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(pycode19m, dtype=torch.float32).cuda().eval()
    rate, gaps = divergences(hf, prompts19m, plain, spec)
    write_report({"auto_mixed_spec_vs_plain": {"token_match_rate": rate, "top2_gaps_at_divergence": gaps}})
    assert all(g < 0.5 for g in gaps), gaps
