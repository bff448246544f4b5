"""GPU-only, 2 GPUs: tensor parallelism over NCCL with the collectives captured inside CUDA graphs gives the
same tokens as one GPU, float32 (so that a different summation order cannot flip an argmax), greedy and seeded
sampling in one batch: pycode-19m plain and EAGLE-3 (its trained head in bench/assets, K=4, page 16), pycode-mla
NEXTN (MLA + MoE, K=4 tree).

Run on a 2-GPU device: `pytest -m gpu tests/test_gpu_tp.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spruce import LLM, SamplingParams

TRAINED_HEAD = Path(__file__).resolve().parents[1] / "bench" / "assets" / "pycode-19m-eagle3"

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
MAX_NEW = 48
PARAMS = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)] * 4 + [
    SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)] * 2


def prompts_of(model, n=4):
    import json

    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model, ModelConfig.from_dir(model))
    texts = [json.loads(line)["text"] for line in (model / "heldout_prompts.jsonl").read_text().splitlines()]
    ids = [tok.encode(t)[:24 + 9 * i] for i, t in enumerate(texts[:n])]
    return ids + ids[:2]


def outputs(model, tp_size, **kw):
    llm = LLM(str(model), device="cuda", dtype="float32", attention_backend="triton", page_size=16,
              max_running_requests=8, cuda_graph=True, tp_size=tp_size, **kw)
    try:
        assert llm.engine.runner.graphs.enabled
        outs = llm.generate(prompts_of(model), PARAMS)
        llm.engine.check_no_leaks()
        return [o.token_ids for o in outs], [o.spec_stats for o in outs]
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


@pytest.mark.parametrize("case", ["llama-plain", "llama-eagle3", "mla-nextn"])
def test_tp2_equals_tp1_under_cuda_graphs(case, request):
    if case == "mla-nextn":
        model, kw = request.getfixturevalue("pycodemla"), dict(speculative_algorithm="NEXTN", speculative_num_steps=3,
                                    speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    elif case == "llama-eagle3":
        model, kw = request.getfixturevalue("pycode19m"), dict(draft_model=str(TRAINED_HEAD), speculative_algorithm="EAGLE3",
                                    speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    else:
        model, kw = request.getfixturevalue("pycode19m"), {}
    want, want_stats = outputs(model, 1, **kw)
    got, got_stats = outputs(model, 2, **kw)
    assert got == want
    assert got_stats == want_stats
    if kw:
        assert min(s["mean_accept_length"] for s in got_stats[:4]) > 1.5  # the trained drafts are accepted
