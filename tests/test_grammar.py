"""Structured output with tree speculation (#16): the grammar mask is applied at every tree node along its path,
so greedy speculative output is token-for-token plain constrained decoding, sampled output has the constrained
distribution (a verifier that masks every node with its request's mask is detected), and every generated JSON
validates against its schema."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

import pytest
import torch

from grammar_schemas import SCHEMAS
from spruce import SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.errors import InvalidRequestError, InvariantError
from spruce.models.hf_config import ModelConfig
from spruce.models.tokenizer import Tokenizer
from spruce.runtime.grammar import GrammarBackend, GrammarBatch, allowed_tokens, apply_token_mask
from spruce.runtime.sampler import SamplingTensors, target_probs
from spruce.structured_output import StructuredOutput
from stats import matches_distribution

pytestmark = pytest.mark.slow  # scheduled first (conftest)

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance", reason="structured output needs spruce[grammar] (llguidance)")

PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n", "for i in range(10):"]
WORDS = r"[a-z]+( [a-z]+)*"
EXPRESSIONS = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/\n'
GBNF = 'root ::= "x = " [0-9]+ ";"'
CONSTRAINED = [
    SamplingParams(max_tokens=24, json_schema=SCHEMAS[11]),
    SamplingParams(max_tokens=24, json_schema=SCHEMAS[13]),
    SamplingParams(max_tokens=16, regex=WORDS),
    SamplingParams(max_tokens=8, choice=["yes", "no", "maybe"]),
    SamplingParams(max_tokens=16, grammar=EXPRESSIONS),
    SamplingParams(max_tokens=12, grammar=GBNF),
    SamplingParams(max_tokens=24, json_object=True),
    SamplingParams(max_tokens=16),  # unconstrained, in the same batches
]


def engines(make_llm, k, page, **kw):
    plain = make_llm(builtin_model_path(), page_size=page, max_running_requests=16, **kw)
    spec = make_llm(builtin_model_path(), page_size=page, max_running_requests=16,
                    draft_model=str(builtin_draft_path()), speculative_num_steps=4, speculative_eagle_topk=k,
                    speculative_num_draft_tokens=4 * k if k > 1 else 5, **kw)
    return plain, spec


def check_valid(params: SamplingParams, text: str, finish_reason: str) -> None:
    """A finished output matches its constraint."""
    if finish_reason != "stop":
        return
    if params.json_schema is not None:
        jsonschema.validate(json.loads(text), json.loads(params.json_schema))
    elif params.json_object:
        assert isinstance(json.loads(text), dict)
    elif params.regex is not None:
        assert re.fullmatch(params.regex, text), text
    elif params.choice is not None:
        assert text in params.choice
    elif params.grammar == GBNF:
        assert re.fullmatch(r"x = [0-9]+;", text), text


@pytest.mark.parametrize("k,page", [(1, 1), (1, 16), (4, 1), (4, 16)])
def test_greedy_spec_equals_plain_constrained(make_llm, k, page):
    if not builtin_draft_path().exists():
        pytest.skip("bundled draft head absent")
    plain, spec = engines(make_llm, k, page)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(2 * len(CONSTRAINED))]
    params = [CONSTRAINED[i // 2] for i in range(2 * len(CONSTRAINED))]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    backend = spec.engine._grammar
    for p, o in zip(params, got):
        check_valid(p, o.text, o.finish_reason)
        assert p.structured_output is None or fresh_matcher_accepts(backend, p.structured_output, o.token_ids)
    assert sum(o.finish_reason == "stop" for o in got) >= 4  # 5 complete (the rest reach max_tokens)
    assert spec.engine.stats()["spec"]["mean_accept_length"] > 1.3  # the trees were accepted into
    stats = spec.engine.grammar_stats
    assert stats["tree_nodes"] > 0 and 0 < stats["dead_nodes"] < stats["tree_nodes"]


def test_narrower_verify_trees_equal_plain_constrained(make_llm, monkeypatch):
    """Adaptive rounds over trees of 4, 8 and 16 nodes (`speculative_adaptive_widths`, the width cycled round by
    round), every node masked by its path's grammar state: plain constrained decoding's greedy tokens (the masks and
    the sampled acceptance read one row per node of the round's own tree)."""
    if not builtin_draft_path().exists():
        pytest.skip("bundled draft head absent")
    from test_adaptive import forced

    plain = make_llm(builtin_model_path(), page_size=16, max_running_requests=16)
    spec = make_llm(builtin_model_path(), page_size=16, max_running_requests=16, draft_model=str(builtin_draft_path()),
                    speculative_num_steps=4, speculative_eagle_topk=4, speculative_num_draft_tokens=16,
                    speculative_adaptive=True, speculative_adaptive_widths=(4, 8))
    forced(spec, [4, 16, 8])
    strategy, ran = spec.engine.strategy, []
    choose = strategy.choose

    def recorded(requests):
        step = choose(requests)
        ran.append(step.tree_width)
        return step

    monkeypatch.setattr(strategy, "choose", recorded)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(CONSTRAINED))]
    want = plain.generate(prompts, CONSTRAINED)
    got = spec.generate(prompts, CONSTRAINED)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # every width ran (a request whose acceptance collapsed may also take plain steps: width 1)
    assert {4, 8, 16} <= set(ran) <= {1, 4, 8, 16} and spec.engine.grammar_stats["tree_nodes"] > 0, ran


