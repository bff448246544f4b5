"""llguidance vs xgrammar for spruce's structured output (docs/DESIGN.md §17): tokenizer tables, schema compile,
next-token mask time along a valid JSON instance, fork / rollback cost, and the masks of whole draft trees
(depth-first with consume / rollback, xgrammar's C++ traverse_draft_tree, and fork per node + one parallel
llguidance call, which is what spruce does).

Usage (needs both libraries): python bench/grammar_libs.py [TOKENIZER_DIR]   (default: ../shared/models/pycode-19m)
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "shared/models/pycode-19m")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "active": {"type": "boolean"}}, "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False}
INSTANCE = {"name": "Alice Smith", "age": 42, "tags": ["a", "bb", "dev"], "address": {"city": "Paris", "zip": "75001"},
            "active": True}
TREE_SIZES = (8, 16, 64)


def per_call_us(fn, n: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - start) / n


def instance_ids(hf, accepts) -> list[int]:
    """The instance tokenized in the first JSON layout the library's grammar accepts."""
    for text in (json.dumps(INSTANCE, separators=(",", ":")), json.dumps(INSTANCE)):
        ids = hf.encode(text, add_special_tokens=False).ids
        if accepts(ids):
            return ids
    raise SystemExit("no layout of the instance is accepted")


def random_tree(ids, n, prefix, rng):
    """N nodes: node 0 is the instance's token before `prefix`; each node's token is the instance's next token
    at its depth or (half the time) a random token."""
    parents, tokens, depth = [-1], [ids[prefix - 1]], [0]
    for i in range(1, n):
        p = rng.randrange(i)
        parents.append(p)
        depth.append(depth[p] + 1)
        nxt = prefix + depth[p]
        tokens.append(ids[nxt] if rng.random() < 0.5 and nxt < len(ids) else rng.randrange(VOCAB))
    return tokens, parents


def children(parents):
    out = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            out[p].append(i)
    return out


def dfs_masks(matcher, tokens, parents, fill, try_one, rollback):
    kids = children(parents)

    def visit(i):
        fill(matcher, i)
        for c in kids[i]:
            if try_one(matcher, tokens[c]):
                visit(c)
                rollback(matcher)

    visit(0)


hf = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
VOCAB = json.loads((MODEL / "config.json").read_text())["vocab_size"]
EOS = json.loads((MODEL / "config.json").read_text())["eos_token_id"]
res: dict[str, float] = {}

# --- llguidance
import llguidance  # noqa: E402
import llguidance.torch as lt  # noqa: E402

t = time.perf_counter()
lltok = llguidance.LLTokenizer(hf.to_str(), n_vocab=VOCAB, eos_token=EOS)
res["llguidance tokenizer s"] = time.perf_counter() - t
t = time.perf_counter()
llm = llguidance.LLMatcher(lltok, llguidance.grammar_from("json_schema", json.dumps(SCHEMA)), log_level=0)
res["llguidance compile s"] = time.perf_counter() - t
lmask = lt.allocate_token_bitmask(max(TREE_SIZES), VOCAB)
lids = instance_ids(hf, lambda ids: llm.deep_copy().try_consume_tokens(ids) == len(ids))
times = []
for rep in range(6):
    m = llm.deep_copy()
    for tok in lids:
        start = time.perf_counter()
        lt.fill_next_token_bitmask(m, lmask, 0)
        if rep:
            times.append(1e6 * (time.perf_counter() - start))
        assert m.consume_token(tok)
res["llguidance mask us mean"], res["llguidance mask us max"] = statistics.mean(times), max(times)
m = llm.deep_copy()
m.consume_tokens(lids[:10])
res["llguidance deep_copy us"] = per_call_us(m.deep_copy)
res["llguidance consume+rollback us"] = per_call_us(lambda: (m.consume_token(lids[10]), m.rollback(1)))
executor = llguidance.LLExecutor()

