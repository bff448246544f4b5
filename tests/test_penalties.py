"""Presence / frequency / repetition penalties with speculation (#16): every tree node counts the request's
generated tokens plus its own path, so greedy output is token-for-token plain decoding's, seeded sampling gives
plain decoding's tokens, and the sampled distribution is exact; a verifier that forgets the path is detected."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import spruce.speculative.eagle_worker as ew
from spruce import SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.errors import InvalidRequestError
from spruce.limits import Limits
from spruce.runtime.penalties import PenaltyParams, PenaltyState, TokenHistory, apply_penalties, node_paths
from spruce.runtime.sampler import SamplingTensors, process_logits, target_probs
from oracle_draft import install_oracle
from stats import matches_distribution
from test_logit_processors import PROMPTS, engines

pytestmark = pytest.mark.slow  # scheduled first (conftest)

needs_draft = pytest.mark.skipif(not builtin_draft_path().exists(), reason="bundled draft head absent")
GREEDY_CASES = [
    dict(frequency_penalty=2.0),  # repeats inside one round must be penalised on the node's own path
    dict(presence_penalty=1.0, frequency_penalty=0.5),
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=-1.0, repetition_penalty=0.7),  # negative: repeats encouraged
]


def vllm_reference(logits, counts, in_prompt, presence, frequency, repetition):
    """vLLM's apply_penalties, written as it reads: [n, V] logits, per-row counts [n, V] and prompt masks."""
    scale = torch.where(in_prompt | (counts > 0), repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - frequency[:, None] * counts.float()
    return logits - presence[:, None] * (counts > 0).float()


def plain_history(vocab: int, prompt: list[int], generated: list[int]) -> TokenHistory:
    """One request's history for plain decoding, counted in Python."""
    counts = Counter(generated)
    return TokenHistory(torch.tensor([[counts[t] for t in range(vocab)]], dtype=torch.int32),
                        torch.tensor([[t in prompt for t in range(vocab)]]), torch.zeros(1, 0, dtype=torch.int64),
                        torch.zeros(1, 0, dtype=torch.bool))


def small_limits(rows: int = 4) -> Limits:
    return Limits(max_running_requests=rows, page_size=1, context_length=64, num_pages=8, chunked_prefill_size=16)


def test_count_update_matches_a_python_count():
    """start + commit (accept length a, a + 1 tokens, padding) against collections.Counter, rows reused."""
    rng = random.Random(0)
    vocab, width = 11, 5
    state = PenaltyState(small_limits(), vocab, torch.device("cpu"))
    want: dict[int, Counter] = {}
    prompts: dict[int, set] = {}
    for step in range(30):
        if step % 10 == 0:  # (re)start rows: prompts, and output kept through a preemption
            rows = [0, 2] if step else [0, 1, 2, 3]
            starts = [([rng.randrange(vocab) for _ in range(6)], [rng.randrange(vocab) for _ in range(step // 10)])
                      for _ in rows]
            state.start(rows, [p for p, _ in starts], [o for _, o in starts])
            for r, (p, o) in zip(rows, starts):
                want[r], prompts[r] = Counter(o), set(p)
        batch = rng.sample(range(4), 3)
        result = torch.tensor([[rng.randrange(width - 1)] + [rng.randrange(vocab) for _ in range(width - 1)]
                               for _ in batch])  # [3, 1 + W]: accept length a <= W - 2, then tokens
        counted = [i for i in range(3) if rng.random() < 0.7]
        state.commit([batch[i] for i in counted], counted, result)
        for i in counted:
            want[batch[i]].update(result[i, 1:int(result[i, 0]) + 2].tolist())
    for r in range(4):
        assert state.output_counts[r].tolist() == [want[r][t] for t in range(vocab)]
        assert state.in_prompt[r].tolist() == [t in prompts[r] for t in range(vocab)]


def test_tree_nodes_equal_plain_penalties_bit_for_bit():
    """apply_penalties over random trees = vLLM's formula with each node's full count (request + own path)."""
    torch.manual_seed(0)
    bs, n_nodes, vocab, depth = 3, 7, 13, 3
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 2], [-1, 0, 1, 2, 0, 4, 5], [-1, 0, 0, 0, 1, 2, 3]])
    depths = torch.zeros_like(parents)
    for i in range(1, n_nodes):
        depths[:, i] = depths.gather(1, parents[:, i:i + 1].clamp(min=0))[:, 0] + 1
    tokens = torch.randint(0, 4, (bs, n_nodes))  # few distinct tokens: paths repeat them
    counts = torch.randint(0, 3, (bs, vocab), dtype=torch.int32)
    in_prompt = torch.rand(bs, vocab) < 0.3
    logits = torch.randn(bs * n_nodes, vocab) * 3
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.6),
              SamplingParams(), SamplingParams(frequency_penalty=1.9, repetition_penalty=0.5)]
    pen = PenaltyParams.build(params, lambda v, d: torch.tensor(v, dtype=d).repeat_interleave(n_nodes))
    path, valid = node_paths(tokens, parents, depths, depth)
    got = apply_penalties(logits, pen, TokenHistory(counts, in_prompt, path, valid))
    full = counts.repeat_interleave(n_nodes, 0).clone()  # [bs*N, V]: each node's own count, built naively
    for b in range(bs):
        for i in range(n_nodes):
            node = i
            while depths[b, node] >= 1:
                full[b * n_nodes + i, tokens[b, node]] += 1
                node = int(parents[b, node])
    want = vllm_reference(logits, full, in_prompt.repeat_interleave(n_nodes, 0), pen.presence, pen.frequency,
                          pen.repetition)
    assert torch.equal(got, want)
    assert torch.equal(got[n_nodes:2 * n_nodes], logits[n_nodes:2 * n_nodes])  # no penalties: untouched


