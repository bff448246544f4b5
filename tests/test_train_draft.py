"""`spruce train-draft`: the loss goes down on a toy corpus; the checkpoint is the published EAGLE-3 layout and
spruce drafts losslessly with it; the training forward equals spruce's inference draft (extend and the draft
steps of a chain); the dense target forward equals the paged one; d2t/t2d; exact resume.
--draft-arch mtp: the same for one MTP layer (DeepSeek's layout, served as NEXTN), on the Llama-family bundled
target and on the DeepSeek fixture (MLA + MoE)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from spruce import LLM, SamplingParams
from spruce.attention.backend import create_backend
from spruce.attention.metadata import Phase
from spruce.config import builtin_model_path
from spruce.models.eagle import DraftConfig
from spruce.models.hf_config import ModelConfig
from spruce.models.loader import load_target
from spruce.models.mtp import MTPDraft, mtp_checkpoint_tensors
from spruce.speculative.tree import own_bits
from spruce.train.checkpoint import STATE_FILE, make_head
from spruce.train.mtp_head import make_mtp_head
from spruce.train.data import PackedWindows
from spruce.train.target import FrozenTarget
from spruce.train.trainer import TrainConfig, train
from spruce.train.vocab import build_draft_vocab, draft_ids

from conftest import PYCODE_MLA, SHARED_MODELS

pytestmark = pytest.mark.slow  # scheduled first (conftest)

# the bundled demo model (pycode-6m), else the fixture copy of it
TARGET = str(builtin_model_path() if (builtin_model_path() / "config.json").exists() else SHARED_MODELS / "pycode-6m")
TTT = 3
DRAFT_VOCAB = 600


def write_corpus(root):
    """Twelve small, regular Python files (two are held out by the trainer)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(12):
        body = "\n".join(f"def add_{i}_{j}(a, b):\n    return a + b + {j}\n\n\nclass Point{j}:\n    x = {j}\n"
                         f"    y = {j + 1}\n" for j in range(10))
        (root / f"mod{i}.py").write_text(body)
    return root


def small_config(root, **kw) -> TrainConfig:
    base = dict(target=TARGET, data=[str(root / "data")], out=str(root / "head"), steps=40, ttt_length=TTT,
                draft_vocab_size=DRAFT_VOCAB, lr=3e-3, warmup_steps=5, batch_size=4, max_length=64,
                heldout_docs=2, show_progress=False)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    write_corpus(root / "data")
    cfg = small_config(root)
    return cfg, train(cfg)


def test_loss_goes_down(trained):
    cfg, summary = trained
    log = [json.loads(line) for line in open(f"{cfg.out}/train_log.jsonl")]
    assert [r["step"] for r in log] == list(range(1, 41)) and summary["steps"] == 40
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert all(len(r["acc"]) == TTT and r["tokens_per_s"] > 0 for r in log)
    assert sum(r["acc"][0] for r in log[-5:]) / 5 > 0.5  # step-0 agreement with the target's argmax
    accept = summary["heldout_acceptance"]
    assert set(accept) == {f"K=1,S={TTT},N={TTT + 1}", f"K=4,S={TTT},N=16"}
    assert accept[f"K=1,S={TTT},N={TTT + 1}"]["mean_accept_length"] > 1.2


