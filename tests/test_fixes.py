"""Fix toggles: each registered fix, reverted, makes an always-on invariant fail loudly."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from spruce import SamplingParams
from spruce.config import builtin_model_path
from spruce.errors import ConfigError, InvariantError
from spruce.limits import Limits
from spruce.runtime.cuda_graph import BucketGraphs
from spruce.runtime.fixes import ENV_VAR, FIXES, reverted_fixes_from_env
from checkpoints import write_eagle3_checkpoint
from conftest import PYCODE_MLA

TARGET = builtin_model_path()
TESTS = Path(__file__).parent
MLA_TARGET = PYCODE_MLA  # DeepSeek-V3 architecture: the seeds' MLA bug classes


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("d") / "e3", TARGET, draft_vocab_size=512, seed=9))


@pytest.fixture(scope="module")
def mla_draft(tmp_path_factory):
    if not (MLA_TARGET / "config.json").exists():
        pytest.skip(f"fixture model not found at {MLA_TARGET}")
    return str(write_eagle3_checkpoint(tmp_path_factory.mktemp("d") / "e3", MLA_TARGET, draft_vocab_size=512, seed=9))


def spec_llm(draft, target=TARGET, **kw):
    from spruce import LLM

    return LLM(target, draft_model=draft, speculative_algorithm="EAGLE3", **kw)


def _string_constants(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _reverted_names(test: ast.FunctionDef) -> set[str]:
    """The fix names a test function reverts: the value of `setenv(ENV_VAR, ...)` (or of the variable's literal
    name), and the strings of every `reverted_fixes=...` keyword."""
    names: set[str] = set()
    for node in ast.walk(test):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "setenv" and len(node.args) == 2:
            var = node.args[0]
            if (isinstance(var, ast.Name) and var.id == "ENV_VAR") or (
                    isinstance(var, ast.Constant) and var.value == ENV_VAR):
                names |= _string_constants(node.args[1])
        names |= {s for kw in node.keywords if kw.arg == "reverted_fixes" for s in _string_constants(kw.value)}
    return names


def _expects_invariant_error(test: ast.FunctionDef) -> bool:
    """Whether the test requires an InvariantError (`pytest.raises(InvariantError, ...)`): a revert test shows the
    reverted fix failing loudly."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "raises"
               and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "InvariantError"
               for n in ast.walk(test))