def test_penalty_semantics_by_hand():
    """Order and signs: logit_bias first, then repetition (divide positive, multiply negative), frequency x
    generated count, presence once; prompt tokens count for repetition only."""
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                            logit_bias={3: 1.5})
    st = SamplingTensors.build([params], [0], 4, "cpu", 1, [3], [frozenset()])
    out = process_logits(logits, st, torch.tensor([5]), plain_history(4, prompt=[0], generated=[1, 2, 1]))
    assert out.tolist() == [[1.0, -4.0 - 0.5 - 0.5, 0.5 - 0.25 - 0.5, 2.0]]


def test_bad_values_refused():
    for kw, field, says in [(dict(presence_penalty=2.5), "presence_penalty", "[-2.0, 2.0], got 2.5"),
                            (dict(frequency_penalty=-3), "frequency_penalty", "[-2.0, 2.0], got -3"),
                            (dict(repetition_penalty=0.0), "repetition_penalty", "[0.01, 2.0] (1 = no penalty"),
                            (dict(repetition_penalty=1e-300), "repetition_penalty", "got 1e-300"),
                            (dict(repetition_penalty=2.5), "repetition_penalty", "got 2.5"),
                            (dict(repetition_penalty=float("nan")), "repetition_penalty", "finite number"),
                            (dict(presence_penalty="1"), "presence_penalty", "number")]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw)
        assert e.value.field == field and field in str(e.value) and says in str(e.value)


@needs_draft
@pytest.mark.parametrize("k,page", [(1, 16), (4, 1)])  # chains and trees, one page size each
def test_greedy_penalties_spec_equals_plain(make_llm, k, page):
    plain, spec = engines(make_llm, k, page)
    prompts = PROMPTS + ["x = [0, 0, 0, 0", "    return self.x, self.y"]
    for kw in GREEDY_CASES:
        params = SamplingParams(max_tokens=24, **kw)
        want = [o.token_ids for o in plain.generate(prompts, params)]
        assert [o.token_ids for o in spec.generate(prompts, params)] == want, kw


