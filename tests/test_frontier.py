"""The draft step's frontier expansion: the Triton kernel equals the torch reference (CPU: interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import spruce.ops.fused as F  # noqa: E402
from spruce.speculative.frontier import expand_frontier, expand_frontier_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("write_roots", [False, True])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_expand_frontier_kernel_equals_reference(k, write_roots):
    g = torch.Generator().manual_seed(k)
    bs, vocab, m = 5, 50, 4 + 2 * k + 2 * k * k
    offset = k + 3
    p = torch.rand(bs * k, k, generator=g).sort(dim=-1, descending=True).values.to(DEVICE)  # [bs*K, K]
    ids = torch.randint(0, vocab, (bs * k, k), generator=g).to(DEVICE)
    to_target = (torch.arange(vocab) * 3 + 7).to(DEVICE)  # a draft vocabulary inside a larger target one
    f_tokens = torch.randint(0, 1000, (bs, k), generator=g).to(DEVICE)
    f_scores = torch.rand(bs, k, generator=g).to(DEVICE)
    f_cand = torch.randint(0, offset, (bs, k), generator=g).to(DEVICE)
    outs = []
    for fn, force in ((expand_frontier_reference, False), (expand_frontier, True)):
        bufs = (torch.full((bs, m), -5, dtype=torch.int64, device=DEVICE),
                torch.full((bs, m), -5.0, device=DEVICE), torch.full((bs, m), -5, dtype=torch.int64, device=DEVICE))
        F._FORCE_TRITON[0] = force
        try:
            fr = fn(p, ids, to_target, f_tokens, f_scores, f_cand, *bufs, offset=offset, write_roots=write_roots)
        finally:
            F._FORCE_TRITON[0] = False
        outs.append((bufs, fr))
    (ref_bufs, ref), (got_bufs, got) = outs
    for a, b in zip(ref_bufs, got_bufs):
        assert torch.equal(a, b)
    for name in ("tokens", "scores", "cand", "slot"):
        assert torch.equal(getattr(ref, name), getattr(got, name)), name
    assert torch.equal(ref_bufs[0][:, offset:offset + k * k], to_target[ids].view(bs, k * k))
    assert bool((ref_bufs[2][:, :k] == -5).all()) and bool((ref_bufs[0][:, :k] == (f_tokens if write_roots else -5)).all())
