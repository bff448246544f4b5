"""A separate causal LM as the draft (STANDALONE, vLLM's `draft_model`): greedy output equals plain decoding for
chains and trees, page sizes 1 and 16; a draft that is the target itself accepts every draft of a chain, one that
is the target's first layers about half; adaptive plain steps keep it exact; a vocabulary mismatch, a
draft window shorter than the tree and a missing draft path are refused; vLLM's --speculative-config method
`draft_model` and SGLang's --speculative-algorithm STANDALONE reach the engine.

Target: the bundled pycode-6m. Drafts: pycode-6m itself, its first five of seven layers (a real, partly right draft)
and a tiny random Llama with the same vocabulary.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from checkpoints import write_llama_checkpoint
from spruce import LLM, SamplingParams
from spruce.cli import build_parser
from spruce.cli_args import engine_kwargs
from spruce.config import builtin_model_path
from spruce.errors import ConfigError, InvariantError
from spruce.speculative.adaptive import CATCH_UP

TARGET = builtin_model_path()
VOCAB = 4096  # pycode-6m's
MAX_NEW = 16
PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n",
           "for i in range(10):", "class Node:\n    def __init__(self, value, children=None):\n        self."]
ENGINE = dict(max_running_requests=4, chunked_prefill_size=32)  # small chunks: prompts prefill in several


def first_layers(path, target, layers: int):
    """The target's embedding, first `layers` layers and final norm: a draft that is partly right."""
    path.mkdir()
    cfg = json.loads((target / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
    tensors = load_file(str(target / "model.safetensors"))
    keep = {n: t for n, t in tensors.items()
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers}
    save_file(keep, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("standalone")
    return {"self": TARGET,
            "first5": first_layers(root / "first5", TARGET, 5),
            "random": write_llama_checkpoint(root / "random", hidden=32, layers=2, heads=2, kv_heads=1,
                                             intermediate=64, vocab=VOCAB, max_pos=2048, seed=3)}


@pytest.fixture(scope="module")
def reference():
    """The target's greedy tokens for PROMPTS, without speculation."""
    outs = LLM(TARGET, page_size=16, **ENGINE).generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    return [o.token_ids for o in outs]


def standalone(draft, k: int, s: int, n: int, page_size: int = 16, **kw) -> LLM:
    return LLM(TARGET, draft_model=str(draft), speculative_algorithm="standalone", speculative_eagle_topk=k,
               speculative_num_steps=s, speculative_num_draft_tokens=n, page_size=page_size, **{**ENGINE, **kw})


def mean_accept(outs) -> float:
    rounds = sum(o.spec_stats["rounds"] for o in outs)
    return sum(o.spec_stats["mean_accept_length"] * o.spec_stats["rounds"] for o in outs) / rounds


# draft, (K, S, N), page size, least mean accept length (tokens a round commits, bonus included)
CASES = [("self", (1, 4, 5), 16, 4.5), ("first5", (1, 4, 5), 1, 1.5), ("first5", (4, 3, 8), 16, 1.5),
         ("random", (4, 3, 8), 1, 1.0)]


@pytest.mark.parametrize("draft,shape,page_size,least", CASES, ids=[f"{c[0]}-K{c[1][0]}-page{c[2]}" for c in CASES])
def test_greedy_equals_plain_decoding(drafts, reference, draft, shape, page_size, least):
    """Then the same prompts again, their full pages from the prefix cache (the draft's KV in them too)."""
    llm = standalone(drafts[draft], *shape, page_size)
    for again in (False, True):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == reference
        assert mean_accept(outs) >= least, [o.spec_stats for o in outs]
        assert again == any(o.num_cached_tokens for o in outs)


def test_sampling_and_structured_output_equal_plain_decoding(drafts):
    """Seeded sampling, a regex and a JSON object (their depth-1 drafts pruned by the grammar from the draft's stored
    hidden state) in one batch with a greedy request: plain decoding's tokens, and the target drafting for itself
    still accepts drafts under the grammars."""
    pytest.importorskip("llguidance", reason="structured output needs spruce[grammar] (llguidance)")
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=7),
              SamplingParams(max_tokens=MAX_NEW, regex=r"[a-z]+( [a-z]+)*"),
              SamplingParams(max_tokens=MAX_NEW, json_object=True),
              SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)]
    want = [o.token_ids for o in LLM(TARGET, page_size=16, **ENGINE).generate(PROMPTS, params)]
    outs = standalone(drafts["self"], 4, 3, 8, 16).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert mean_accept(outs) > 2.0, [o.spec_stats for o in outs]


def test_adaptive_plain_steps_keep_the_draft_exact(reference, monkeypatch):
    """Adaptive speculation forced through catch-up steps (plain steps, each followed by the draft LM's extend over
    its token) and rounds: plain decoding's output, and the target drafting for itself still accepts every draft,
    so each catch-up step put its token at its own position in the draft's KV."""
    llm = standalone(TARGET, 1, 3, 4, 16, speculative_adaptive=True, disable_overlap_schedule=True)
    policy = llm.engine.strategy.policy
    picks = iter([CATCH_UP, 4, CATCH_UP, CATCH_UP, 4] * 20)
    monkeypatch.setattr(policy, "choose", lambda *args: next(picks))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference
    assert sum(o.spec_stats["rounds"] for o in outs) > 0
    assert mean_accept(outs) >= 3.6, [o.spec_stats for o in outs]


