"""Shared fixtures. Every engine built through `make_llm` is leak-checked when its test ends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors only through its interpreter, which is chosen when a kernel is
    # defined: set it before any spruce module (and its @triton.jit kernels) is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"
# The fixture model: ../shared/models/pycode-19m beside the clone, or the directory SPRUCE_PYCODE_19M names.
# Without it its tests skip; tests/test_fresh_clone_*.py run the same tests on the bundled demo model.
PYCODE_19M = Path(os.environ.get("SPRUCE_PYCODE_19M", SHARED_MODELS / "pycode-19m"))
# The DeepSeek-V3-architecture fixture (MLA + MoE + one MTP layer): ../shared/models/pycode-mla or SPRUCE_PYCODE_MLA.
PYCODE_MLA = Path(os.environ.get("SPRUCE_PYCODE_MLA", SHARED_MODELS / "pycode-mla"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per xdist worker, and for the servers and tp workers its tests start: workers with two
    # threads each spin against each other (two of them ran the suite 4x slower on 2 cores)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    # files marked slow first, each file's tests in their order: the xdist workers (which take whole files, in this
    # order) then end with short files and finish together
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pycode19m() -> Path:
    if not (PYCODE_19M / "config.json").exists():
        pytest.skip(f"fixture model not found at {PYCODE_19M} (set SPRUCE_PYCODE_19M=DIR to run this test; "
                    f"its twin in tests/test_fresh_clone_*.py runs it on the bundled model)")
    return PYCODE_19M


@pytest.fixture(scope="session")
def pycodemla() -> Path:
    if not (PYCODE_MLA / "config.json").exists():
        pytest.skip(f"fixture model not found at {PYCODE_MLA} (set SPRUCE_PYCODE_MLA=DIR to run this test)")
    return PYCODE_MLA


@pytest.fixture(scope="session")
def heldout_prompts(pycode19m) -> list[str]:
    lines = (pycode19m / "heldout_prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines if line.strip()]


def hf_greedy(model_dir, texts: list[str], lengths: list[int], max_new: int) -> tuple[list, list]:
    """The oracle: (prompts as token ids, text i cut to lengths[i] tokens; transformers' float32 greedy
    continuation of each, max_new tokens, eos ignored)."""
    transformers = pytest.importorskip("transformers")
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir, ModelConfig.from_dir(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts, outputs = [], []
    for text, n in zip(texts, lengths):
        ids = tok.encode(text)[:n]
        with torch.no_grad():
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=None, pad_token_id=model.config.pad_token_id)
        prompts.append(ids)
        outputs.append(out[0, len(ids):].tolist())
    return prompts, outputs


def generate_joining(eng, prompts: list, params, first: int = 2, join_at: int = 2) -> dict[int, list[int]]:
    """Step an engine by hand: prompts[:first] start, the rest join at step `join_at` (mid-flight).
    Returns {prompt index: output token ids}."""
    ids = {eng.add_request(prompts[i], params): i for i in range(first)}
    done = {}
    for step in range(400):
        if step == join_at:
            ids.update({eng.add_request(prompts[i], params): i for i in range(first, len(prompts))})
        for out in eng.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        if not eng.has_unfinished() and step > join_at:
            break
    return done


def assert_no_leaks(llm) -> None:
    """Idle engine: every page is back in the allocator, every row free, accounting consistent."""
    eng = llm.engine if hasattr(llm, "engine") else llm
    eng.check_no_leaks()
    alloc = eng.runner.allocator
    assert not eng.has_unfinished(), "engine still has requests"
    cached = eng.scheduler.cached_pages
    assert alloc.num_used == cached, f"{alloc.num_used - cached} KV pages leaked ({cached} held by the prefix cache)"
    assert eng.runner.page_table.num_free_rows == eng.limits.max_running_requests, "request rows leaked"


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """Every test ends with the collector's permanent generation empty: the benchmarks freeze their heap before they
    time (spruce.server.heap.freeze_startup_objects), and a frozen engine's reference cycles would otherwise outlive
    its test."""
    yield
    import gc

    gc.unfreeze()


@pytest.fixture
def make_llm():
    """Factory for LLM(...) instances; each is leak-checked at teardown."""
    from spruce import LLM

    made = []

    def factory(*args, **kwargs):
        llm = LLM(*args, **kwargs)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        assert_no_leaks(llm)
