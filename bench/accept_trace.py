"""The acceptance a speculative round would have at every position of a workload's requests (issue 16: adaptive
speculation's per-request choices, replayed offline by bench/replay_adaptive.py).

For each prompt (the serving benchmark's: `load_prompts` over a {"text"} JSONL, cut to --prompt-tokens), the
target's greedy output of --max-tokens tokens, then for every output position p the accept length of the first
(S, K, N) round after committing output[:p + 1]: the prompt plus output[:p] prefilled (its sampled token is
output[p]), one round. Greedy acceptance at a position depends only on the text before it, and the first round
after a prefill equals a caught-up draft's (tests/test_adaptive.py), so these are the accept lengths rounds get
wherever an engine runs them. Runs on the CPU (pycode-19m: ~5 min for 53 prompts x 127 positions).

Usage (repo root): python bench/accept_trace.py --model DIR --draft DIR [--out-dir bench/results] [--prompts FILE]
    [--prompt-tokens 128] [--max-tokens 128] [--spec 5,4,8] [--num-prompts N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spruce import LLM, SamplingParams
from spruce.bench.common import write_result
from spruce.bench.serving import _load_tokenizer, load_prompts
from spruce.runtime import request as request_mod

BATCH = 64


def first_rounds(engine, jobs: list[list[int]], width: int) -> list[int]:
    """The accept length of the first round of each job (prompt ids), `width` = S + 2 tokens generated each."""
    first: dict[int, int] = {}
    add_round = request_mod.SpecStats.add_round

    def recording(stats, accepted, num_steps):
        first.setdefault(id(stats), accepted)
        add_round(stats, accepted, num_steps)

    request_mod.SpecStats.add_round = recording
    out = []
    try:
        for start in range(0, len(jobs), BATCH):
            rids = [engine.add_request(ids, SamplingParams(max_tokens=width, temperature=0, ignore_eos=True))
                    for ids in jobs[start:start + BATCH]]
            stats = [engine.requests[rid].spec for rid in rids]  # alive until read: their ids stay theirs
            while engine.has_unfinished():
                engine.step(finished_only=True)
            out += [first[id(s)] for s in stats]
            first.clear()
    finally:
        request_mod.SpecStats.add_round = add_round
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", default=None, help="default: the model dir's heldout_prompts.jsonl")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--spec", default="5,4,8", help="S,K,N")
    parser.add_argument("--num-prompts", type=int, default=None)
    args = parser.parse_args()
    s, k, n = map(int, args.spec.split(","))
    prompts = load_prompts(Path(args.prompts or Path(args.model) / "heldout_prompts.jsonl"), args.prompt_tokens,
                           _load_tokenizer([args.model]))[:args.num_prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outputs = [o.token_ids for o in LLM(model=args.model, device="cpu", max_running_requests=BATCH).generate(
        prompts, params)]
    llm = LLM(model=args.model, device="cpu", draft_model=args.draft, speculative_algorithm="EAGLE3",
              speculative_num_steps=s, speculative_eagle_topk=k, speculative_num_draft_tokens=n,
              max_running_requests=BATCH, disable_radix_cache=True)
    jobs = [list(prompt) + out[:p] for prompt, out in zip(prompts, outputs) for p in range(args.max_tokens - 1)]
    flat = first_rounds(llm.engine, jobs, s + 2)
    accept = [flat[i * (args.max_tokens - 1):(i + 1) * (args.max_tokens - 1)] for i in range(len(prompts))]
    path = write_result("accept-trace", "cpu", {k: str(v) for k, v in vars(args).items()},
                        {"prompts": [list(p) for p in prompts], "outputs": outputs, "accept": accept}, args.out_dir)
    print(f"{len(prompts)} requests x {args.max_tokens - 1} positions: {path}")

if __name__ == "__main__":
    main()
