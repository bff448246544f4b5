"""N-gram (prompt-lookup) speculation: the matcher against brute force (and vLLM's rule for its first candidate),
the trie against its continuations, padding nodes never accepted, the context read through the page table; greedy
NGRAM equals plain decoding token for token for chains and trees, page sizes 1 and 16, overlap on and off, with
penalties, structured output and a seeded sampled request beside; a prompt served from the prefix cache drafts exactly
as when computed; tensor-parallel ranks (2, on the CPU) agree; prompt-copying prompts accept more than 1.5 tokens per
round; no draft model is loaded; bad settings are refused naming the value; vLLM's `{"method": "ngram", ...}` and
--speculative-algorithm NGRAM reach the engine.

Model: the bundled pycode-6m; prompts: an import block and two standard-library functions, each followed by its own
beginning again, so the model copies on.
"""

from __future__ import annotations

import random

import pytest
import torch

from checkpoints import python_source_prompts
from spruce import LLM, SamplingParams
from spruce.cli import build_parser
from spruce.cli_args import engine_kwargs
from spruce.config import builtin_model_path, make_speculative_config
from spruce.errors import ConfigError
from spruce.runtime.batch_builder import paged_slots
from spruce.speculative.ngram import NO_TOKEN, NgramWorker, merge_candidates, propose, row_context
from spruce.speculative.tree import build_tree

MAX_NEW = 20
ENGINE = dict(max_running_requests=4, chunked_prefill_size=64)  # prompts prefill in several chunks


IMPORTS = "import os\nimport sys\nimport json\nimport time\nimport math\nimport random\nimport logging\n"


def copy_prompts() -> list[str]:
    """Prompts whose continuation repeats them: an import block, then two functions of the standard library (bisect's,
    heapq's), each followed by its own beginning again."""
    bisect, heapq = python_source_prompts()[2][:300], python_source_prompts()[1][:300]
    return [IMPORTS + "\n\n" + IMPORTS[:20], bisect + "\n\n\n" + bisect[:40], heapq + "\n\n\n" + heapq[:40]]


PROMPTS = copy_prompts()
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


# --- the matcher -------------------------------------------------------------------------------------------------
def brute_force(tokens: list[int], min_n: int, max_n: int, k: int, depth: int) -> list[list[int]]:
    """The K best occurrences' continuations: every end e <= L-2 with its longest n <= max_n (>= min_n) such that
    the n tokens ending at e are the context's last n, ordered by (longer, earlier)."""
    L = len(tokens)
    found = []
    for e in range(L - 1):
        n = 0
        while n < max_n and e - n >= 0 and tokens[e - n] == tokens[L - 1 - n]:
            n += 1
        if n >= min_n:
            found.append((-n, e))
    return [tokens[e + 1:min(e + 1 + depth, L)] for _, e in sorted(found)[:k]]


def vllm_rule(tokens: list[int], min_n: int, max_n: int, depth: int) -> list[int]:
    """vLLM's documented proposal: for n from max_n down to min_n, the first earlier occurrence of the last n tokens;
    the up to `depth` tokens after it."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > L:
            continue
        for s in range(0, L - n):
            if tokens[s:s + n] == tokens[L - n:]:
                return tokens[s + n:s + n + depth]
    return []


def batch(contexts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = torch.full((len(contexts), width), NO_TOKEN, dtype=torch.int32)
    for i, c in enumerate(contexts):
        ctx[i, :len(c)] = torch.tensor(c, dtype=torch.int32)
    return ctx, torch.tensor([len(c) for c in contexts])


@pytest.mark.parametrize("seed", range(4))
def test_matcher_equals_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(6):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k, depth = rng.randint(1, 4), rng.randint(1, 6)
        vocab = rng.choice([2, 3, 5])  # small vocabularies: many matches, ties and overlaps
        contexts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(5)]
        ctx, lengths = batch(contexts, 32)
        tokens, valid = propose(ctx, lengths, min_n, max_n, k, depth)
        for i, c in enumerate(contexts):
            got = [[t for t, v in zip(tokens[i, j].tolist(), valid[i, j].tolist()) if v] for j in range(k)]
            want = brute_force(c, min_n, max_n, k, depth)
            assert got == want + [[]] * (k - len(want)), (c, min_n, max_n, k, depth)
            assert got[0] == vllm_rule(c, min_n, max_n, depth), (c, min_n, max_n)
            assert all(valid[i, j].tolist() == sorted(valid[i, j].tolist(), reverse=True) for j in range(k))


def test_matcher_example_of_the_docstring():
    ctx, lengths = batch([[1, 2, 3, 1, 2, 4, 1, 2]], 8)
    tokens, valid = propose(ctx, lengths, 1, 3, 2, 3)
    assert tokens[0].tolist() == [[3, 1, 2], [4, 1, 2]] and bool(valid.all())
    cands, real = merge_candidates(tokens, valid)
    assert real.tolist() == [6]


@pytest.mark.parametrize("seed", range(3))
def test_trie_holds_every_continuation_once(seed):
    """The tree of the merged continuations: live nodes have live parents and distinct tokens among siblings, every
    live node's path spells a prefix of some continuation, and (width permitting) every such prefix is a node."""
    rng = random.Random(seed)
    P, K, S = 6, 3, 4
    tokens = torch.tensor([[[rng.randrange(3) for _ in range(S)] for _ in range(K)] for _ in range(P)])
    lengths = torch.tensor([[rng.randint(0, S) for _ in range(K)] for _ in range(P)])
    valid = torch.arange(S)[None, None, :] < lengths[:, :, None]
    tokens = torch.where(valid, tokens, 0)
    cands, real = merge_candidates(tokens, valid)
    width = 1 + K * S
    tree = build_tree(cands, torch.full((P,), 9), width, 1, S, debug=True)
    for p in range(P):
        prefixes = {tuple(tokens[p, c, :d + 1].tolist()) for c in range(K) for d in range(lengths[p, c])}
        assert int(real[p]) == len(prefixes)
        live = [i for i in range(1, width) if 0 <= int(tree.ranks[p, i]) < int(real[p])]
        paths, children = {0: ()}, {}
        for i in live:
            parent = int(tree.parents[p, i])
            assert parent in paths, "a live node's parent is live and comes first"
            paths[i] = paths[parent] + (int(tree.tokens[p, i]),)
            assert int(tree.depths[p, i]) == len(paths[i])
            children.setdefault(parent, []).append(int(tree.tokens[p, i]))
        assert {paths[i] for i in live} == prefixes
        assert all(len(set(c)) == len(c) for c in children.values())


