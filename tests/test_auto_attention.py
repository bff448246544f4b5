"""`auto`: per-phase backend choice from a kernel table, and the composite that runs it (DESIGN §13).

The rule on fake tables, the packaged table against its bench result, the composite (torch, torch-split and
triton mixed per phase, Triton through its interpreter on CPU) against the torch reference on every phase, the
fallbacks with their one log line, and the whole engine on a composite: speculative greedy == plain."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from spruce.attention import kernel_table, registry
from spruce.attention.kernel_table import KernelTable, PhaseChoice, load_table, rank, select
from spruce.attention.metadata import Phase
from spruce.attention.torch_backend import TorchAttention
from spruce.errors import InvariantError
from test_attention_merge import MLA, PHASES, latent_case
from test_torch_attention import make_case

REPO = Path(__file__).resolve().parents[1]
H100 = "NVIDIA H100 80GB HBM3"
ALL = tuple(p.value for p in Phase)


def fake_table(cells: dict[str, dict[tuple[int, int], dict[str, float]]], device="Fake GPU") -> KernelTable:
    """A table from {phase: {(bs, context): {backend: ms}}}."""
    rows = tuple({"phase": phase, "bs": bs, "context": ctx, **{f"{n}_ms": ms for n, ms in times.items()}}
                 for phase, grid in cells.items() for (bs, ctx), times in grid.items())
    return KernelTable(Path("fake.json"), device, rows)


# --- the rule (no torch needed) -----------------------------------------------------------------------------------
def test_rule_is_the_lower_sum_over_the_grid():
    table = fake_table({
        # triton wins two cells of three by microseconds, flashinfer the long context by milliseconds
        "decode": {(1, 1024): dict(triton=0.014, flashinfer=0.024), (1, 8192): dict(triton=0.030, flashinfer=0.035),
                   (1, 32768): dict(triton=0.120, flashinfer=0.070)},
        # triton's sum is lower although flashinfer wins one cell
        "verify": {(1, 1024): dict(triton=0.02, flashinfer=0.05), (16, 1024): dict(triton=0.10, flashinfer=0.09)},
        # flashinfer misses a cell: not ranked on this phase
        "draft_decode": {(1, 1024): dict(triton=0.5, flashinfer=0.1), (1, 8192): dict(triton=0.9)},
        "extend": {(1, 1024): dict(triton=0.2, flashinfer=0.1)},
    })
    among = ("torch", "triton", "flashinfer")
    assert [n for n, _ in rank(table, "decode", among)] == ["flashinfer", "triton"]
    assert rank(table, "decode", among)[0][1] == pytest.approx(0.129)
    assert [n for n, _ in rank(table, "verify", among)] == ["triton", "flashinfer"]
    assert [n for n, _ in rank(table, "draft_decode", among)] == ["triton"]
    assert rank(table, "draft_extend", among) == []
    runnable = {"triton": None, "flashinfer": None}
    got = select(table, ALL, runnable, "triton")
    assert {p: c.backend for p, c in got.items()} == dict(extend="flashinfer", decode="flashinfer", verify="triton",
                                                          draft_decode="triton", draft_extend="triton")
    assert not got["decode"].fell_back and "0.129 ms summed over the table's 3 decode cells" in got["decode"].reason
    assert got["draft_extend"].fell_back and "no candidate backend" in got["draft_extend"].reason
    # a refused faster backend: the next ranked one runs, and the reason names the refusal
    refused = select(table, ALL, {"triton": None, "flashinfer": "needs flashinfer, which is not installed"}, "triton")
    assert refused["decode"] == PhaseChoice("triton", "flashinfer (measured faster) needs flashinfer, which is not "
                                                      "installed", fell_back=True)
    assert refused["verify"] == got["verify"]  # triton was the table's choice there anyway
    assert all(c == PhaseChoice("triton", "no table", fell_back=True)
               for c in select(None, ALL, runnable, "triton", no_table="no table").values())


def test_tables_are_found_by_their_device_and_checked(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"device": "GPU A", "rows": [{"phase": "decode", "bs": 1,
                                                                             "context": 8, "triton_ms": 1.0}]}))
    assert kernel_table.find_table("GPU A", tmp_path).device == "GPU A"
    assert kernel_table.find_table("GPU B", tmp_path) is None
    assert kernel_table.known_devices(tmp_path) == ("GPU A",)
    (tmp_path / "b.json").write_text(json.dumps({"device": "GPU B", "rows": [{"phase": "decode", "bs": "1"}]}))
    with pytest.raises(kernel_table.TableError, match=r"b.json: row 0 needs 'phase' \(a string\), 'bs' and "):
        kernel_table.find_table("GPU B", tmp_path)


def test_packaged_tables_are_bench_results_and_the_h100_choice():
    """Each packaged table is a bench result (bench/results/<source>) as installed; on the H100 the rule gives
    FlashInfer every phase when it can run (the bench's 1k-context wins of Triton are microseconds), else triton."""
    tables = sorted(kernel_table.TABLES_DIR.glob("*.json"))
    assert tables, "no packaged kernel table"
    for path in tables:
        packaged = json.loads(path.read_text())
        bench = json.loads((REPO / "bench" / "results" / packaged["source"]).read_text())
        assert {**bench, "source": packaged["source"]} == packaged, path
        assert path.name == kernel_table.slug(packaged["device"]) + ".json"
    h100 = kernel_table.find_table(H100)
    runnable = select(h100, ALL, {"triton": None, "flashinfer": None}, "triton")
    assert {c.backend for c in runnable.values()} == {"flashinfer"} and not any(c.fell_back for c in runnable.values())
    missing = select(h100, ALL, {"triton": None, "flashinfer": "needs flashinfer"}, "triton")
    assert {c.backend for c in missing.values()} == {"triton"} and all(c.fell_back for c in missing.values())


# --- the composite on every phase -------------------------------------------------------------------------------
def composite(assignment: dict[Phase, str], page_size: int):
    """A composite with a fixed choice per phase, allocated, each sub-backend's calls recorded in `calls`."""
    from spruce.attention.auto_backend import PerPhaseAttention

    backend = PerPhaseAttention(page_size, {p: PhaseChoice(n, "test") for p, n in assignment.items()})
    backend.allocate(SimpleNamespace(page_size=page_size), "cpu")
    calls = []
    for sub in backend._backends.values():
        for method in ("plan", "forward", "forward_latent"):
            def spy(*args, _inner=getattr(sub, method), _name=f"{sub.name}.{method}", **kw):
                calls.append(_name)
                return _inner(*args, **kw)
            setattr(sub, method, spy)
    return backend, calls


@pytest.mark.parametrize("shift", [0, 1, 2])
@pytest.mark.parametrize("page_size", [1, 16])
def test_composite_mixing_backends_equals_torch_every_phase(page_size, shift):
    """Each phase on torch, torch-split or triton (rotated by `shift`), planned then run through the composite:
    the phase's backend is the one called, and every phase equals the torch reference (MHA; MLA on two phases)."""
    names = ("triton", "torch-split", "torch")
    assignment = {phase: names[(i + shift) % 3] for i, phase in enumerate(Phase)}
    backend, calls = composite(assignment, page_size)
    for key, (phase, prefixes, q_lens, kw) in PHASES.items():
        latent = key in ("verify", "draft_extend")
        if latent:
            case, value_dim = latent_case(phase, prefixes, q_lens, page_size, **MLA, **kw, seed=page_size + shift)
        else:
            case = make_case(phase, prefixes, q_lens, page_size, heads=8, kv_heads=2, head_dim=16, **kw,
                             seed=page_size + shift)
        q, k, v, kc, vc, start, batch, table = case
        scale = q.shape[-1] ** -0.5
        ref_k, ref_v = kc.clone(), vc.clone()
        calls.clear()
        backend.plan(batch, table)
        if latent:
            ref = TorchAttention(page_size).forward_latent(q, k[:, 0], ref_k[:, 0], value_dim, start, batch, table,
                                                           scale)
            out = backend.forward_latent(q, k[:, 0], kc[:, 0], value_dim, start, batch, table, scale)
        else:
            ref = TorchAttention(page_size).forward(q, k, v, ref_k, ref_v, start, batch, table, scale)
            out = backend.forward(q, k, v, kc, vc, start, batch, table, scale)
        name = assignment[phase]
        assert calls == [f"{name}.plan", f"{name}.{'forward_latent' if latent else 'forward'}"], key
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), f"{key}: KV store differs"
        assert (out - ref).abs().max().item() < 1e-4, key


