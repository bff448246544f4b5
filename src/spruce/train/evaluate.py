"""Acceptance of a draft head, measured with spruce itself: greedy generation with speculation on.

Mean accept length = tokens committed per verify round (accepted drafts + the bonus token), summed over the
outputs' spec_stats; per-depth rates say how often the draft at depth d was accepted.
"""

from __future__ import annotations

import time


def chain_and_tree(steps: int) -> list[tuple[int, int, int]]:
    """(K, S, N) configs for a quick estimate: a chain (K=1, N=S+1) and a K=4 tree of up to 16 tokens."""
    return [(1, steps, steps + 1), (4, steps, min(16, 1 + 4 + (steps - 1) * 16))]


def acceptance(target: str, draft: str, prompts: list[list[int]], configs: list[tuple[int, int, int]],
               device: str, dtype: str, max_tokens: int = 64, max_running_requests: int = 16,
               algorithm: str = "EAGLE3") -> dict:
    """{"K=k,S=s,N=n": {mean_accept_length, accept_rate_per_depth, rounds, committed_tokens, seconds}}, greedy.

    prompts are token ids; `algorithm` is the engine's speculative_algorithm for `draft` (EAGLE3 for an EAGLE-3
    head, NEXTN for a directory of MTP layers); every config loads a fresh engine (its own CUDA graphs on GPU)."""
    from spruce import LLM, SamplingParams

    result = {}
    for k, s, n in configs:
        llm = LLM(target, device=device, dtype=dtype, draft_model=draft, speculative_algorithm=algorithm,
                  speculative_num_steps=s, speculative_eagle_topk=k, speculative_num_draft_tokens=n,
                  max_running_requests=max(1, min(max_running_requests, len(prompts))))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        seconds = time.perf_counter() - t0
        rounds = sum(o.spec_stats["rounds"] for o in outs)
        committed = sum(o.spec_stats["committed_tokens"] for o in outs)
        per_depth = [0.0] * s
        for o in outs:
            for d, rate in enumerate(o.spec_stats["accept_rate_per_depth"]):
                per_depth[d] += rate * o.spec_stats["rounds"]
        result[f"K={k},S={s},N={n}"] = {
            "mean_accept_length": round(committed / rounds, 4) if rounds else 0.0,
            "accept_rate_per_depth": [round(v / rounds, 4) if rounds else 0.0 for v in per_depth],
            "rounds": rounds, "committed_tokens": committed, "seconds": round(seconds, 2),
        }
        del llm
    return result
