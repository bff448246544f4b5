"""GPU smoke for logprobs (CUDA pack + pinned read-back path) and the prefix cache: speculative == plain
logprobs on the bundled model with its trained head, bf16 tolerance; cached run == uncached run."""

import sys

from spruce import LLM, SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path

prompts = ["def fib(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n", "for i in range(10):"] * 2
params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=3)
common = dict(device="cuda", dtype="float32", page_size=16, max_running_requests=8)
plain = LLM(builtin_model_path(), disable_radix_cache=True, **common).generate(prompts, params)
spec_llm = LLM(builtin_model_path(), draft_model=str(builtin_draft_path()), speculative_num_steps=4,
               speculative_eagle_topk=4, speculative_num_draft_tokens=12, **common)
spec = spec_llm.generate(prompts, params)
worst = 0.0
for a, b in zip(plain, spec):
    assert a.token_ids == b.token_ids, "tokens differ"
    for la, lb in zip(a.logprobs, b.logprobs):
        assert list(la) == list(lb), "top-n ids differ"
        worst = max(worst, max(abs(la[t].logprob - lb[t].logprob) for t in la))
print(f"logprobs spec vs plain on cuda: max abs diff {worst:.2e}, accept {spec_llm.engine.stats()['spec']['mean_accept_length']:.2f}, "
      f"cached tokens {[o.num_cached_tokens for o in spec]}")
sys.exit(0 if worst < 1e-3 else 1)
