"""allowed_token_ids and bad_words (vLLM's semantics), offline and over both OpenAI endpoints: forbidden tokens never
appear, allowed-only output uses only allowed ids, every tree node is masked as plain decoding masks that position
(greedy spec == plain, chains and trees; a verifier that forgets the node's path is detected), bad inputs are 400s
naming the value. Bundled demo model (pycode-6m) and its EAGLE-3 head."""

from __future__ import annotations

import random

import pytest
import torch

import spruce.runtime.sampler as sampler_module
import spruce.speculative.eagle_worker as ew
from conftest import assert_no_leaks
from oracle_draft import install_oracle
from server_util import ServerThread, one_torch_thread  # noqa: F401
from spruce import LLM, SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.errors import InvalidRequestError
from spruce.limits import Limits
from spruce.runtime.penalties import node_paths
from spruce.runtime.sampler import SamplingTensors, process_logits
from spruce.runtime.token_restrictions import TAIL_WIDTH, BadWords, OutputTails, restrict_tokens
from spruce.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS

needs_draft = pytest.mark.skipif(not builtin_draft_path().exists(), reason="bundled draft head absent")
PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n", "for i in range(10):"]
MAX_TOKENS = 24
SPEC = {"chain": dict(speculative_num_steps=4, speculative_eagle_topk=1, speculative_num_draft_tokens=5),
        "tree": dict(speculative_num_steps=4, speculative_eagle_topk=4, speculative_num_draft_tokens=16)}


# --- the masks against vLLM's reference, over random trees -----------------------------------------------------
def vllm_bad_words(logits: torch.Tensor, bad_words: list[list[int]], past: list[int]) -> torch.Tensor:
    """vLLM's _apply_bad_words_single_batch, written as it reads (one row, its generated tokens `past`)."""
    logits = logits.clone()
    for word in bad_words:
        if len(word) > len(past) + 1:
            continue
        prefix = len(word) - 1
        if (past[-prefix:] if prefix else []) == word[:prefix]:
            logits[word[-1]] = float("-inf")
    return logits


def small_limits(rows: int = 4) -> Limits:
    return Limits(max_running_requests=rows, page_size=1, context_length=64, num_pages=8, chunked_prefill_size=16)


def test_tails_follow_committed_tokens():
    """start + commit (accept length a, a + 1 tokens, padding) keep each row's last T outputs, most recent first."""
    rng = random.Random(0)
    width = 6
    tails = OutputTails(small_limits(), torch.device("cpu"))
    outputs: dict[int, list[int]] = {}
    for step in range(40):
        if step % 13 == 0:  # (re)start rows, with output kept through a preemption
            rows = [0, 1, 2, 3] if not step else [1, 3]
            kept = [[rng.randrange(50) for _ in range(rng.randrange(0, 2 * TAIL_WIDTH))] for _ in rows]
            tails.start(rows, kept)
            outputs.update(zip(rows, kept))
        batch = rng.sample(range(4), 3)
        result = torch.tensor([[rng.randrange(width - 1)] + [rng.randrange(50) for _ in range(width - 1)]
                               for _ in batch])
        counted = [i for i in range(3) if rng.random() < 0.7]
        tails.commit([batch[i] for i in counted], counted, result)
        for i in counted:
            outputs[batch[i]] += result[i, 1:int(result[i, 0]) + 2].tolist()
    for r in range(4):
        want = list(reversed(outputs[r][-TAIL_WIDTH:]))
        assert tails.tails[r].tolist() == want + [-1] * (TAIL_WIDTH - len(want))