def fresh_matcher_accepts(backend: GrammarBackend, spec: StructuredOutput, tokens: list[int]) -> bool:
    """An independent check: a new matcher for the constraint consumes every token."""
    g = backend.request_grammar(spec)
    return g.matcher.try_consume_tokens(tokens) == len(tokens)


def test_twenty_schemas_give_valid_json(make_llm):
    """Twenty schemas in one speculative batch (K=4): every finished output parses and validates; a truncated
    one (max_tokens) is a prefix some valid instance extends (a fresh matcher consumes it)."""
    if not builtin_draft_path().exists():
        pytest.skip("bundled draft head absent")
    spec = make_llm(builtin_model_path(), page_size=16, max_running_requests=20,
                    draft_model=str(builtin_draft_path()), speculative_num_steps=4, speculative_eagle_topk=4,
                    speculative_num_draft_tokens=16)
    params = [SamplingParams(max_tokens=48, json_schema=s) for s in SCHEMAS]
    outs = spec.generate([PROMPTS[0]] * len(SCHEMAS), params)
    backend = spec.engine._grammar
    finished = 0
    for schema, p, o in zip(SCHEMAS, params, outs):
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schema)
            finished += 1
        else:
            assert o.finish_reason == "length" and fresh_matcher_accepts(backend, p.structured_output, o.token_ids)
    assert finished >= 15, finished  # 17 of 20 finish within 48 tokens (the rest pad with whitespace / digits)


N = 600


