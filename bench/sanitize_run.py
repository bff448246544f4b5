"""A short speculative run with CUDA graphs, for `compute-sanitizer --tool memcheck` (the seed configs)."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from checkpoints import write_eagle3_checkpoint  # noqa: E402
from spruce import LLM, SamplingParams  # noqa: E402

model = sys.argv[1]
with tempfile.TemporaryDirectory() as tmp:
    draft = str(write_eagle3_checkpoint(Path(tmp) / "d", model, seed=3))
    for page, k, s, n in [(64, 8, 5, 32), (4, 8, 5, 32)]:
        llm = LLM(model, device="cuda", dtype="bfloat16", page_size=page, max_running_requests=4,
                  draft_model=draft, speculative_num_steps=s, speculative_eagle_topk=k,
                  speculative_num_draft_tokens=n, cuda_graph=True)
        outs = llm.generate(["def fib(n):", "import os\n", "class A:", "x = ["], SamplingParams(max_tokens=24))
        print(f"page={page} topk={k}: {[len(o.token_ids) for o in outs]} tokens, spec {llm.engine.stats()['spec']}")
        llm.engine.check_no_leaks()
        del llm
