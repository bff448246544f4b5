"""Mean accepted length of a draft head on the fixture's held-out prompts (greedy), chains and trees.
Usage: eval_acceptance.py TARGET DRAFT HELDOUT.jsonl OUT.json [K,S,N ...]"""

import json
import sys
import time

from spruce import LLM, SamplingParams
from spruce.models.hf_config import ModelConfig
from spruce.models.tokenizer import Tokenizer
from spruce.train.trainer import acceptance

target, draft, heldout, out = sys.argv[1:5]
configs = [tuple(int(x) for x in c.split(",")) for c in (sys.argv[5:] or ["1,5,6", "4,5,16", "8,6,32"])]
tok = Tokenizer.from_dir(target, ModelConfig.from_dir(target))
texts = [json.loads(line)["text"] for line in open(heldout) if line.strip()]
prompts = [tok.encode(t)[:192] for t in texts[:32]]
t0 = time.time()
res = acceptance(target, draft, prompts, [(k, s, n) for k, s, n in configs], "cuda", "bfloat16", max_tokens=128)
summary = {"target": target, "draft": draft, "prompts": len(prompts), "prompt_tokens": 192, "max_tokens": 128,
           "results": res, "seconds": round(time.time() - t0, 1)}
json.dump(summary, open(out, "w"), indent=2)
for name, st in res.items():
    print(name, "mean accept length", st["mean_accept_length"], "per depth", st["accept_rate_per_depth"])