# --- fallbacks, and the one log line ------------------------------------------------------------------------------
def auto_for(device_name: str, dtype="bfloat16", cuda_graph=True):
    from spruce.attention.auto_backend import auto_attention

    return auto_attention(16, "cuda", device_name, dtype, cuda_graph)


def allocate_logged(backend, caplog) -> str:
    """Allocate (CPU tensors) and return the one log line the composite writes."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="spruce"):
        backend.allocate(SimpleNamespace(page_size=16), "cpu")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention: auto")]
    assert len(lines) == 1, lines
    return lines[0]


def choices_of(backend) -> dict[str, str]:
    return {p.value: c.backend for p, c in backend.choices.items()}


def test_no_table_for_the_device_falls_back_to_triton(caplog):
    backend = auto_for("Some Other GPU")
    assert set(choices_of(backend).values()) == {"triton"}
    line = allocate_logged(backend, caplog)
    assert (f"extend, decode, verify, draft_decode, draft_extend -> triton: no kernel table for 'Some Other GPU' "
            f"(tables: '{H100}')") in line
    assert backend.describe() == ("auto (extend=triton, decode=triton, verify=triton, draft_decode=triton, "
                                  "draft_extend=triton)")


def test_flashinfer_missing_or_unable_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(registry, "_importable", lambda package: package != "flashinfer")
    backend = auto_for(H100)
    assert set(choices_of(backend).values()) == {"triton"}
    assert "-> triton: flashinfer (measured faster) needs flashinfer, which is not installed: pip install " \
           "'spruce[flashinfer]'" in allocate_logged(backend, caplog)
    monkeypatch.setattr(registry, "_importable", lambda package: True)
    assert set(choices_of(auto_for(H100)).values()) == {"flashinfer"}  # the table's choice when it can run
    fp32 = auto_for(H100, dtype="float32")
    assert set(choices_of(fp32).values()) == {"triton"}
    assert "flashinfer (measured faster) does not support dtype='float32'" in fp32.choices[Phase.DECODE].reason


def test_a_model_the_chosen_backend_cannot_serve_falls_back(monkeypatch, caplog):
    """MLA target (the table timed MHA/GQA only) and an unsupported draft head dim: every phase to triton, before
    anything of flashinfer is built (allocate builds triton only)."""
    monkeypatch.setattr(registry, "_importable", lambda package: True)
    backend = auto_for(H100)
    backend.check_model(head_dim=128, what="the target")
    assert set(choices_of(backend).values()) == {"flashinfer"}
    backend.check_model(mla=True, what="the target")
    assert set(choices_of(backend).values()) == {"triton"}
    line = allocate_logged(backend, caplog)
    assert "-> triton: flashinfer (measured faster) was timed on MHA/GQA only: the kernel table has no MLA " \
           "(latent) rows for the target" in line
    assert list(backend._backends) == ["triton"]
    draft = auto_for(H100)
    draft.check_model(head_dim=96, what="the draft")
    assert "does not support head_dim=96 (the draft)" in draft.choices[Phase.VERIFY].reason
    with pytest.raises(InvariantError, match="check_model after allocate"):
        backend.check_model(head_dim=64)


# --- the engine on a composite ----------------------------------------------------------------------------------
def test_engine_on_a_composite_spec_equals_plain(monkeypatch, tmp_path):
    """`auto` through the whole path (table lookup by device name, choice, composite) on CPU with a fake table
    for this CPU that mixes torch and triton over the phases: EAGLE-3 greedy == plain == plain torch."""
    from spruce import LLM, SamplingParams
    from spruce.config import builtin_draft_path
    from spruce.runtime.device import device_name

    faster = dict(extend="torch", decode="triton", verify="triton", draft_decode="torch", draft_extend="triton")
    table = {"device": device_name("cpu"), "rows": [
        {"phase": p, "bs": 1, "context": 1024, "torch_ms": 1.0 if n == "torch" else 2.0,
         "triton_ms": 1.0 if n == "triton" else 2.0} for p, n in faster.items()]}
    (tmp_path / "cpu.json").write_text(json.dumps(table))
    monkeypatch.setattr(kernel_table, "TABLES_DIR", tmp_path)
    monkeypatch.setattr(registry, "is_auto", lambda name, device: name == registry.AUTO)  # the composite on CPU
    prompts = ["def fib(n):", "import os\nimport sys\n"]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = {}
    for name, kw in (("torch", dict(attention_backend="torch")), ("auto", dict(attention_backend="auto")),
                     ("auto-spec", dict(attention_backend="auto", draft_model=str(builtin_draft_path()),
                                        speculative_num_steps=3, speculative_eagle_topk=2,
                                        speculative_num_draft_tokens=5))):
        llm = LLM(page_size=4, **kw)
        if name != "torch":
            assert llm.engine.info()["attention_backend"] == (
                "auto (extend=torch, decode=triton, verify=triton, draft_decode=torch, draft_extend=triton)")
        outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
        if name == "auto-spec":
            spec = llm.engine.stats()["spec"]
            assert spec["rounds"] > 0 and spec["mean_accept_length"] > 0  # the tree phases ran and accepted
    assert outs["auto-spec"] == outs["auto"] == outs["torch"]