def test_checkpoint_format(trained):
    cfg, summary = trained
    conf = json.loads(open(f"{cfg.out}/config.json").read())
    tc = ModelConfig.from_dir(TARGET)
    h, inter = tc.hidden_size, tc.intermediate_size
    q, kv = tc.num_heads * tc.head_dim, tc.num_kv_heads * tc.head_dim
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["model_type"] == "llama"
    assert conf["num_hidden_layers"] == 1 and conf["draft_vocab_size"] == DRAFT_VOCAB
    assert (conf["vocab_size"], conf["hidden_size"], conf["intermediate_size"]) == (tc.vocab_size, h, inter)
    assert (conf["num_attention_heads"], conf["num_key_value_heads"], conf["head_dim"]) == \
        (tc.num_heads, tc.num_kv_heads, tc.head_dim)
    assert conf["rope_theta"] == tc.rope_theta and conf["rms_norm_eps"] == tc.rms_norm_eps
    assert conf["max_position_embeddings"] == tc.max_position_embeddings
    expected = {
        "fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (DRAFT_VOCAB, h), "d2t": (DRAFT_VOCAB,),
        "t2d": (tc.vocab_size,), "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,), "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h), "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q), "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter),
    }
    with safe_open(f"{cfg.out}/model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert shapes == expected
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert torch.equal(t2d.nonzero().flatten(), draft_ids(d2t))  # the same vocabulary, in target-id order
    dcfg = DraftConfig.from_dir(cfg.out, tc)
    assert dcfg.eagle3 and dcfg.draft_vocab_size == DRAFT_VOCAB
    assert list(dcfg.target_aux_layers) == summary["aux_layers"]  # the engine feeds the layers it trained on


def test_trained_head_drafts_losslessly(trained):
    cfg, _ = trained
    prompts = ["def add_7_3(a, b):\n", "class Point3:\n    x = 3\n"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(TARGET).generate(prompts, params)]
    llm = LLM(TARGET, draft_model=cfg.out, speculative_num_steps=3, speculative_eagle_topk=2,
              speculative_num_draft_tokens=6)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.5  # it learned this corpus


CHAIN_TEXT = "class Point4:\n    x = 4\n    y = 5\n\n\ndef add_1_4(a, b):\n    return a"


def assert_unroll_equals_engine(llm, ids: list[int], features: torch.Tensor, want: list[torch.Tensor]) -> None:
    """Training logits `want` (TTT x [1, L, V]) == the engine's draft on the same weights: step 0 == the paged
    draft extend over pairs (features[i], ids[i+1]) at every position <= p, and step k at index p == the k-th
    draft step of a chain rooted at p (scratch KV + ancestor mask), for three roots p."""
    r = llm.engine.runner
    lim, words = r.limits, r.limits.mask_words
    length, steps = len(ids), len(want)
    for p in (0, 4, length - steps - 1):
        row = r.page_table.alloc_row()
        r.page_table.append_pages(row, r.allocator.alloc(lim.pages_for(length + steps)))
        batch = r.builder.extend([row], [0], [ids[1:p + 2]])  # draft input at position i: (feature i, token i+1)
        with torch.no_grad():
            h = r.draft_forward(batch, features[:p + 1])  # [p+1, H]
            assert (r.draft.compute_logits(h) - want[0][0, :p + 1]).abs().max() < 1e-3
            feature, mask = h[p:p + 1], torch.zeros(1, 1, words, dtype=torch.int64)
            for k in range(1, steps):  # chain node at depth k: position p+k, token p+k+1, ancestors 1..k-1
                mask = mask | own_bits(1, words, "cpu", offset=k - 1)[None]
                b = r.builder.scratch_phase(
                    Phase.DRAFT_DECODE, torch.tensor([row]), torch.tensor([p + 1]), torch.tensor([[ids[p + k + 1]]]),
                    torch.tensor([[k - 1]]), mask, k - 1, r.draft_kv.scratch_start, lim.draft_scratch_width,
                    p + 1 + steps)
                feature = r.draft_forward(b, feature, r.draft.step_layer(k))
                got = r.draft.compute_logits(feature, r.draft.step_layer(k))[0]
                assert (got - want[k][0, p]).abs().max() < 1e-3, (p, k)
        r.allocator.free(r.page_table.release_row(row))


def test_training_forward_equals_inference_draft(trained):
    """On the same float32 weights: unroll step 0 == the engine's paged draft extend at every position, and
    step k at index p == the engine's k-th draft step of a chain rooted at p (scratch KV + ancestor mask)."""
    cfg, _ = trained
    llm = LLM(TARGET, draft_model=cfg.out, speculative_num_steps=TTT, speculative_eagle_topk=1,
              speculative_num_draft_tokens=TTT + 1, page_size=4)
    target = FrozenTarget(TARGET, "cpu", torch.float32)
    head = make_head(target.config, 3, DRAFT_VOCAB)
    head.load_state_dict(torch.load(f"{cfg.out}/{STATE_FILE}", weights_only=True)["head"])
    llm.engine.runner.draft.load_weights(list(head.state_dict().items()))  # exact float32 (the checkpoint is bf16)
    ids = llm.tokenizer.encode(CHAIN_TEXT)
    aux = target(torch.tensor([ids])).aux
    with torch.no_grad():
        want = head(target.model.embed_tokens.weight, torch.tensor([ids]), aux, TTT)  # TTT x [1, L, Vd]
    assert_unroll_equals_engine(llm, ids, aux[0], want)


# tiny MoE targets for train-draft: 6 layers (the default features [2, L//2, L-3] are [2, 3, 3]); gpt-oss's window
# and Llama 4's chunks (8) are shorter than the windows trained on
MOE_TARGETS = {
    "qwen3_moe": dict(layers=6),
    "gpt_oss": dict(layers=6, sliding_window=8),
    "llama4": dict(layers=6, top_k=1, interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4),
}


@pytest.mark.parametrize("variant", ["pycode-6m", "qwen3", "deepseek-v3", "deepseek-v2", "gpt_oss", "llama4"])
def test_dense_target_equals_paged(variant, tmp_path):
    """The trainer's dense causal target forward == spruce's paged target (aux states and logits): MHA and MLA,
    gpt-oss's sinks and sliding windows, Llama 4's chunks and no-rope layers."""
    from checkpoints import PagedCache, write_deepseek_checkpoint, write_llama_checkpoint

    if variant == "pycode-6m":
        path = TARGET
    elif variant in MOE_TARGETS:
        pytest.importorskip("transformers")
        from moe_checkpoints import write_moe_checkpoint

        path = write_moe_checkpoint(tmp_path / "t", variant, seed=2, **MOE_TARGETS[variant])
    elif variant == "qwen3":
        pytest.importorskip("transformers")
        path = write_llama_checkpoint(tmp_path / "t", variant="qwen3", layers=6, seed=2)
    else:
        pytest.importorskip("transformers")
        path = write_deepseek_checkpoint(tmp_path / "t", version=int(variant[-1]), layers=6, seed=2,
                                         q_lora_rank=None if variant.endswith("2") else 32)
    target = FrozenTarget(path, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (2, 37), generator=g)
    aux, _, logits = target(ids)
    paged = load_target(path, torch.float32, torch.device("cpu"), create_backend("torch", 4), target.aux_layers)
    cache = PagedCache.for_model(paged, rows=2, page_size=4)
    rows = [cache.add_row(37) for _ in range(2)]
    for i, row in enumerate(rows):  # two chunks: the second reads the first's KV from the pages
        for lo, hi in ((0, 20), (20, 37)):
            batch = cache.batch([row], [lo], [ids[i, lo:hi].tolist()])
            with torch.no_grad():
                hidden, paged_aux = paged(batch, cache.kv, cache.table)
            assert (paged_aux - aux[i, lo:hi]).abs().max() < 1e-4
            assert (paged.compute_logits(hidden) - logits[i, lo:hi]).abs().max() < 1e-3


def test_trains_a_head_for_a_deepseek_target(tmp_path):
    """train-draft with an MLA + MoE target (the pycode-mla fixture): a published EAGLE-3 head that spruce
    loads and drafts with losslessly."""
    target = PYCODE_MLA
    if not (target / "config.json").exists():
        pytest.skip(f"fixture model not found at {target}")
    write_corpus(tmp_path / "data")
    cfg = small_config(tmp_path, target=str(target), steps=6, batch_size=2, max_length=48, heldout_docs=0)
    result = train(cfg)
    assert result["steps"] == 6 and result["aux_layers"] == [2, 2, 2]  # [2, L//2, L-3] of a 5-layer target
    assert json.loads((tmp_path / "head" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    prompts = ["def add_3_4(a, b):\n", "class Point7:\n"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target)).generate(prompts, params)]
    llm = LLM(str(target), draft_model=cfg.out, speculative_num_steps=3, speculative_eagle_topk=2,
              speculative_num_draft_tokens=4)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain


@pytest.mark.parametrize("variant", list(MOE_TARGETS))
def test_trains_a_head_for_each_moe_target(tmp_path, variant):
    """train-draft with a tiny Qwen3-MoE, gpt-oss (YaRN, sinks, windows) and Llama 4 (chunks, no-rope layers,
    interleaved dense layers) target: features from layers [2, L//2, L-3] of its L layers, a published head that
    spruce drafts with losslessly, and whose training forward equals the engine's draft on the same weights."""
    pytest.importorskip("transformers")
    import shutil

    from moe_checkpoints import write_moe_checkpoint

    target = write_moe_checkpoint(tmp_path / "target", variant, seed=1, vocab=4096, **MOE_TARGETS[variant])
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the bundled model's tokenizer (4096 ids)
        shutil.copy(Path(TARGET) / name, target / name)
    write_corpus(tmp_path / "data")
    cfg = small_config(tmp_path, target=str(target), steps=2, batch_size=2, max_length=32, heldout_docs=0)
    assert train(cfg)["aux_layers"] == [2, 3, 3]
    prompts = ["def add_3_4(a, b):\n", "class Point7:\n    x = 7\n"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(str(target), page_size=4) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    llm = LLM(str(target), draft_model=cfg.out, speculative_num_steps=TTT, speculative_eagle_topk=1,
              speculative_num_draft_tokens=TTT + 1, page_size=4)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain
        frozen = FrozenTarget(target, "cpu", torch.float32)
        head = make_head(frozen.config, 3, DRAFT_VOCAB)
        head.load_state_dict(torch.load(f"{cfg.out}/{STATE_FILE}", weights_only=True)["head"])
        rotary = llm.engine.runner.draft.rotary  # the served head rotates as it trained (gpt-oss: YaRN's scale)
        n = min(rotary.num_positions, head.cos.shape[0])
        torch.testing.assert_close((head.cos[:n], head.sin[:n]), (rotary.cos[:n], rotary.sin[:n]))
        llm.engine.runner.draft.load_weights(list(head.state_dict().items()))  # exact float32
        ids = llm.tokenizer.encode(CHAIN_TEXT)
        aux = frozen(torch.tensor([ids])).aux
        with torch.no_grad():
            want = head(frozen.model.embed_tokens.weight, torch.tensor([ids]), aux, TTT)
        assert_unroll_equals_engine(llm, ids, aux[0], want)
    finally:
        llm.shutdown()


def test_draft_vocab():
    tokens = torch.tensor([5, 5, 5, 9, 9, 2, 7, 7, 2, 11])  # counts: 5:3, 2:2, 7:2, 9:2, 11:1
    d2t, t2d = build_draft_vocab(tokens, 20, 4)
    assert draft_ids(d2t).tolist() == [2, 5, 7, 9]  # ties (2, 7, 9 twice each) all fit; 11 does not
    assert t2d.sum() == 4 and t2d[[2, 5, 7, 9]].all()
    d2t, _ = build_draft_vocab(tokens, 20, 3)
    assert draft_ids(d2t).tolist() == [2, 5, 7]  # tie between 2, 7, 9 broken by the lower id
    d2t, t2d = build_draft_vocab(torch.tensor([3, 3]), 10, 3)
    assert draft_ids(d2t).tolist() == [0, 1, 3]  # fewer distinct tokens than asked: lowest unused ids
    d2t, t2d = build_draft_vocab(tokens, 20, None)
    assert d2t.shape == (20,) and not d2t.any() and t2d.all()
    assert build_draft_vocab(tokens, 20, 50)[0].shape == (20,)


def test_packed_windows_cover_every_window_per_epoch():
    w = PackedWindows([list(range(10)), list(range(100, 131))], 8, seed=1)
    assert len(w) == 5 and w.length == 8
    seen = torch.cat([w.batch(s, 2) for s in range(5)])[:5]  # 10 picks = 2 epochs of 5 windows
    assert sorted(seen[:, 0].tolist()) == sorted(w.windows[:, 0].tolist())
    assert torch.equal(w.batch(3, 2), PackedWindows([list(range(10)), list(range(100, 131))], 8, 1).batch(3, 2))


@pytest.mark.parametrize("arch", ["eagle3", "mtp"])
def test_resume_continues_exactly(tmp_path, arch):
    """3 steps, stop, resume to 6 == 6 steps straight: weights, optimizer moments, step counter, log."""
    write_corpus(tmp_path / "data")
    kw = dict(steps=6, heldout_docs=0, batch_size=2, max_length=32, ttt_length=2, draft_arch=arch)
    if arch == "mtp":
        kw["draft_vocab_size"] = None
    straight = small_config(tmp_path, out=str(tmp_path / "a"), **kw)
    assert train(straight)["steps"] == 6
    parts = small_config(tmp_path, out=str(tmp_path / "b"), stop_after=3, **kw)
    assert train(parts)["steps"] == 3
    summary = train(small_config(tmp_path, out=str(tmp_path / "b"), resume=True, **kw))
    assert summary["steps"] == 6 and summary["steps_this_run"] == 3
    a = torch.load(tmp_path / "a" / STATE_FILE, weights_only=True)
    b = torch.load(tmp_path / "b" / STATE_FILE, weights_only=True)
    assert a["step"] == b["step"] == 6
    for name, t in a["head"].items():
        assert torch.allclose(t.float(), b["head"][name].float(), atol=1e-6), name
    for i, st in a["optimizer"]["state"].items():
        assert torch.allclose(st["exp_avg_sq"], b["optimizer"]["state"][i]["exp_avg_sq"], atol=1e-9)
    log_a = [json.loads(x)["loss"] for x in open(tmp_path / "a" / "train_log.jsonl")]
    log_b = [json.loads(x)["loss"] for x in open(tmp_path / "b" / "train_log.jsonl")]
    assert log_a == log_b and len(log_b) == 6


def test_cli(tmp_path, capsys):
    from spruce.cli import main

    write_corpus(tmp_path / "data")
    base = ["train-draft", "--target", TARGET, "--data", str(tmp_path / "data"), "--out", str(tmp_path / "head"),
            "--device", "cpu", "--batch-size", "2", "--max-length", "32", "--ttt-length", "2", "--heldout-docs", "0"]
    assert main(base) == 2 and "--steps N or --time-budget" in capsys.readouterr().err
    assert main(base + ["--steps", "2", "--draft-vocab-size", "300"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and summary["draft_vocab_size"] == 300 and summary["draft_arch"] == "eagle3"
    assert json.loads((tmp_path / "head" / "config.json").read_text())["draft_vocab_size"] == 300
    mtp = ["--draft-arch", "mtp", "--out", str(tmp_path / "mtp"), "--steps", "1"]
    assert main(base + mtp + ["--draft-vocab-size", "300"]) == 2
    assert "--draft-vocab-size applies to --draft-arch eagle3 only" in capsys.readouterr().err
    assert not (tmp_path / "mtp").exists()  # refused before anything is loaded or written
    assert main(base + mtp) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["draft_arch"] == "mtp" and summary["draft_vocab_size"] == ModelConfig.from_dir(TARGET).vocab_size
    assert json.loads((tmp_path / "mtp" / "config.json").read_text())["num_nextn_predict_layers"] == 1


# --- --draft-arch mtp ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_mtp(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_mtp")
    write_corpus(root / "data")
    cfg = small_config(root, draft_arch="mtp", draft_vocab_size=None)
    return cfg, train(cfg)


def test_mtp_loss_goes_down(trained_mtp):
    cfg, summary = trained_mtp
    log = [json.loads(line) for line in open(f"{cfg.out}/train_log.jsonl")]
    assert [r["step"] for r in log] == list(range(1, 41)) and summary["draft_arch"] == "mtp"
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert sum(r["acc"][0] for r in log[-5:]) / 5 > 0.5
    assert summary["aux_layers"] == [] and summary["draft_vocab_size"] == ModelConfig.from_dir(TARGET).vocab_size
    accept = summary["heldout_acceptance"]  # measured by the NEXTN engine
    assert set(accept) == {f"K=1,S={TTT},N={TTT + 1}", f"K=4,S={TTT},N=16"}
    assert accept[f"K=1,S={TTT},N={TTT + 1}"]["mean_accept_length"] > 1.2


def assert_published_mtp_layout(target, out) -> None:
    """config.json = the target's plus num_nextn_predict_layers = 1; model-mtp.safetensors holds exactly the
    names and shapes mtp_checkpoint_tensors gives an MTPDraft of that config (model.layers.{L}.*), in bf16."""
    raw = json.loads((target / "config.json").read_text())
    conf = json.loads((out / "config.json").read_text())
    assert conf == {**raw, "num_nextn_predict_layers": 1}
    tc = ModelConfig.from_dir(target)
    with torch.device("meta"):
        draft = MTPDraft(tc, create_backend("torch", 1), 1, tc.num_layers)
    expected = {name: tuple(t.shape) for name, t in mtp_checkpoint_tensors(draft).items()}
    L = tc.num_layers
    assert {f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight",
            f"model.layers.{L}.eh_proj.weight"} <= set(expected)
    assert [p.name for p in out.glob("*.safetensors")] == ["model-mtp.safetensors"]
    with safe_open(str(out / "model-mtp.safetensors"), "pt") as f:
        assert {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()} == expected
        assert f.get_tensor(f"model.layers.{L}.eh_proj.weight").dtype == torch.bfloat16


def test_mtp_checkpoint_is_the_published_layout(trained_mtp):
    cfg, _ = trained_mtp
    assert_published_mtp_layout(Path(TARGET), Path(cfg.out))


def test_trained_mtp_drafts_losslessly(trained_mtp):
    cfg, _ = trained_mtp
    prompts = ["def add_7_3(a, b):\n", "class Point3:\n    x = 3\n"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(TARGET).generate(prompts, params)]
    llm = LLM(TARGET, speculative_algorithm="NEXTN", draft_model=cfg.out, speculative_num_steps=3,
              speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.5  # it learned this corpus


def assert_mtp_unroll_equals_nextn(target_dir: str, out: str) -> None:
    """The MTP head's training forward (float32 state of `out`) == spruce's NEXTN draft with those weights."""
    llm = LLM(target_dir, speculative_algorithm="NEXTN", draft_model=out, speculative_num_steps=TTT,
              speculative_eagle_topk=1, speculative_num_draft_tokens=TTT + 1, page_size=4)
    target = FrozenTarget(target_dir, "cpu", torch.float32, aux_layers=())
    head = make_mtp_head(target.config, torch.device("cpu"))
    head.load_state_dict(torch.load(f"{out}/{STATE_FILE}", weights_only=True)["head"])
    llm.engine.runner.draft.load_weights(mtp_checkpoint_tensors(head.draft).items())  # exact float32 weights
    ids = llm.tokenizer.encode(CHAIN_TEXT)
    hidden = target(torch.tensor([ids])).hidden  # the target's final normed hidden states
    with torch.no_grad():
        want = head(torch.tensor([ids]), hidden, TTT)  # TTT x [1, L, V]
    assert_unroll_equals_engine(llm, ids, hidden[0], want)


def test_mtp_training_forward_equals_inference_draft(trained_mtp):
    """Step 0 == NEXTN's draft extend (pairs of the target's final normed hidden at p and token p+1), step k ==
    NEXTN's k-th draft step of a chain (the layer's own previous output as feature), MHA target."""
    assert_mtp_unroll_equals_nextn(TARGET, trained_mtp[0].out)


def test_trains_an_mtp_layer_for_a_deepseek_target(tmp_path):
    """--draft-arch mtp with an MLA + MoE target (the pycode-mla fixture, whose own MTP layer is ignored): the
    published layout, the training forward == NEXTN's draft (MLA chain attention, MoE), lossless serving."""
    target = PYCODE_MLA
    if not (target / "config.json").exists():
        pytest.skip(f"fixture model not found at {target}")
    write_corpus(tmp_path / "data")
    cfg = small_config(tmp_path, target=str(target), draft_arch="mtp", draft_vocab_size=None, steps=2, batch_size=2,
                       max_length=48, heldout_docs=0)
    assert train(cfg)["steps"] == 2
    assert_published_mtp_layout(target, Path(cfg.out))
    assert_mtp_unroll_equals_nextn(str(target), cfg.out)
    prompts = ["def add_3_4(a, b):\n", "class Point7:\n"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target)).generate(prompts, params)]
    llm = LLM(str(target), speculative_algorithm="NEXTN", draft_model=cfg.out, speculative_num_steps=3,
              speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain


def test_mtp_gradients_reach_every_parameter_through_triton_dispatch():
    """On CUDA spruce's fused ops run Triton kernels, which have no backward: the MTP head's forward must switch
    them to their torch references, or every parameter but shared_head.head silently gets no gradient. Runs
    where Triton's CPU interpreter is on (the full suite turns it on), forcing the kernels as CUDA would."""
    import spruce.ops.fused as fused
    from spruce.ops.triton_support import interpreter_on

    if not (fused.HAS_TRITON and interpreter_on()):
        pytest.skip("needs Triton with TRITON_INTERPRET=1")
    target = FrozenTarget(TARGET, "cpu", torch.float32, aux_layers=())
    ids = torch.randint(0, target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    head = make_mtp_head(target.config, torch.device("cpu"))
    fused._FORCE_TRITON[0] = True
    try:
        sum(lg.pow(2).mean() for lg in head(ids, target(ids).hidden, 2)).backward()
    finally:
        fused._FORCE_TRITON[0] = False
    assert [n for n, p in head.named_parameters() if p.grad is None or not p.grad.any()] == []
