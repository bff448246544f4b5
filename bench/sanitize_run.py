"""A short speculative run with CUDA graphs, for `compute-sanitizer --tool memcheck` (the seed configs).

Usage: python bench/sanitize_run.py MODEL [DRAFT | NEXTN] (env SANITIZE_BACKEND: the attention backend, default
the CUDA default). With a trained DRAFT the rounds accept several tokens,
so commits of accepted paths run too (a random head accepts almost nothing); NEXTN drafts with the model's own
MTP layers. With an EAGLE-3 draft an adaptive engine follows, its policy forced to alternate plain steps and rounds: its
plain steps write the aux layers' features into the feature ring from the add-norm kernels (`StreamSink`), its rounds
catch the draft up from them. Greedy and sampled requests share
each batch, so both the in-graph greedy acceptance and the eager sampled acceptance run. Overlap scheduling is
on (the default), so every step is queued behind the one still running; a plain-decoding run follows.
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from checkpoints import write_eagle3_checkpoint  # noqa: E402
from spruce import LLM, SamplingParams  # noqa: E402

model = sys.argv[1]
backend = os.environ.get("SANITIZE_BACKEND")
prompts = ["def fib(n):", "import os\n", "class A:", "x = ["]
params = [SamplingParams(max_tokens=48, temperature=0.0), SamplingParams(max_tokens=48, temperature=0.0),
          SamplingParams(max_tokens=48, temperature=0.8, seed=1), SamplingParams(max_tokens=48, temperature=0.8, seed=2)]


def serve(label: str, describe=lambda llm, prepared: "", prepare=lambda llm: None, **kw) -> None:
    """An engine on the device (bf16, CUDA graphs, 4 rows, `kw`): `prepare(llm)`, the prompts generated, a line with
    `label`, each prompt's tokens and `describe(llm, prepared)`, then its page accounting checked."""
    llm = LLM(model, device="cuda", dtype="bfloat16", max_running_requests=4, cuda_graph=True,
              attention_backend=backend, **kw)
    prepared = prepare(llm)
    outs = llm.generate(prompts, params)
    print(f"{label}: {[len(o.token_ids) for o in outs]} tokens{describe(llm, prepared)}")
    llm.engine.check_no_leaks()


def accept_lengths(llm, _) -> str:
    stats = llm.engine.stats()["spec"]
    return f", mean accept length {stats['mean_accept_length']:.2f} over {stats['rounds']} rounds"


def switches(llm, choices) -> str:
    plain = choices.count("plain")
    return (f", {plain} plain steps and {len(choices) - plain} rounds chosen, "
            f"{llm.engine.stats()['adaptive']['catch_ups']} catch-ups")


with tempfile.TemporaryDirectory() as tmp:
    arg = sys.argv[2] if len(sys.argv) > 2 else None
    nextn = arg == "NEXTN"
    draft = None if nextn else arg or str(write_eagle3_checkpoint(Path(tmp) / "d", model, seed=3))
    for page, k, s, n in [(64, 8, 5, 32), (4, 8, 5, 32)]:
        serve(f"page={page} topk={k}", accept_lengths, page_size=page, draft_model=draft,
              speculative_algorithm="NEXTN" if nextn else None, speculative_num_steps=s, speculative_eagle_topk=k,
              speculative_num_draft_tokens=n)
    if not nextn:
        from test_adaptive import force  # the tests' override of the policy's choice

        serve("adaptive page=16", switches, lambda llm: force(llm, [0, 0, 1, 0, 1, 1, 0]), page_size=16,
              draft_model=draft, speculative_adaptive=True, speculative_num_steps=5, speculative_eagle_topk=4,
              speculative_num_draft_tokens=8)
    serve("plain page=4", page_size=4)