def revert_tests(test_dir: Path) -> dict[str, list[str]]:
    """fix name -> the tests (module::function) under `test_dir` that revert it and require an InvariantError."""
    found: dict[str, list[str]] = {}
    for path in sorted(test_dir.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and _expects_invariant_error(node):
                for name in _reverted_names(node):
                    found.setdefault(name, []).append(f"{path.name}::{node.name}")
    return found


def test_every_fix_has_a_revert_test():
    """Found by reading the test modules: each registered fix is reverted (SPRUCE_REVERT_FIXES or Limits'
    reverted_fixes) by a test that requires an InvariantError, and every name a test reverts is registered."""
    found = revert_tests(TESTS)
    assert sorted(set(FIXES) - found.keys()) == [], f"fixes without a revert test; found: {found}"
    assert sorted(found.keys() - set(FIXES)) == []


def test_a_fix_without_a_revert_test_is_found(tmp_path):
    """The discovery itself: a registered name no test reverts is missing; a revert without pytest.raises does not
    count; setenv of the variable and a reverted_fixes keyword both do."""
    (tmp_path / "test_x.py").write_text(
        "def test_a(monkeypatch):\n"
        "    monkeypatch.setenv(ENV_VAR, 'fix_a')\n"
        "    with pytest.raises(InvariantError):\n"
        "        run()\n"
        "def test_b():\n"
        "    with pytest.raises(InvariantError):\n"
        "        Limits(reverted_fixes=frozenset({'fix_b'} if x else ()))\n"
        "def test_c(monkeypatch):\n"
        "    monkeypatch.setenv(ENV_VAR, 'fix_c')\n"
        "    run()\n")
    assert revert_tests(tmp_path) == {"fix_a": ["test_x.py::test_a"], "fix_b": ["test_x.py::test_b"]}


def test_unknown_fix_name_is_refused(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "no_such_fix")
    with pytest.raises(ConfigError, match="no_such_fix"):
        reverted_fixes_from_env()


def test_fixed_config_runs(draft):
    llm = spec_llm(draft, page_size=1, speculative_num_steps=5, speculative_eagle_topk=8,
                   speculative_num_draft_tokens=8)
    assert len(llm.generate("def f(x):", SamplingParams(max_tokens=12))[0].token_ids) == 12


def test_reverted_draft_scratch_width_fails_loudly(draft, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "draft_scratch_width")
    llm = spec_llm(draft, page_size=16, speculative_num_steps=5, speculative_eagle_topk=8,
                   speculative_num_draft_tokens=8)  # K*S = 40 entries needed, sized N = 8
    with pytest.raises(InvariantError, match=r"exceed scratch width 8 \(N=8, K=8, S=5"):
        llm.generate("def f(x):", SamplingParams(max_tokens=12))


@pytest.mark.parametrize("page_size", [64, 4])
def test_mla_target_reverted_draft_scratch_width_fails_loudly(mla_draft, monkeypatch, page_size):
    """FlashInfer-MLA's class (draft index space sized without the topk factor) on an MLA target, page 64 and
    4 with topk 8: the fixed engine runs, the reverted one stops at the scratch-width invariant."""
    kw = dict(page_size=page_size, speculative_num_steps=5, speculative_eagle_topk=8, speculative_num_draft_tokens=8)
    fixed = spec_llm(mla_draft, MLA_TARGET, **kw)
    assert len(fixed.generate("def f(x):", SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids) == 12
    monkeypatch.setenv(ENV_VAR, "draft_scratch_width")
    with pytest.raises(InvariantError, match=r"exceed scratch width 8 \(N=8, K=8, S=5"):
        spec_llm(mla_draft, MLA_TARGET, **kw).generate("def f(x):", SamplingParams(max_tokens=12))


def test_mla_target_reverted_draft_extend_stride_fails_loudly(mla_draft, monkeypatch):
    """TRT-LLM-MLA's class (draft extend laid out with one stride and read with another) on an MLA target."""
    monkeypatch.setenv(ENV_VAR, "draft_extend_stride")
    llm = spec_llm(mla_draft, MLA_TARGET, page_size=16, speculative_num_steps=3, speculative_eagle_topk=4,
                   speculative_num_draft_tokens=8)
    with pytest.raises(InvariantError, match=r"draft_extend: token stride 4 != the Limits stride 8"):
        llm.generate("def f(x):", SamplingParams(max_tokens=12))


def test_reverted_spec_page_lookahead_fails_loudly(draft, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "spec_page_lookahead")
    llm = spec_llm(draft, page_size=1, speculative_num_steps=5, speculative_eagle_topk=4,
                   speculative_num_draft_tokens=8)
    with pytest.raises(InvariantError, match="decode step of row .* pages x page_size 1"):
        llm.generate("def f(x):", SamplingParams(max_tokens=12))


def test_reverted_graph_bucket_rule_fails_loudly():
    kw = dict(max_running_requests=12, page_size=4, context_length=64, num_pages=40, chunked_prefill_size=64,
              graph_max_bs=8)
    fixed, reverted = Limits(**kw), Limits(**kw, reverted_fixes=frozenset({"graph_bucket_holds_batch"}))
    assert fixed.bucket_for(12) is None  # above the largest bucket: eager
    graphs = BucketGraphs(reverted, torch.device("cpu"), enabled=False)
    graphs.enabled = True  # the rule is host-side: no GPU needed to check it
    with pytest.raises(InvariantError, match="batch of 12 requests would replay the graph captured for 8"):
        graphs.run("decode", lambda p, kv: None, 12, 10)


class _Output:
    """A phase output as BucketGraphs sees it: the rows it was made for."""

    def __init__(self, rows: int):
        self.batch_rows = rows


@pytest.mark.parametrize("reverted", [False, True])
def test_eager_phase_reads_eager_outputs(reverted):
    """SGLang #22832's class: a batch above the largest bucket runs eagerly; its extend must read the eager
    verify output, not the largest graph's static buffers. The rule is host-side: checked without a GPU."""
    kw = dict(max_running_requests=12, page_size=4, context_length=64, num_pages=40, chunked_prefill_size=64,
              graph_max_bs=8, reverted_fixes=frozenset({"eager_reads_eager_outputs"} if reverted else ()))
    graphs = BucketGraphs(Limits(**kw), torch.device("cpu"), enabled=False)
    graphs.enabled = True
    graphs.graphs[("verify", 8)] = (None, _Output(8))  # what a capture of bucket 8 leaves behind
    graphs.predecessor["extend"] = "verify"
    seen = []
    eager_verify = _Output(12)
    if reverted:
        with pytest.raises(InvariantError, match="batch of 12 requests .eager. would read its predecessor's output "
                                                 "made for 8 rows"):
            graphs.run("extend", lambda p, kv, prev: seen.append(prev), 12, 10, eager_verify)
    else:
        graphs.run("extend", lambda p, kv, prev: seen.append(prev), 12, 10, eager_verify)
        assert seen == [eager_verify]