# --- xgrammar
import xgrammar as xgr  # noqa: E402

vocab = [""] * VOCAB
for text, i in hf.get_vocab(with_added_tokens=True).items():
    vocab[i] = text
t = time.perf_counter()
info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=VOCAB, stop_token_ids=[EOS])
compiler = xgr.GrammarCompiler(info, max_threads=1)
res["xgrammar tokenizer s"] = time.perf_counter() - t
t = time.perf_counter()
compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
res["xgrammar compile s"] = time.perf_counter() - t
xmask = xgr.allocate_token_bitmask(max(TREE_SIZES), VOCAB)
xids = instance_ids(hf, lambda ids: all(x.accept_token(i) for x in [xgr.GrammarMatcher(compiled)] for i in ids))
times = []
for rep in range(6):
    m = xgr.GrammarMatcher(compiled)
    for tok in xids:
        start = time.perf_counter()
        m.fill_next_token_bitmask(xmask, 0)
        if rep:
            times.append(1e6 * (time.perf_counter() - start))
        assert m.accept_token(tok)
res["xgrammar mask us mean"], res["xgrammar mask us max"] = statistics.mean(times), max(times)
m = xgr.GrammarMatcher(compiled)
for tok in xids[:10]:
    m.accept_token(tok)
res["xgrammar fork us"] = per_call_us(m.fork)
res["xgrammar accept+rollback us"] = per_call_us(lambda: (m.accept_token(xids[10]), m.rollback(1)))

# --- whole trees
rng = random.Random(0)
for n in TREE_SIZES:
    total = {"llguidance dfs": 0.0, "llguidance fork+parallel": 0.0, "xgrammar dfs": 0.0, "xgrammar traverse": 0.0}
    trees = 0
    for prefix in range(2, min(len(lids), len(xids)) - 6, 3):
        for name, ids in (("llguidance", lids), ("xgrammar", xids)):
            tokens, parents = random_tree(ids, n, prefix, rng)
            if name == "llguidance":
                m = llm.deep_copy()
                m.consume_tokens(ids[:prefix])
                start = time.perf_counter()
                dfs_masks(m, tokens, parents, lambda mm, i: lt.fill_next_token_bitmask(mm, lmask, i),
                          lambda mm, tok: mm.try_consume_tokens([tok]) == 1, lambda mm: mm.rollback(1))
                total["llguidance dfs"] += time.perf_counter() - start
                start = time.perf_counter()
                states = [m] + [None] * (n - 1)
                for i in range(1, n):
                    if states[parents[i]] is not None:
                        s = states[parents[i]].deep_copy()
                        states[i] = s if s.try_consume_tokens([tokens[i]]) == 1 else None
                lt.fill_next_token_bitmask_par(executor, [(s, i) for i, s in enumerate(states) if s is not None],
                                               lmask[:n])
                total["llguidance fork+parallel"] += time.perf_counter() - start
            else:
                m = xgr.GrammarMatcher(compiled)
                for tok in ids[:prefix]:
                    m.accept_token(tok)
                start = time.perf_counter()
                dfs_masks(m, tokens, parents, lambda mm, i: mm.fill_next_token_bitmask(xmask, i),
                          lambda mm, tok: mm.accept_token(tok), lambda mm: mm.rollback(1))
                total["xgrammar dfs"] += time.perf_counter() - start
                kids = children(parents)
                first = torch.tensor([k[0] if k else -1 for k in kids])
                sibling = torch.full((n,), -1)
                for k in kids:
                    for a, b in zip(k, k[1:]):
                        sibling[a] = b
                start = time.perf_counter()
                m.traverse_draft_tree(first, sibling, torch.tensor(tokens), xmask[:n])
                total["xgrammar traverse"] += time.perf_counter() - start
        trees += 1
    for name, seconds in total.items():
        res[f"{name} tree of {n} us"] = 1e6 * seconds / trees

for key, value in res.items():
    print(f"{key}: {value:.4g}")
