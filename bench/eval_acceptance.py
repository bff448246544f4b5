"""Mean accepted length of a draft head on the fixture's held-out prompts (greedy), chains and trees.

Usage: eval_acceptance.py TARGET DRAFT HELDOUT.jsonl OUT.json [K,S,N ...]   (default: 1,5,6 4,5,16 8,6,32)
Prompts: the first 32 held-out texts (EVAL_PROMPTS), cut to 192 tokens; 128 new tokens each; spruce on cuda
in bf16 (cpu in float32 where there is no GPU).
"""

import json
import os
import sys
import time

import torch

from spruce.models.hf_config import ModelConfig
from spruce.models.tokenizer import Tokenizer
from spruce.train.evaluate import acceptance

PROMPTS, PROMPT_TOKENS, MAX_TOKENS = int(os.environ.get("EVAL_PROMPTS", 32)), 192, 128


def main() -> None:
    target, draft, heldout, out = sys.argv[1:5]
    configs = [tuple(int(x) for x in c.split(",")) for c in (sys.argv[5:] or ["1,5,6", "4,5,16", "8,6,32"])]
    tok = Tokenizer.from_dir(target, ModelConfig.from_dir(target))
    texts = [json.loads(line)["text"] for line in open(heldout) if line.strip()]
    prompts = [tok.encode(t)[:PROMPT_TOKENS] for t in texts[:PROMPTS]]
    t0 = time.time()
    cuda = torch.cuda.is_available()
    results = acceptance(target, draft, prompts, configs, "cuda" if cuda else "cpu", "bfloat16" if cuda else "float32",
                         max_tokens=MAX_TOKENS)
    summary = {"target": target, "draft": draft, "prompts": len(prompts), "prompt_tokens": PROMPT_TOKENS,
               "max_tokens": MAX_TOKENS, "results": results, "seconds": round(time.time() - t0, 1)}
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
    for name, st in results.items():
        print(f"{target.rstrip('/').split('/')[-1]} {name}: mean accept length {st['mean_accept_length']:.3f}, "
              f"per depth {st['accept_rate_per_depth']}")


if __name__ == "__main__":
    main()
