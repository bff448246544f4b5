"""Logit processors with speculation (#16): logit_bias, min_tokens, min_p act on the target's logits at every
tree node exactly as plain decoding applies them at that position, so greedy output is token-for-token the
same, and sampled output the same distribution (a lossy variant is detected)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from spruce import SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.errors import InvalidRequestError
from spruce.runtime.sampler import SamplingTensors, process_logits, select_tokens, target_probs
from oracle_draft import install_oracle
from stats import matches_distribution

PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n", "for i in range(10):"]


def engines(make_llm, k, page, max_running_requests: int = 4):
    """A plain and a speculative engine on the bundled model; the distribution tests run their identical samples
    64 at a time (the check is the same, in a third of the steps)."""
    plain = make_llm(builtin_model_path(), page_size=page, max_running_requests=4)
    spec = make_llm(builtin_model_path(), page_size=page, max_running_requests=max_running_requests,
                    draft_model=str(builtin_draft_path()), speculative_num_steps=4, speculative_eagle_topk=k,
                    speculative_num_draft_tokens=4 * k if k > 1 else 5)
    return plain, spec


@pytest.mark.parametrize("k,page", [(1, 1), (4, 16)])
def test_greedy_processors_spec_equals_plain(make_llm, k, page):
    if not builtin_draft_path().exists():
        pytest.skip("bundled draft head absent")
    plain, spec = engines(make_llm, k, page)
    tok = plain.tokenizer
    newline = tok.encode("\n")[-1]
    eos = plain.engine.eos_token_ids[0] if plain.engine.eos_token_ids else 1
    cases = [
        SamplingParams(max_tokens=20, logit_bias={newline: -100.0}),  # no newline may be chosen
        SamplingParams(max_tokens=20, logit_bias={newline: 8.0, tok.encode(" ")[-1]: 3.0}),
        SamplingParams(max_tokens=24, min_tokens=20, stop_token_ids=[newline]),  # newline masked for 20 tokens
        SamplingParams(max_tokens=20, min_p=0.3),  # greedy: min_p never changes the argmax
    ]
    for params in cases:
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
        got = spec.generate(PROMPTS, params)
        assert [o.token_ids for o in got] == want, params
    banned = plain.generate(PROMPTS, cases[0])
    assert all(newline not in o.token_ids for o in banned)
    held = plain.generate(PROMPTS, cases[2])
    assert all(newline not in o.token_ids[:20] for o in held) and eos is not None


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(3, 8)
    logits[:, 5] = 10.0  # token 5 (a stop token) wins unless masked
    st = SamplingTensors.build([SamplingParams(max_tokens=8, min_tokens=3)] * 3, [0] * 3, 8, "cpu", 1,
                               [10] * 3, [frozenset({5})] * 3)
    out = process_logits(logits, st, torch.tensor([11, 12, 13]))  # generated index 1, 2, 3
    assert out[0, 5] == float("-inf") and out[1, 5] == float("-inf") and out[2, 5] == 10.0


def test_min_p_distribution():
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0, -3.0]])
    st = SamplingTensors.build([SamplingParams(temperature=1.0, min_p=0.2)], [0], 5, "cpu")
    probs = target_probs(logits, st)[0]
    full = logits[0].softmax(-1)
    keep = full >= 0.2 * full.max()
    assert torch.allclose(probs, torch.where(keep, full, 0.0) / full[keep].sum())


def test_bad_values_refused():
    for kw, field in [(dict(min_p=1.5), "min_p"), (dict(logit_bias={3: 200.0}), "logit_bias"),
                      (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(min_tokens=20, max_tokens=4), "min_tokens"),
                      (dict(logit_bias={"x": 1.0}), "logit_bias")]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw)
        assert e.value.field == field


N = 800


@pytest.mark.parametrize("lossy", [False, True])
def test_sampled_processors_keep_the_distribution(make_llm, lossy, monkeypatch):
    """Two sampled tokens with logit_bias + min_p + top_k: spec (oracle draft accepting often) samples the
    exact distribution computed from the target's processed logits; a verifier that ignores the processors
    (plain target probabilities) is detected."""
    if not builtin_draft_path().exists():
        pytest.skip("bundled draft head absent")
    import spruce.speculative.eagle_worker as ew

    plain, spec = engines(make_llm, 2, 4, max_running_requests=64)
    prompt = plain.tokenizer.encode(PROMPTS[0])
    boosted = [plain.tokenizer.encode(w)[-1] for w in (" pass", " return")]  # the bias reshapes both positions
    params = SamplingParams(max_tokens=2, temperature=1.0, top_k=6, min_p=0.25, ignore_eos=True,
                            logit_bias={t: 2.0 for t in boosted})  # lossy vs exact: total variation ~0.18
    st = SamplingTensors.build([params], [0], plain.engine.vocab_size, "cpu", 1, [len(prompt)], [frozenset()])

    def dist(ids):
        logits = plain.engine.next_token_logits(ids, first=len(ids) - 1)
        probs = target_probs(process_logits(logits, st, torch.tensor([len(ids)])), st)[0]
        return {int(t): float(p) for t, p in enumerate(probs.tolist()) if p > 0}

    exact = {(a, b): pa * pb for a, pa in dist(prompt).items() for b, pb in dist(prompt + [a]).items()}
    if lossy:
        def unprocessed(logits, st_, positions, history=None):
            plain_st = SamplingTensors(st_.temperature, st_.top_p, st_.top_k, st_.seeds, False)
            return select_tokens(logits, plain_st, positions)

        monkeypatch.setattr(ew, "select_tokens", unprocessed)
    greedy = plain.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    install_oracle(spec, 0.7).add_reference(prompt, greedy)
    outs = spec.generate([prompt] * (N if not lossy else 300), params)
    counts = Counter(tuple(o.token_ids) for o in outs)
    cells = sorted(set(exact) | set(counts))
    ok = matches_distribution([counts.get(c, 0) for c in cells], [exact.get(c, 0.0) for c in cells])
    assert ok is (not lossy)
