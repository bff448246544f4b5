"""`spruce train-draft`: loss goes down on a toy corpus; the head loads in spruce and drafts losslessly;
the training module's forward equals spruce's inference draft on the same weights."""

from __future__ import annotations

import json

import pytest
import torch

from spruce import LLM, SamplingParams
from spruce.config import builtin_model_path
from spruce.train.trainer import TrainConfig, train
from spruce.train.vocab import build_draft_vocab

TARGET = str(builtin_model_path())
CORPUS = "\n".join(f"def add_{i}(a, b):\n    return a + b + {i}\n\n\nclass Point{i}:\n    x = {i}\n    y = {i + 1}\n"
                   for i in range(60))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    (root / "toy.py").write_text(CORPUS)
    cfg = TrainConfig(target=TARGET, data=[str(root / "toy.py")], out=str(root / "head"), steps=30,
                      draft_vocab_size=600, ttt_length=3, lr=2e-3, batch_size=2, max_length=48,
                      show_progress=False)
    return root, cfg, train(cfg)


def test_loss_goes_down(trained):
    _, cfg, summary = trained
    log = [json.loads(line) for line in open(f"{cfg.out}/train_log.jsonl")]
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert summary["steps"] == 30 and last < 0.7 * first, (first, last)
    assert log[-1]["acc"][0] > log[0]["acc"][0]


def test_checkpoint_format(trained):
    from safetensors import safe_open

    _, cfg, _ = trained
    conf = json.loads(open(f"{cfg.out}/config.json").read())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["draft_vocab_size"] == 600
    with safe_open(f"{cfg.out}/model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.input_layernorm.weight",
                "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
                *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    assert names == expected


def test_trained_head_drafts_losslessly(trained):
    _, cfg, _ = trained
    prompts = ["def add_7(a, b):\n", "class Point3:\n    x = 3\n"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(TARGET).generate(prompts, params)]
    llm = LLM(TARGET, draft_model=cfg.out, speculative_num_steps=3, speculative_eagle_topk=2,
              speculative_num_draft_tokens=6)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats()["spec"]["mean_accept_length"] > 1.2  # it learned something about this corpus


def test_training_module_equals_inference_draft(trained):
    """Step 0 of the dense training forward == spruce's paged EAGLE-3 draft on the saved weights."""
    from spruce.train.head import Eagle3Head  # noqa: F401
    from spruce.train.target import TargetFeatures
    from spruce.train.trainer import make_head

    _, cfg, _ = trained
    llm = LLM(TARGET, draft_model=cfg.out, speculative_num_steps=2, speculative_eagle_topk=2,
              speculative_num_draft_tokens=3, page_size=4)
    r = llm.engine.runner
    tf = TargetFeatures(TARGET, "cpu", torch.float32, 1, 64)
    head = make_head(tf, torch.zeros(600, dtype=torch.int64), torch.zeros(4096, dtype=torch.bool))
    state = torch.load(f"{cfg.out}/trainer_state.pt")["fp32"]
    head.load_state_dict(state)
    r.draft.load_weights(list(state.items()))  # the exact float32 weights (the checkpoint is stored in bf16)
    ids = list(range(40, 70))
    aux, _ = tf([ids])
    want = head(r.target.embed_tokens, torch.tensor([ids]), aux, 1)[0][0]  # [L, Vd]
    row = r.page_table.alloc_row()
    r.page_table.append_pages(row, r.allocator.alloc(r.limits.pages_for(len(ids))))
    batch = r.builder.extend([row], [0], [ids[1:] + [0]])
    got = r.draft.compute_logits(r.draft_forward(batch, aux[0]))
    r.allocator.free(r.page_table.release_row(row))
    assert (got - want).abs().max().item() < 1e-3


def test_draft_vocab_and_resume(trained, tmp_path):
    d2t, t2d = build_draft_vocab([[5, 5, 5, 9, 9, 2]], 20, 4)
    keep = (torch.arange(4) + d2t).tolist()
    assert keep == [0, 2, 5, 9] and t2d.sum() == 4 and t2d[keep].all()
    root, cfg, _ = trained
    more = TrainConfig(**{**cfg.__dict__, "steps": 32, "resume": True})
    assert train(more)["steps"] == 32