def test_the_page_check_counts_the_drafts_next_root():
    """A decode step also writes the draft LM's next root (committed + S + 1): with pages reserved one position short
    of it (page size 1), the always-on page check refuses the step instead of letting it write into no page."""
    llm = standalone(TARGET, 1, 4, 5, 1, max_running_requests=1, disable_overlap_schedule=True)
    lim = llm.engine.limits
    object.__setattr__(lim, "lookahead", lim.lookahead - 1)  # the scheduler reserves one position less
    with pytest.raises(InvariantError, match="writes up to position"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    draft = write_llama_checkpoint(tmp_path / "d", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
                                   vocab=VOCAB - 96, max_pos=2048)
    with pytest.raises(ConfigError, match=rf"vocab_size {VOCAB - 96}, the target has {VOCAB}"):
        standalone(draft, 1, 3, 4, 16)


def test_a_draft_window_shorter_than_the_tree_is_refused(tmp_path):
    draft = write_llama_checkpoint(tmp_path / "d", variant="mistral", hidden=32, layers=1, heads=2, kv_heads=1,
                                   intermediate=64, vocab=VOCAB, max_pos=2048, sliding_window=3)
    with pytest.raises(ConfigError, match="below the draft's sliding_window=3"):
        standalone(draft, 1, 3, 4, 16)


def parse(*argv: str):
    return engine_kwargs(build_parser().parse_args(["serve", "--model", str(TARGET), *argv]))


def test_vllms_draft_model_method_and_sglangs_algorithm_reach_the_engine(drafts):
    draft = str(drafts["random"])
    kw = parse("--speculative-config", json.dumps({"method": "draft_model", "model": draft,
                                                   "num_speculative_tokens": 3}))
    assert (kw["speculative_algorithm"], kw["draft_model"], kw["speculative_num_steps"],
            kw["speculative_eagle_topk"]) == ("STANDALONE", draft, 3, 1)  # vLLM's chain
    kw = parse("--speculative-algorithm", "standalone", "--speculative-draft-model-path", draft)
    assert (kw["speculative_algorithm"], kw["draft_model"]) == ("STANDALONE", draft)


def test_standalone_without_a_draft_path_is_refused():
    with pytest.raises(ConfigError, match="STANDALONE needs --speculative-draft-model-path"):
        parse("--speculative-algorithm", "STANDALONE")
    with pytest.raises(ConfigError, match="needs a draft model"):
        LLM(TARGET, speculative_algorithm="STANDALONE")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graphs_equal_plain_decoding(drafts, page_size):
    """On the GPU with CUDA graphs (decode phases and prefills; float32: no bf16 near-ties): chains and trees of each
    draft give plain decoding's greedy tokens, and the target drafting for itself accepts (nearly) every draft of a
    chain; adaptive catch-up steps and rounds, forced in turn, too."""
    kw = dict(device="cuda", dtype="float32", page_size=page_size, max_running_requests=8, chunked_prefill_size=64)
    prompts, params = PROMPTS * 2, SamplingParams(max_tokens=48, ignore_eos=True)
    want = [o.token_ids for o in LLM(TARGET, **kw).generate(prompts, params)]
    for draft, shape, least in [("self", (1, 4, 5), 4.5), ("first5", (4, 3, 8), 1.5), ("random", (4, 3, 8), 1.0)]:
        llm = standalone(drafts[draft], *shape, **kw)
        assert int(llm.engine.info()["cuda_graphs_captured"]) > 0
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want, draft
        assert mean_accept(outs) >= least, (draft, [o.spec_stats for o in outs])
    llm = standalone(TARGET, 1, 3, 4, speculative_adaptive=True, **kw)
    picks = iter([CATCH_UP, 4, CATCH_UP, CATCH_UP, 4] * 200)
    llm.engine.strategy.policy.choose = lambda *args: next(picks)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert mean_accept(outs) >= 3.6, [o.spec_stats for o in outs]


def test_tp2_shards_the_target_and_replicates_the_draft(drafts):
    """tensor parallelism (CPU, gloo): the target split over 2 ranks, the draft LM whole on each, a K=4 tree; greedy
    and seeded requests in one batch: the same tokens and accept lengths as tp 1."""
    from spruce.runtime.launch import create_engine
    from spruce.speculative.registry import make_strategy
    from test_tensor_parallel import config, jobs, prompts_of, run, run_tp2, spec

    prompts, params = jobs(prompts_of(TARGET))
    cfg = dict(speculative=spec("STANDALONE", drafts["first5"], TARGET, 3, 4, 8))
    want = run(LLM.from_engine(create_engine(config(TARGET, **cfg), make_strategy=make_strategy)), prompts, params)
    assert run_tp2(config(TARGET, tp_size=2, **cfg), prompts, params) == want
