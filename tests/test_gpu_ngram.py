"""NGRAM speculation on the GPU: its draft phase (context gather through the page table, matching, the trie) and its
commit replay as CUDA graphs beside the verify graph; greedy output equals plain decoding (float32, so that a
different kv split cannot flip an argmax) for a chain and a tree, page sizes 1 and 16, batches padded up to their
graph bucket, with overlap; prompt-copying prompts accept more than 1.5 tokens per round."""

from __future__ import annotations

import pytest
import torch

from spruce import LLM, SamplingParams
from spruce.config import builtin_model_path
from test_ngram import PROMPTS

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", dtype="float32", attention_backend="triton", max_running_requests=8)
PARAMS = SamplingParams(max_tokens=48, ignore_eos=True)


def tokens_and_stats(llm: LLM, prompts: list[str]):
    outs = llm.generate(prompts, PARAMS)
    llm.engine.check_no_leaks()
    return [o.token_ids for o in outs], [o.spec_stats for o in outs]


@pytest.mark.parametrize("page,topk", [(1, 1), (16, 3)])
def test_graphs_equal_plain(page, topk):
    prompts = PROMPTS * 2  # 6 requests: a batch padded up to the bucket of 8
    plain, _ = tokens_and_stats(LLM(builtin_model_path(), page_size=page, **ENGINE), prompts)
    torch.cuda.empty_cache()
    llm = LLM(builtin_model_path(), page_size=page, speculative_algorithm="NGRAM", speculative_num_steps=4,
              speculative_eagle_topk=topk, speculative_prompt_lookup_min=1, speculative_prompt_lookup_max=3, **ENGINE)
    assert llm.engine.runner.graphs.enabled and llm.engine.runner.graphs.captured("draft", 8)
    got, stats = tokens_and_stats(llm, prompts)
    assert got == plain
    rounds = sum(s["rounds"] for s in stats)
    assert sum(s["committed_tokens"] for s in stats) / rounds > 1.5