def test_tree_nodes_masked_as_vllm_masks_their_position():
    """Every node of random trees (few distinct tokens: prefixes match often) gets vLLM's bad-words mask for its
    request's output + its own path, and allowed_token_ids' mask; a request without restrictions is untouched."""
    torch.manual_seed(0)
    rng = random.Random(1)
    bs, n_nodes, vocab, depth = 3, 7, 6, 3
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 2], [-1, 0, 1, 2, 0, 4, 5], [-1, 0, 0, 0, 1, 2, 3]])
    depths = torch.zeros_like(parents)
    for i in range(1, n_nodes):
        depths[:, i] = depths.gather(1, parents[:, i:i + 1].clamp(min=0))[:, 0] + 1
    for trial in range(20):
        tokens = torch.randint(0, 3, (bs, n_nodes))
        outputs = [[rng.randrange(3) for _ in range(rng.randrange(0, 5))] + [int(tokens[b, 0])] for b in range(bs)]
        words = [[tuple(rng.randrange(3) for _ in range(rng.randrange(1, 5))) for _ in range(3)], [],
                 [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 6))) for _ in range(2)]]
        allowed = [None, tuple(sorted(rng.sample(range(vocab), 3))), None] if trial % 2 else [None] * bs
        tails = OutputTails(small_limits(), torch.device("cpu"))
        tails.start([0, 1, 2], outputs)
        bad = BadWords.build(words, "cpu")
        path, valid = node_paths(tokens, parents, depths, depth)
        recent = tails.recent(torch.tensor([0, 1, 2]), bad.width, path, valid)
        mask = None if allowed[1] is None else torch.tensor([[a is None or t in a for t in range(vocab)]
                                                             for a in allowed])
        logits = torch.randn(bs * n_nodes, vocab)
        got = restrict_tokens(logits, mask, bad, recent)
        for b in range(bs):
            for i in range(n_nodes):
                node, on_path = i, []
                while depths[b, node] >= 1:
                    on_path.insert(0, int(tokens[b, node]))
                    node = int(parents[b, node])
                want = vllm_bad_words(logits[b * n_nodes + i], [list(w) for w in words[b]], outputs[b] + on_path)
                if allowed[b] is not None:
                    want = torch.where(torch.tensor([t in allowed[b] for t in range(vocab)]), want, float("-inf"))
                assert torch.equal(got[b * n_nodes + i], want), (trial, b, i)
        assert torch.equal(got[n_nodes:2 * n_nodes], logits[n_nodes:2 * n_nodes]) or allowed[1] is not None


def test_plain_rows_and_processor_order():
    """A plain row (no path) sees its output tail; restrictions come before logit_bias (-inf stays -inf)."""
    params = SamplingParams(bad_words=["x"], allowed_token_ids=[1, 2, 3], logit_bias={3: 100.0, 4: 100.0})
    st = SamplingTensors.build([params], [0], 6, "cpu", 1, [2], [frozenset()], [((5,), (1, 2))])
    tails = OutputTails(small_limits(), torch.device("cpu"))
    tails.start([2], [[4, 1]])
    from spruce.runtime.penalties import TokenHistory
    history = TokenHistory(None, None, None, None, tails.recent(torch.tensor([2]), st.bad_words.width))
    out = process_logits(torch.zeros(1, 6), st, torch.tensor([4]), history)
    assert out.tolist() == [[float("-inf"), 0.0, float("-inf"), 100.0, float("-inf"), float("-inf")]]


# --- validation -----------------------------------------------------------------------------------------------
def test_bad_values_refused_by_name():
    cases = [(dict(allowed_token_ids=[]), "allowed_token_ids", "empty"),
             (dict(allowed_token_ids=[3, -2]), "allowed_token_ids", "[-2]"),
             (dict(allowed_token_ids=["7"]), "allowed_token_ids", "'7'"),
             (dict(allowed_token_ids=5), "allowed_token_ids", "int 5"),
             (dict(bad_words=["ok", ""]), "bad_words", "''"),
             (dict(bad_words=["   "]), "bad_words", "'   '"),
             (dict(bad_words="word"), "bad_words", "str 'word'"),
             (dict(bad_words=["w"] * 0 + [f"w{i}" for i in range(MAX_BAD_WORDS + 1)]), "bad_words", "129 entries"),
             (dict(bad_words=["x" * 300]), "bad_words", "300")]
    for kw, field, says in cases:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw)
        assert e.value.field == field and says in str(e.value), (kw, str(e.value))
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids must be token ids in \[0, 10\), got \[10\]"):
        SamplingParams(allowed_token_ids=[1, 10]).check_vocab(10)
    assert SamplingParams(allowed_token_ids=[5, 1, 5]).allowed_token_ids == (1, 5)
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ("a", "b")


@pytest.fixture(scope="module")
def plain():
    llm = LLM(builtin_model_path(), page_size=4, max_running_requests=4)
    yield llm
    assert_no_leaks(llm)


def test_tokenization_as_vllm(plain):
    """Each word as written and with a leading space (kept when it starts with another token, as long); limits."""
    tok = plain.tokenizer
    ids = SamplingParams(bad_words=["def", " return"]).bad_words_token_ids(tok, plain.engine.vocab_size)
    enc = [tuple(tok.encode(w, add_special_tokens=False)) for w in ("def", " def", "return", " return")]
    assert ids == tuple(dict.fromkeys(e for e, keep in zip(enc, (True, enc[1][0] != enc[0][0], True,
                                                                 enc[3][0] != enc[2][0])) if keep))
    too_long = " ".join(["zq"] * MAX_BAD_WORD_TOKENS)
    for words, says in [([too_long], "tokens long"), ([f"w{i}x" for i in range(MAX_BAD_WORDS)], "sequences")]:
        with pytest.raises(InvalidRequestError, match=says) as e:
            SamplingParams(bad_words=words).bad_words_token_ids(tok, plain.engine.vocab_size)
        assert e.value.field == "bad_words"
    for params, field in [(SamplingParams(allowed_token_ids=[1, 99999]), "allowed_token_ids"),
                          (SamplingParams(bad_words=[too_long]), "bad_words")]:
        before = len(plain.engine.requests)
        with pytest.raises(InvalidRequestError) as e:  # the engine refuses them before queueing
            plain.engine.add_request([1, 2, 3], params)
        assert e.value.field == field and len(plain.engine.requests) == before
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        SamplingParams(bad_words=["x"]).bad_words_token_ids(None, 10)
    with pytest.raises(InvalidRequestError, match="outside the model's vocabulary"):
        SamplingParams(bad_words=["def"]).bad_words_token_ids(tok, 10)