@needs_draft
def test_seeded_penalties_same_with_speculation_batching_and_preemption(make_llm):
    """The (seed, position) key makes sampled output comparable token for token: each request alone on the plain
    engine vs all batched on a speculative engine whose cache forces preemptions (counts rebuilt on recompute)."""
    kws = [dict(frequency_penalty=-2.0, presence_penalty=-2.0), dict(presence_penalty=1.5, repetition_penalty=1.4),
           dict(frequency_penalty=1.0, repetition_penalty=0.6), {}]
    params = [SamplingParams(max_tokens=24, temperature=0.9, seed=7 + i, ignore_eos=True, **kw)
              for i, kw in enumerate(kws * 2)]
    prompts = (PROMPTS * 3)[:len(params)]
    plain = make_llm(builtin_model_path(), page_size=16)
    alone = [plain.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    spec = make_llm(builtin_model_path(), page_size=4, max_total_tokens=96, draft_model=str(builtin_draft_path()),
                    speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    outs = spec.generate(prompts, params)
    assert spec.engine.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == alone


N = 500


@needs_draft
@pytest.mark.parametrize("lossy", [False, True])
def test_sampled_penalties_keep_the_distribution(make_llm, lossy, monkeypatch):
    """Three sampled tokens (the third chosen at a depth-1 tree node when the draft's guess is accepted) with
    penalties that favour repeats: spec samples the exact distribution computed from plain decoding's processed
    logits; a verifier that counts the request's committed tokens but not the node's path is detected."""
    plain, spec = engines(make_llm, 2, 4, max_running_requests=64)
    prompt = plain.tokenizer.encode(PROMPTS[1])
    penalties = dict(frequency_penalty=-2.0, presence_penalty=-2.0, repetition_penalty=0.8)  # lossy: TV ~0.3
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True, **penalties)
    st = SamplingTensors.build([params], [0], plain.engine.vocab_size, "cpu", 1, [len(prompt)], [frozenset()])
    vocab = plain.engine.vocab_size

    def dist(generated):
        ids = prompt + generated
        logits = plain.engine.next_token_logits(ids, first=len(ids) - 1)
        history = plain_history(vocab, prompt, generated)
        probs = target_probs(process_logits(logits, st, torch.tensor([len(ids)]), history), st)[0]
        return {int(t): float(p) for t, p in enumerate(probs.tolist()) if p > 0}

    exact = {(a, b, c): pa * pb * pc for a, pa in dist([]).items() for b, pb in dist([a]).items()
             for c, pc in dist([a, b]).items()}
    if lossy:
        def pathless(tokens, parents, depths, max_depth):
            empty = torch.zeros(tokens.numel(), 0, dtype=torch.int64, device=tokens.device)
            return empty, empty.bool()

        monkeypatch.setattr(ew, "node_paths", pathless)
    greedy = plain.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True, **penalties))[0].token_ids
    install_oracle(spec, 1.0).add_reference(prompt, greedy)  # the draft proposes the likeliest path
    outs = spec.generate([prompt] * (N if not lossy else 200), params)
    counts = Counter(tuple(o.token_ids) for o in outs)
    cells = sorted(set(exact) | set(counts))
    ok = matches_distribution([counts.get(c, 0) for c in cells], [exact.get(c, 0.0) for c in cells])
    assert ok is (not lossy)


@pytest.mark.gpu
@needs_draft
def test_gpu_graphs_and_overlap_penalties_spec_equals_plain(make_llm):
    """CUDA graphs, overlap (pinned result buffers, events): a batch mixing penalised greedy, penalised seeded and
    unpenalised requests gives plain decoding's tokens (float32: no near-tie flips)."""
    kw = dict(device="cuda", attention_backend="triton", dtype="float32", cuda_graph=True, page_size=16,
              max_running_requests=8)
    prompts = PROMPTS * 3
    params = [SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY_CASES[i % 4]) if i % 3 == 0 else
              SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=i, **GREEDY_CASES[i % 4])
              if i % 3 == 1 else SamplingParams(max_tokens=40, ignore_eos=True) for i in range(len(prompts))]
    plain = make_llm(builtin_model_path(), **kw)
    spec = make_llm(builtin_model_path(), draft_model=str(builtin_draft_path()), speculative_num_steps=4,
                    speculative_eagle_topk=4, speculative_num_draft_tokens=16, **kw)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
