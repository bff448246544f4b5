"""ops/compile_watch.py: Triton compilations counted, split into start-up and serving, each one made while serving
logged; /metrics and the serving benchmark read the count."""

from __future__ import annotations

import logging

import pytest
import torch

from spruce.ops import compile_watch


@pytest.fixture
def fresh_watch(monkeypatch):
    """The watch's module state as in a new process, installed (the hook itself is Triton's: see the GPU test)."""
    monkeypatch.setattr(compile_watch, "_counts", {"startup": 0, "serving": 0})
    monkeypatch.setattr(compile_watch, "_state", {"installed": True, "serving": False})


def test_compilations_while_serving_are_counted_apart_and_logged(fresh_watch, caplog):
    compile_watch._record("_rms_norm_kernel[...](H: constexpr=384)")
    assert compile_watch.compiles() == {"startup": 1, "serving": 0}
    compile_watch.serving()
    with caplog.at_level(logging.WARNING, logger="spruce.ops.compile_watch"):
        compile_watch._record("_store_kv_kernel[...](k_stride: i32)")
    assert compile_watch.compiles() == {"startup": 1, "serving": 1}
    assert "while serving (1 so far)" in caplog.text and "_store_kv_kernel" in caplog.text


def test_nothing_is_counted_where_nothing_compiles(monkeypatch):
    """Under the CPU interpreter (the tests' default) there is no compilation to hook: no counts, and /metrics
    shows no series for them."""
    monkeypatch.setattr(compile_watch, "_state", {"installed": False, "serving": False})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert compile_watch.install() is False and compile_watch.compiles() == {}


def test_metrics_show_the_counts():
    from spruce.server.metrics import Metrics

    metrics = Metrics(4, {"device": "cpu"})
    metrics.on_engine_stats({"triton_compiles": {"startup": 12, "serving": 3}})
    text = metrics.render()
    assert 'spruce_triton_compiles_total{phase="serving"} 3' in text
    assert 'spruce_triton_compiles_total{phase="startup"} 12' in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton compiles only there)")
def test_gpu_a_new_specialisation_while_serving_is_counted(monkeypatch):
    """A kernel launched at start-up, then with a new constexpr while serving: one compilation in each phase."""
    import triton
    import triton.language as tl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(compile_watch._state, "serving", False)  # back to start-up after this test

    @triton.jit
    def _fill(out_ptr, value, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.full([BLOCK], value, tl.float32))

    assert compile_watch.install()
    before = compile_watch.compiles()
    out = torch.zeros(64, device="cuda")
    _fill[(1,)](out, 1.0, BLOCK=16)
    compile_watch.serving()
    _fill[(1,)](out, 2.0, BLOCK=16)  # cached: no compilation
    _fill[(1,)](out, 3.0, BLOCK=32)  # a new constexpr: compiled while serving
    torch.cuda.synchronize()
    after = compile_watch.compiles()
    assert after["startup"] - before["startup"] >= 1 and after["serving"] - before.get("serving", 0) == 1
    assert out[:32].eq(3.0).all()


def test_a_compilation_is_named_by_its_kernel_constexprs_and_specialisations():
    class Fn:
        name = "paged_attention_kernel"

    text = compile_watch._describe({"repr": "paged_attention_kernel[num_warps=4](q_ptr: ()", "fn": Fn(),
                                    "compile": {"constants": {(5,): 16}, "signature": {"q_ptr": "*bf16"},
                                                "configs": [{(3,): [["tt.divisibility", 16]]}]}})
    assert text.startswith("paged_attention_kernel constexprs {(5,): 16}") and "*bf16" in text
    assert "tt.divisibility" in text