@pytest.mark.parametrize("lossy", [False, True])
def test_sampled_spec_has_the_constrained_distribution(make_llm, lossy, monkeypatch):
    """Three sampled tokens under a token-level grammar (positions 1 and 2 from three tokens U[:3], position 3
    from six, U): the speculative output has the exact distribution of the target restricted to each position's
    set. Position 3 is chosen at a depth-1 tree node; a verifier that masks every node with its request's mask
    (the mask after position 1) never picks U[3:] there, and the chi-square test rejects it."""
    if not builtin_draft_path().exists():
        pytest.skip("bundled draft head absent")
    plain, spec = engines(make_llm, 4, 4)
    prompt = plain.tokenizer.encode(PROMPTS[0])
    top = plain.engine.next_token_logits(prompt, first=len(prompt) - 1)[0]
    eos = set(plain.engine.eos_token_ids)
    u = [t for t in top.argsort(descending=True).tolist() if t not in eos][:6]
    sets = [u[:3], u[:3], u]
    grammar = "start: a b c\n" + "".join(f"{name}: <[{','.join(map(str, s))}]>\n"
                                         for name, s in zip("abc", sets))
    params = SamplingParams(max_tokens=4, temperature=1.0, grammar=grammar)
    st = SamplingTensors.build([params], [0], plain.engine.vocab_size, "cpu")

    def dist(ids, allowed):
        logits = plain.engine.next_token_logits(ids, first=len(ids) - 1)
        keep = torch.full_like(logits, float("-inf"))
        keep[:, allowed] = 0.0
        return dict(zip(allowed, target_probs(logits + keep, st)[0, allowed].tolist()))

    exact = {}
    for a, pa in dist(prompt, sets[0]).items():
        for b, pb in dist(prompt + [a], sets[1]).items():
            for c, pc in dist(prompt + [a, b], sets[2]).items():
                exact[(a, b, c)] = pa * pb * pc
    assert sum(p for cell, p in exact.items() if cell[2] in u[3:]) > 0.15  # what the lossy verifier never picks
    if lossy:
        monkeypatch.setattr(GrammarBatch, "tree_masks", lambda self, tokens, parents, device:
                            self.row_masks(device).repeat_interleave(tokens.shape[1], dim=0))
    outs = spec.generate([prompt] * (N if not lossy else 300), params)
    assert all(o.finish_reason == "stop" for o in outs)  # the grammar ends after three tokens
    counts = Counter(tuple(o.token_ids) for o in outs)
    cells = sorted(set(exact) | set(counts))
    ok = matches_distribution([counts.get(c, 0) for c in cells], [exact.get(c, 0.0) for c in cells])
    assert ok is (not lossy)


# --- the pieces -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    path = builtin_model_path()
    mc = ModelConfig.from_dir(path)
    tok = Tokenizer.from_dir(path, mc)
    return GrammarBackend(tok.to_json(), mc.vocab_size, tuple(mc.eos_token_ids), "grammar")


def allowed_ids(mask_row: torch.Tensor, vocab: int) -> list[int]:
    return allowed_tokens(mask_row[None], vocab)[0].nonzero().flatten().tolist()


def test_tree_masks_follow_each_path_and_mark_dead_nodes(backend):
    """Node i's mask is the grammar's after root..i; a node the grammar refuses (and its subtree) is dead and
    gets its parent's mask. Grammar: token 10 or 11, then 20 or 21."""
    spec = StructuredOutput("grammar", "start: a b\na: <[10,11]>\nb: <[20,21]>\n")
    g = backend.request_grammar(spec)
    eos = backend.tokenizer.eos_token
    tokens = torch.tensor([[7, 10, 12, 20, 5], [7, 0, 0, 0, 0]])  # row 1: an unconstrained request
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 0, 0, 0]])
    dead_before = backend.dead_nodes
    masks = GrammarBatch(backend, [g, None]).tree_masks(tokens, parents, "cpu")  # [2*5, words]
    v = backend.vocab_size
    got = [allowed_ids(masks[i], v) for i in range(5)]
    assert got == [[10, 11], [20, 21], [10, 11], [eos], [10, 11]]
    assert backend.dead_nodes - dead_before == 2
    assert all(len(allowed_ids(masks[i], v)) == v for i in range(5, 10))  # unconstrained rows allow everything
    assert g.matcher.try_consume_tokens([11]) == 1  # the request's own matcher was not advanced by the tree


def test_request_grammar_stops_at_completion_and_refuses_foreign_tokens(backend):
    spec = StructuredOutput("grammar", "start: a b\na: <[10,11]>\nb: <[20,21]>\n")
    g = backend.request_grammar(spec)
    assert g.advance([10, 21, backend.tokenizer.eos_token, 5]) == 2 and g.stopped  # the rest is dropped
    g = backend.request_grammar(spec)
    with pytest.raises(InvariantError, match="not allowed by the request's grammar"):
        g.advance([12])


def test_apply_token_mask_sets_refused_logits_to_minus_inf():
    logits = torch.randn(2, 70)
    masks = torch.zeros(2, 3, dtype=torch.int32)
    masks[0, 0] = 1 << 5
    masks[0, 1] = -(1 << 31)  # bit 31 of word 1: token 63
    masks[1, 2] = 0b11  # tokens 64, 65
    out = apply_token_mask(logits, masks)
    finite = [out[i].isfinite().nonzero().flatten().tolist() for i in range(2)]
    assert finite == [[5, 63], [64, 65]] and torch.equal(out[0, [5, 63]], logits[0, [5, 63]])