# --- engines: plain vs speculative -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_engines():
    if not builtin_draft_path().exists():
        pytest.skip("bundled draft head absent")
    llms = {name: LLM(builtin_model_path(), page_size=4, max_running_requests=4, draft_model=str(builtin_draft_path()),
                      **kw) for name, kw in SPEC.items()}
    yield llms
    for llm in llms.values():
        assert_no_leaks(llm)


def firing_bad_words(llm: LLM, outputs: list[list[int]], count: int = 4) -> list[str]:
    """Words of 2-3 tokens taken from unrestricted greedy outputs whose text tokenizes back to exactly those tokens
    (so banning them changes the output where they were generated), plus one single-token word."""
    tok, words = llm.tokenizer, []
    for out in outputs:
        for start in range(2, len(out) - 3, 5):
            gram = out[start:start + 2 + start % 2]
            text = tok.decode(gram)
            if text.strip() and text == text.lstrip() and tok.encode(text, add_special_tokens=False) == gram:
                words.append(text)
                break
    single = next(t for t in outputs[0][1:] if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    return list(dict.fromkeys(words))[:count] + [tok.decode([single])]


def contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


@pytest.fixture(scope="module")
def cases(plain) -> list[SamplingParams]:
    """bad_words that fire, allowed_token_ids that exclude half of what the model chose, and both."""
    free = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    words = firing_bad_words(plain, free)
    allowed = sorted({t for out in free for t in out[::2]})  # half of what it chose: the rest must change
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=words),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed, bad_words=words[:2])]
    banned = params[0].bad_words_token_ids(plain.tokenizer, plain.engine.vocab_size)
    assert [w for w in banned if any(contains(out, w) for out in free)]  # the words were there unrestricted
    return [(p, [o.token_ids for o in plain.generate(PROMPTS, p)]) for p in params], free


def check_restricted(llm: LLM, params: SamplingParams, outputs: list[list[int]]) -> None:
    """No output holds a forbidden sequence or a token outside allowed_token_ids."""
    banned = params.bad_words_token_ids(llm.tokenizer, llm.engine.vocab_size)
    for out in outputs:
        assert not [w for w in banned if contains(out, w)], (params.bad_words, out)
        if params.allowed_token_ids is not None:
            assert set(out) <= set(params.allowed_token_ids)


def test_forbidden_tokens_never_appear(plain, cases):
    restricted, free = cases
    for params, outs in restricted:
        check_restricted(plain, params, outs)
        assert outs != free  # the restriction fired


@needs_draft
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_spec_equals_plain(spec_engines, cases, shape):
    spec = spec_engines[shape]
    for params, want in cases[0]:
        assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want, params
    assert spec.engine.spec_stats.mean_accept_length > 1.2  # drafts were accepted: tree paths were checked


@needs_draft
@pytest.mark.parametrize("lossy", [False, True])
def test_node_paths_matter(plain, spec_engines, cases, lossy, monkeypatch):
    """An oracle draft proposes the restricted output, so accepted paths hold bad words' prefixes: a verifier
    that matches only the committed tail (not the node's own path) lets a banned token through."""
    spec = spec_engines["tree"]
    params, want = cases[0][0]
    draft = spec.engine.runner.draft
    oracle = install_oracle(spec, 1.0)
    for prompt, out in zip(PROMPTS, want):
        oracle.add_reference(plain.tokenizer.encode(prompt), out)
    if lossy:
        def pathless(tokens, parents, depths, max_depth):
            path = tokens.reshape(-1, 1).expand(-1, max_depth).clone()
            return path, torch.zeros_like(path, dtype=torch.bool)

        monkeypatch.setattr(ew, "node_paths", pathless)
    try:
        got = [o.token_ids for o in spec.generate(PROMPTS, params)]
    finally:
        spec.engine.runner.draft = draft
    assert (got == want) is (not lossy)