def test_padding_nodes_are_never_accepted():
    """A row with one real node (a continuation of one token) in a tree of three: the padding node (token 0, a child
    of the root) is dead even where the target's choice after the root is 0."""
    cands, real = merge_candidates(torch.tensor([[[5, 6]]]), torch.tensor([[[True, False]]]))
    tree = build_tree(cands, torch.tensor([9]), 3, 1, 2)
    worker = NgramWorker.__new__(NgramWorker)  # the acceptance reads only S and the rows' real-node counts
    worker.S, worker.real_nodes = 2, real
    assert sorted(tree.tokens[0, 1:].tolist()) == [0, 5]
    for root_choice, want in ((0, (0, 0)), (5, (1, 7))):
        target = torch.where(tree.tokens == 5, 7, root_choice)  # after the root: root_choice; after node 5: 7
        acc = worker._acceptance(tree, target)
        assert (int(acc.accept_lens[0]), int(acc.bonus[0])) == want


def test_context_is_read_through_the_page_table():
    page, table = 4, torch.tensor([[3, 1, 2, 0], [5, 4, 0, 0]])
    store = torch.zeros(6 * page, dtype=torch.int32)
    rows_tokens = [list(range(100, 110)), [7, 8, 9, 7, 8]]
    for row, toks in enumerate(rows_tokens):
        slots = paged_slots(table, torch.tensor(row), torch.arange(len(toks)), page)
        store[slots] = torch.tensor(toks, dtype=torch.int32)
    committed = torch.tensor([9, 4])  # the last token is each row's root (no KV yet): stored elsewhere
    ctx = row_context(store, table, torch.tensor([0, 1]), committed, torch.tensor([42, 43]), 12, page)
    assert ctx[0].tolist() == list(range(100, 109)) + [42, NO_TOKEN, NO_TOKEN]
    assert ctx[1].tolist() == [7, 8, 9, 7, 43] + [NO_TOKEN] * 7


# --- the engine ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """pycode-6m's greedy tokens for PROMPTS without speculation, and for the penalty and grammar requests."""
    llm = LLM(builtin_model_path(), page_size=16, **ENGINE)
    return [o.token_ids for o in llm.generate(PROMPTS + PROMPTS[:3], GREEDY_EXTRAS)]


GREEDY_EXTRAS = [GREEDY] * len(PROMPTS) + [
    SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(max_tokens=MAX_NEW, regex=r"[a-z_]+( [a-z_]+)*"),
    SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7),
]


def ngram_llm(page_size: int, topk: int, overlap: bool, steps: int = 4) -> LLM:
    return LLM(builtin_model_path(), page_size=page_size, disable_overlap_schedule=not overlap,
               speculative_algorithm="ngram", speculative_num_steps=steps, speculative_eagle_topk=topk,
               speculative_prompt_lookup_min=1, speculative_prompt_lookup_max=3, **ENGINE)


@pytest.fixture(scope="module")
def tree_engine():
    return ngram_llm(page_size=16, topk=3, overlap=True)


def mean_accept(outs) -> float:
    rounds = sum(o.spec_stats["rounds"] for o in outs)
    return sum(o.spec_stats["committed_tokens"] for o in outs) / rounds


