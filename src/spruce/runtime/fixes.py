"""Fix toggles (DESIGN §5): named fixes for the bug classes that hit tree drafting + paged KV + graphs.

Each fix is on by default. `SPRUCE_REVERT_FIXES=name[,name...]` reverts one for A/B debugging; the engine
reads it once at construction into its frozen `Limits`. Every fix has a test showing that, reverted, an
always-on invariant fails loudly instead of corrupting memory.
"""

from __future__ import annotations

import os

from spruce.errors import ConfigError

FIXES: dict[str, str] = {
    "draft_scratch_width": (
        "the draft scratch holds K*S entries per request (draft step j writes entries (j-1)*K .. j*K-1); "
        "reverted, it is sized like the verify scratch (N entries), as when two code paths size one buffer"
    ),
    "draft_extend_stride": (
        "the draft extend after verify lays out S+1 tokens per request (root + accepted path, padded) in the "
        "eager path, at capture and at replay alike; reverted, the metadata buffers use the verify tree's width N "
        "while the round hands over S+1, the capture/replay stride mismatch of TRT-LLM's MLA draft extend"
    ),
    "spec_page_lookahead": (
        "a speculative round reserves pages for S+1 positions past the committed length (commit and draft "
        "extend write up to S+1 tokens); reverted, only one position is reserved, as for plain decode"
    ),
    "overlap_page_lookahead": (
        "under overlap scheduling the host reserves pages for two decode steps past a request's known committed "
        "length (the in-flight step's commits are learned one step late); reverted, only for the step being "
        "planned, as in the synchronous loop"
    ),
    "release_after_inflight": (
        "a finished or aborted request keeps its row and pages until every launched step that includes it has "
        "completed; reverted, they are freed when the finish is seen, while a step may still write them"
    ),
    "eager_reads_eager_outputs": (
        "a phase that runs eagerly (batch above the largest graph bucket) reads the eager output of the phase "
        "before; reverted, it reads the largest graph's static output buffers, as SGLang's multi-layer draft "
        "extend did after an eager decode (#22832)"
    ),
    "graph_bucket_holds_batch": (
        "a batch replays the smallest CUDA-graph bucket that holds it, or runs eagerly above the largest; "
        "reverted, a larger batch is clamped into the largest bucket, whose buffers are too small for it"
    ),
}

ENV_VAR = "SPRUCE_REVERT_FIXES"


def reverted_fixes_from_env() -> frozenset[str]:
    raw = os.environ.get(ENV_VAR, "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(names - FIXES.keys())
    if unknown:
        raise ConfigError(f"{ENV_VAR} names unknown fixes {unknown}; known fixes: {sorted(FIXES)}")
    return names