def test_masks_removed_are_detected(plain, cases, monkeypatch):
    """With the restriction step removed from token selection, forbidden tokens appear (the checks above can
    fail)."""
    monkeypatch.setattr(sampler_module, "restrict_tokens", lambda logits, *a: logits)
    leaked = 0
    for params, _ in cases[0]:
        try:
            check_restricted(plain, params, [o.token_ids for o in plain.generate(PROMPTS, params)])
        except AssertionError:
            leaked += 1
    assert leaked == len(cases[0])


# --- the OpenAI endpoints ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    kw = dict(draft_model=str(builtin_draft_path()), **SPEC["chain"]) if builtin_draft_path().exists() else {}
    llm = LLM(builtin_model_path(), page_size=4, max_running_requests=4, disable_radix_cache=True, **kw)
    srv = ServerThread(llm.engine).start()
    yield srv
    srv.stop()
    assert_no_leaks(llm)


def test_endpoints_honour_both_fields(server, plain, cases):
    """completions (token-id prompts: the offline engine's exact input) give the offline greedy tokens; chat's
    output obeys the same restrictions."""
    for params, want in (cases[0][0], cases[0][2]):  # bad_words; both fields
        fields = {"allowed_token_ids": list(params.allowed_token_ids) if params.allowed_token_ids else None,
                  "bad_words": list(params.bad_words)}
        body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **fields}
        r = server.post_v1("completions", {**body, "prompt": [plain.tokenizer.encode(p) for p in PROMPTS]})
        assert r.status_code == 200, r.text
        assert [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == want
    r = server.post_v1("chat/completions", {**body, "messages": [{"role": "user", "content": PROMPTS[0]}]})
    assert r.status_code == 200, r.text
    check_restricted(plain, params, [r.json()["choices"][0]["token_ids"]])


@pytest.mark.parametrize("field,value,says", [
    ("allowed_token_ids", [], "empty"),
    ("allowed_token_ids", [5, 999999], "[999999]"),
    ("allowed_token_ids", [-3], "[-3]"),
    ("allowed_token_ids", ["7"], "allowed_token_ids[0]"),
    ("bad_words", [""], "''"),
    ("bad_words", "def", "bad_words"),
    ("bad_words", [f"w{i}" for i in range(MAX_BAD_WORDS + 1)], "129 entries"),
    ("bad_words", ["x" * 300], "300"),
    ("bad_words", [" ".join(["zq"] * MAX_BAD_WORD_TOKENS)], "tokens long"),
])
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_bad_inputs_are_400s_naming_the_value(server, path, field, value, says):
    body = {"messages": [{"role": "user", "content": "x"}]} if path.startswith("chat") else {"prompt": "x"}
    r = server.post_v1(path, {**body, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(field) and says in err["message"], err


def test_mixed_steps_and_preemption_keep_the_tails(plain, cases):
    """Requests arriving while others decode (mixed steps) in a KV cache too small for all (preempted requests
    recompute prompt + output: their tails restart from the output kept) give the offline outputs."""
    from test_mixed_steps import staggered

    prompts = PROMPTS + ["x = [0, 0, 0, 0"]
    params = [cases[0][i % 2 * 2][0] for i in range(len(prompts))]  # bad words; both fields
    want = [plain.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(builtin_model_path(), page_size=4, max_running_requests=4, max_total_tokens=96)
    got, steps = staggered(llm, True, prompts, params, every=3)
    assert llm.engine.scheduler.num_preemptions > 0 and steps["mixed"] > 0
    assert [o.token_ids for o in got] == want


@pytest.mark.gpu
@needs_draft
def test_gpu_graphs_and_overlap_spec_equals_plain(cases):
    """CUDA graphs and overlap (results read a step late: the tails advance on the device): a batch mixing
    restricted greedy, restricted seeded and unrestricted requests gives plain decoding's tokens."""
    kw = dict(device="cuda", attention_backend="triton", dtype="float32", cuda_graph=True, page_size=16,
              max_running_requests=8)
    restricted = [p for p, _ in cases[0]]
    prompts = PROMPTS * 3
    params = [restricted[i // 3] if i % 3 == 0 else
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=i,
                             bad_words=restricted[0].bad_words, allowed_token_ids=restricted[1].allowed_token_ids)
              if i % 3 == 1 else SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(len(prompts))]
    gpu_plain = LLM(builtin_model_path(), **kw)
    want = [o.token_ids for o in gpu_plain.generate(prompts, params)]
    spec = LLM(builtin_model_path(), draft_model=str(builtin_draft_path()), speculative_num_steps=4,
               speculative_eagle_topk=4, speculative_num_draft_tokens=16, **kw)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    for p, o in zip(params, got):
        check_restricted(spec, p, [o.token_ids])