def test_chain_equals_plain(reference):
    """A chain (vLLM's proposal), page 1, overlap off (the tree engine below: page 16, overlap on)."""
    llm = ngram_llm(page_size=1, topk=1, overlap=False)
    assert llm.engine.runner.draft is None and llm.engine.runner.draft_kv is None  # no draft model loaded
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference[:len(PROMPTS)]
    assert mean_accept(outs) > 1.5


def test_tree_with_penalties_grammar_and_sampling_equals_plain(reference, tree_engine):
    """A trie of 3 continuations (N = 13), page 16, overlap on; a penalised, a regex-constrained and a seeded sampled
    request beside (the sampled one equals plain decoding's draw for draw: keyed by seed and position)."""
    assert tree_engine.engine.limits.num_draft_tokens == 13
    outs = tree_engine.generate(PROMPTS + PROMPTS[:3], GREEDY_EXTRAS)
    assert [o.token_ids for o in outs] == reference
    assert mean_accept(outs[:len(PROMPTS)]) > 1.5


def test_prefix_cache_brings_the_context(tree_engine):
    """A prompt served from the prefix cache drafts from its cached tokens exactly as when it was computed: the
    same rounds, the same accept lengths."""
    tree_engine.engine.flush_cache()
    cold = tree_engine.generate(PROMPTS[:2], GREEDY)
    warm = tree_engine.generate(PROMPTS[:2], GREEDY)
    assert all(o.num_cached_tokens >= 16 for o in warm)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert [o.spec_stats for o in warm] == [o.spec_stats for o in cold]


def test_tensor_parallel_ranks_agree(reference, tree_engine):
    """tp_size=2 on the CPU (gloo; every rank matches its own copy of the context): the same tokens and the same
    rounds as one process (the engine's always-on state check fails a rank that diverges)."""
    prompts = PROMPTS[:2]
    one = tree_engine.generate(prompts, GREEDY)
    two = LLM(builtin_model_path(), page_size=16, disable_overlap_schedule=True, tp_size=2,
              speculative_algorithm="ngram", speculative_num_steps=4, speculative_eagle_topk=3,
              speculative_prompt_lookup_min=1, speculative_prompt_lookup_max=3, **ENGINE)
    try:
        got = two.generate(prompts, GREEDY)
    finally:
        two.shutdown()
    assert [o.token_ids for o in got] == reference[:len(prompts)]
    assert [o.spec_stats for o in got] == [o.spec_stats for o in one]


# --- settings ------------------------------------------------------------------------------------------------------
def test_defaults_are_vllms():
    spec = make_speculative_config("ngram", None)
    assert (spec.algorithm, spec.draft_model, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("NGRAM", None, 5, 5)
    assert (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) == (5, 1, 6)
    assert make_speculative_config("NGRAM", None, prompt_lookup_max=3).prompt_lookup_min == 3
    assert make_speculative_config("NGRAM", None, prompt_lookup_min=2).prompt_lookup_max == 2
    assert make_speculative_config("NGRAM", None, 4, 3).num_draft_tokens == 13  # the whole trie


@pytest.mark.parametrize("kwargs,named", [
    (dict(prompt_lookup_min=0), "prompt_lookup_min must be an integer >= 1"),
    (dict(prompt_lookup_min=1, prompt_lookup_max=2.5), "prompt_lookup_max must be an integer >= 1"),
    (dict(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    (dict(num_steps=2, eagle_topk=2, num_draft_tokens=6), "speculative_num_draft_tokens=6 needs 5"),
    (dict(adaptive=True), "speculative_adaptive is not supported"),
    (dict(draft_model="some/draft"), "draft_model='some/draft'"),
])
def test_bad_settings_are_refused(kwargs, named):
    args = dict(algorithm="NGRAM", draft_model=None)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        make_speculative_config(**args)


def test_lookup_needs_ngram():
    with pytest.raises(ConfigError, match="prompt_lookup_min=2 .* need speculative_algorithm='NGRAM'"):
        make_speculative_config(None, None, prompt_lookup_min=2)
    with pytest.raises(ConfigError, match="prompt_lookup_max apply to speculative_algorithm='NGRAM' only"):
        make_speculative_config("EAGLE", "some/draft", prompt_lookup_max=2)


@pytest.mark.parametrize("argv", [
    ["--speculative-config", '{"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, '
                             '"num_speculative_tokens": 3}'],
    ["--speculative-algorithm", "ngram", "--speculative-prompt-lookup-min", "2", "--speculative-prompt-lookup-max",
     "4", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1"],
])
def test_flags_reach_the_engine(argv):
    args = build_parser().parse_args(["generate", "--prompt", "x", *argv])
    kw = engine_kwargs(args)
    assert kw["draft_model"] is None and kw["speculative_algorithm"] == "NGRAM"
    assert (kw["speculative_prompt_lookup_min"], kw["speculative_prompt_lookup_max"]) == (2, 4)
    assert (kw["speculative_num_steps"], kw["speculative_eagle_topk"]) == (3, 1)