def test_logprobs_stay_the_raw_distribution(make_llm):
    """A constrained token's logprob is the target's raw log-softmax, not the masked distribution's."""
    llm = make_llm(builtin_model_path(), page_size=16)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, choice=["yes", "no"], logprobs=0))[0]
    prompt = llm.tokenizer.encode(PROMPTS[0])
    raw = llm.engine.next_token_logits(prompt, first=len(prompt) - 1)[0].log_softmax(-1)
    token = out.token_ids[0]
    assert out.logprobs[0][token].logprob == pytest.approx(float(raw[token]), abs=1e-4)
    assert float(raw[token]) < -0.01  # the masked distribution would give it far more mass


@pytest.mark.parametrize("kw,field,text", [
    (dict(regex="(ab"), "regex", "unclosed group"),
    (dict(json_schema={"type": "foo"}), "json_schema", "foo"),
    (dict(grammar="start: x"), "grammar", "unknown name"),
])
def test_bad_constraints_are_refused_by_name(make_llm, kw, field, text):
    llm = make_llm(builtin_model_path(), page_size=16)
    with pytest.raises(InvalidRequestError, match=text) as e:
        llm.engine.add_request(PROMPTS[0], SamplingParams(**kw))
    assert e.value.field == field and not llm.engine.has_unfinished()


@pytest.mark.parametrize("kw,field", [
    (dict(regex="a", grammar="start: a"), "grammar"), (dict(json_schema="{x"), "json_schema"),
    (dict(json_schema=[1]), "json_schema"), (dict(choice="ab"), "choice"), (dict(choice=["a", ""]), "choice"),
    (dict(regex=""), "regex"), (dict(json_object=1), "json_object"),
    (dict(regex="a", min_tokens=1, max_tokens=4), "min_tokens"),
])
def test_bad_sampling_params_are_refused_by_name(kw, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


def test_without_the_library_a_request_gets_a_clear_error(make_llm, monkeypatch):
    llm = make_llm(builtin_model_path(), page_size=16)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    with pytest.raises(InvalidRequestError, match=r"pip install llguidance") as e:
        llm.engine.add_request(PROMPTS[0], SamplingParams(json_object=True))
    assert e.value.field == "json_object"
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0].finish_reason == "length"  # others run


def test_no_module_imports_the_grammar_library_at_import_time():
    """The base install has no llguidance: only runtime/grammar.py uses it, and only inside a function."""
    import ast
    from pathlib import Path

    import spruce

    offenders = []
    for path in sorted(Path(spruce.__file__).parent.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "llguidance" for n in names):
                offenders.append(path.name)
    assert offenders == []


@pytest.mark.gpu
def test_gpu_graphs_greedy_spec_equals_plain_constrained(pycode19m, tmp_path):
    """On CUDA with graphs (triton, float32 so no argmax flips between shapes): the tree read back from the draft
    graph's buffers, the pinned mask copies and the masked eager selection after the verify graph give plain
    constrained decoding's tokens, for one request and for a padded batch of 13."""
    from checkpoints import write_eagle3_checkpoint
    from spruce import LLM

    draft = str(write_eagle3_checkpoint(tmp_path / "e3", pycode19m, seed=11))
    kw = dict(device="cuda", dtype="float32", page_size=16, max_running_requests=16, cuda_graph=True,
              attention_backend="triton")
    plain = LLM(pycode19m, **kw)
    spec = LLM(pycode19m, draft_model=draft, speculative_num_steps=4, speculative_eagle_topk=4,
               speculative_num_draft_tokens=12, **kw)
    for bs in (1, 13):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(bs)]
        params = [CONSTRAINED[i % len(CONSTRAINED)] for i in range(bs)]
        want = plain.generate(prompts, params)
        got = spec.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], f"bs={bs}"
        for p, o in zip(params, got):
            check_valid(p, o.text, o.finish_reason)
    for llm in (plain, spec):
        llm.engine.check_no_leaks()
