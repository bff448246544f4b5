"""Tensor parallelism on the CPU (gloo, 2 processes: this one and one spawned worker): tp_size=2 gives the
same tokens as tp_size=1 in float32, greedy and seeded sampling in one batch, for plain decoding and EAGLE-3
tree speculation (K=4, page 16; an oracle on every rank so every accept length runs) on pycode-19m (Llama)
and for plain decoding and NEXTN (its own MTP layer) on pycode-mla (MLA + MoE). A worker that fails takes
the driver down with its error, and ranks that diverge are caught by the always-on state check.

Each tp_size=2 engine costs a process start (kept to one per configuration, few short prompts)."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest

from spruce import LLM, SamplingParams
from spruce.config import EngineConfig, make_speculative_config
from spruce.distributed.launch import create_engine
from spruce.errors import ConfigError, InvariantError, WorkerFailedError
from checkpoints import write_eagle3_checkpoint
import tp_hooks

MAX_NEW = 20
PROMPT_TOKENS = [14, 22, 9]
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_p=0.95, seed=11)


def prompts_of(model: Path) -> list[list[int]]:
    """Held-out prompts cut to PROMPT_TOKENS tokens."""
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model, ModelConfig.from_dir(model))
    texts = [json.loads(line)["text"] for line in (model / "heldout_prompts.jsonl").read_text().splitlines()]
    return [tok.encode(t)[:n] for t, n in zip(texts, PROMPT_TOKENS)]


def jobs(prompts):
    """Every prompt greedy, and the first two sampled with a seed too: one mixed batch."""
    return prompts + prompts[:2], [GREEDY] * len(prompts) + [SEEDED] * 2


def run(llm, prompts, params) -> tuple[list[list[int]], list[dict]]:
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [o.spec_stats for o in outs]


def run_tp2(config: EngineConfig, prompts, params, rank_setup=None):
    llm = LLM.from_engine(create_engine(config, rank_setup))
    try:
        result = run(llm, prompts, params)
        llm.engine.check_no_leaks()
        return result
    finally:
        llm.shutdown()


def config(model, tp_size=1, **kw) -> EngineConfig:
    return EngineConfig(model=str(model), page_size=16, max_running_requests=4, tp_size=tp_size, **kw)


def spec(algorithm, draft, model, s, k, n):
    return make_speculative_config(algorithm, None if draft is None else str(draft), s, k, n, model=str(model))


def test_llama_plain_tp2_equals_tp1(pycode19m):
    prompts, params = jobs(prompts_of(pycode19m))
    want, _ = run(LLM.from_engine(create_engine(config(pycode19m))), prompts, params)
    got, _ = run_tp2(config(pycode19m, tp_size=2), prompts, params)
    assert got == want
    assert got[0] != got[len(PROMPT_TOKENS)]  # the seeded run sampled (not the greedy text)


def test_llama_eagle3_tree_tp2_equals_tp1(pycode19m, tmp_path):
    """EAGLE-3, K=4 S=3 N=8, page 16: same tokens and same accept lengths, request by request."""
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", pycode19m, seed=3)  # every token draftable
    base = prompts_of(pycode19m)
    reference = run(LLM(str(pycode19m), page_size=16, max_running_requests=4), base, GREEDY)[0]
    setup = functools.partial(tp_hooks.install_oracle, fraction=0.8, references=list(zip(base, reference)))
    prompts, params = jobs(base)
    cfg = dict(speculative=spec("EAGLE3", draft, pycode19m, 3, 4, 8))
    want, want_stats = run(LLM.from_engine(create_engine(config(pycode19m, **cfg), setup)), prompts, params)
    got, got_stats = run_tp2(config(pycode19m, tp_size=2, **cfg), prompts, params, setup)
    assert got == want
    assert got[:len(base)] == reference
    assert got_stats == want_stats
    assert min(s["mean_accept_length"] for s in got_stats[:len(base)]) > 1.5  # the oracle steers greedy rows


@pytest.mark.parametrize("algorithm", [None, "NEXTN"])
def test_deepseek_mla_moe_tp2_equals_tp1(pycodemla, algorithm):
    """pycode-mla (MLA heads split, latent replicated; MoE experts cut by intermediate), plain and NEXTN."""
    prompts, params = jobs(prompts_of(pycodemla))
    cfg = {} if algorithm is None else dict(speculative=spec("NEXTN", None, pycodemla, 3, 1, 4))
    want, want_stats = run(LLM.from_engine(create_engine(config(pycodemla, **cfg))), prompts, params)
    got, got_stats = run_tp2(config(pycodemla, tp_size=2, **cfg), prompts, params)
    assert got == want
    assert got_stats == want_stats


def test_worker_failure_raises_naming_the_worker(pycode19m):
    """A worker failing mid-generation: the driver's call raises WorkerFailedError with the worker's error,
    promptly, and the engine refuses further calls."""
    llm = LLM.from_engine(create_engine(config(pycode19m, tp_size=2),
                                        functools.partial(tp_hooks.fail_at_step, victim=1, step=3)))
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"rank 1 .*exited with code 1: RuntimeError: injected failure"):
            llm.generate(prompts_of(pycode19m), GREEDY)
        assert time.monotonic() - t0 < 60
        with pytest.raises(WorkerFailedError, match="rank 1"):
            llm.generate([[5, 6, 7]], GREEDY)
    finally:
        llm.shutdown()


def test_diverging_ranks_are_caught(pycode19m):
    """A rank whose tokens differ (its logits skewed): the next call fails with the ranks' digests."""
    llm = LLM.from_engine(create_engine(config(pycode19m, tp_size=2),
                                        functools.partial(tp_hooks.skew_logits, victim=1, token=77)))
    try:
        with pytest.raises(InvariantError, match="tensor-parallel ranks diverged .*rank 0: .*rank 1: "):
            llm.generate(prompts_of(pycode19m)[:1], GREEDY)
    finally:
        llm.shutdown()


def test_tp_size_must_divide_the_heads(pycode19m):
    """pycode-19m has 6 heads and 2 KV heads: tp_size=4 is refused, naming the field."""
    with pytest.raises(ConfigError, match=r"tp_size=4 does not divide num_attention_heads=6, num_key_value_heads=2"):
        run_tp2(config(pycode19m, tp_size=4), [[1, 2]], GREEDY)


@pytest.mark.parametrize("kw, match", [
    (dict(tp_size=0), "tp_size must be an integer >= 1, got 0"),
    (dict(tp_size=2.0), "tp_size must be an integer >= 1"),
])
def test_bad_tp_size(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model="m", **kw)
