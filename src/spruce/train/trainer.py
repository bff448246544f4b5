"""Training loop for an EAGLE-3 head: match the frozen target's next-token distributions with TTT unrolling."""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from spruce.models.tokenizer import Tokenizer
from spruce.train.data import load_documents, token_chunks
from spruce.train.head import Eagle3Head
from spruce.train.target import TargetFeatures
from spruce.train.vocab import build_draft_vocab

STEP_DECAY = 0.8  # loss weight of unroll step k is 0.8**k (as in EAGLE-3 / SpecForge)


@dataclass
class TrainConfig:
    target: str
    data: list[str]
    out: str
    steps: int | None = None
    time_budget: float | None = None  # seconds
    draft_vocab_size: int | None = None
    ttt_length: int = 7
    lr: float = 3e-4
    batch_size: int = 8
    max_length: int = 512
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    resume: bool = False
    save_every: int = 200
    show_progress: bool = True


def make_head(tf: TargetFeatures, d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3Head:
    c = tf.config
    head = Eagle3Head(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                      c.hidden_size, len(d2t), c.vocab_size, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
        keep = torch.arange(len(d2t)) + d2t  # warm start: the target's own output rows for the draft vocab
        weight = tf.model.embed_tokens.weight if tf.model.lm_head is None else tf.model.lm_head.weight
        head.lm_head.weight.copy_(weight[keep.to(weight.device)].float().cpu())
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head


def head_config(tf: TargetFeatures, draft_vocab: int) -> dict:
    """config.json of the published EAGLE-3 format (LlamaForCausalLMEagle3)."""
    c = tf.config
    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=c.hidden_size,
               intermediate_size=c.intermediate_size, num_attention_heads=c.num_heads,
               num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, num_hidden_layers=1,
               rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size, draft_vocab_size=draft_vocab,
               max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
               tie_word_embeddings=False, hidden_act="silu", torch_dtype="bfloat16")
    if c.rope_scaling:
        cfg["rope_scaling"] = c.rope_scaling
    return cfg


def ttt_loss(logits: list[torch.Tensor], target_logits: torch.Tensor, t2d: torch.Tensor):
    """Soft cross-entropy against the target's distribution over the draft vocabulary, per unroll step.

    Step k at index p predicts token p+k+2, i.e. the target's distribution at position p+k+1. Positions whose
    target argmax is outside the draft vocabulary are skipped. Returns (weighted loss, per-step accuracy)."""
    length = target_logits.shape[1]
    draft_ids = t2d.nonzero().squeeze(1)  # draft id -> target id
    total, accs = 0.0, []
    for k, lg in enumerate(logits):
        n = length - (k + 1)
        if n <= 0:
            break
        tgt = target_logits[:, k + 1:].float()  # [B, n, V]
        valid = t2d[tgt.argmax(-1)]  # [B, n]
        p = tgt[..., draft_ids].softmax(-1)  # [B, n, Vd]
        logp = lg[:, :n].float().log_softmax(-1)
        ce = -(p * logp).sum(-1)
        denom = valid.sum().clamp(min=1)
        total = total + STEP_DECAY ** k * (ce * valid).sum() / denom
        acc = ((lg[:, :n].argmax(-1) == p.argmax(-1)) & valid).sum() / denom
        accs.append(float(acc))
    return total, accs


def save(head: Eagle3Head, tf: TargetFeatures, out: Path, opt, step: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).cpu().contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(head_config(tf, len(head.d2t)), indent=2))
    torch.save({"step": step, "optimizer": opt.state_dict(), "fp32": head.state_dict()}, out / "trainer_state.pt")


def train(cfg: TrainConfig) -> dict:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    out = Path(cfg.out)
    tf = TargetFeatures(cfg.target, cfg.device, dtype, cfg.batch_size, cfg.max_length)
    tok = Tokenizer.from_dir(cfg.target, tf.config)
    chunks = token_chunks(tok, load_documents(cfg.data), cfg.max_length)
    d2t, t2d = build_draft_vocab(chunks, tf.config.vocab_size, cfg.draft_vocab_size)
    head = make_head(tf, d2t, t2d).to(cfg.device)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    if cfg.resume and (out / "trainer_state.pt").exists():
        state = torch.load(out / "trainer_state.pt", map_location=cfg.device)
        head.load_state_dict(state["fp32"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    embed = tf.model.embed_tokens
    t2d_dev = head.t2d
    log = (out / "train_log.jsonl")
    out.mkdir(parents=True, exist_ok=True)
    total_steps = cfg.steps or 10**9
    start, first, last = time.time(), None, None
    bar = tqdm(total=cfg.steps, disable=not cfg.show_progress, desc="train-draft", initial=step)
    while step < total_steps and (cfg.time_budget is None or time.time() - start < cfg.time_budget):
        batch = rng.sample(chunks, min(cfg.batch_size, len(chunks)))
        length = min(len(c) for c in batch)
        seqs = [c[:length] for c in batch]
        aux, tlogits = tf(seqs)
        ids = torch.tensor(seqs, device=cfg.device)
        warm = min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * warm
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=tf.device.type == "cuda"):
            logits = head(lambda t: embed(t).detach(), ids, aux.detach(), cfg.ttt_length)
            loss, accs = ttt_loss(logits, tlogits, t2d_dev)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        first = value if first is None else first
        last = value
        record = {"step": step, "loss": round(value, 5), "acc": [round(a, 4) for a in accs],
                  "tokens": len(seqs) * length, "elapsed_s": round(time.time() - start, 2)}
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{value:.3f}", acc0=f"{accs[0]:.2f}" if accs else "-",
                        acc_last=f"{accs[-1]:.2f}" if accs else "-")
        if step % cfg.save_every == 0:
            save(head, tf, out, opt, step)
    bar.close()
    save(head, tf, out, opt, step)
    summary = {"steps": step, "first_loss": first, "last_loss": last, "seconds": round(time.time() - start, 1),
               "chunks": len(chunks), "draft_vocab_size": len(d2t), "config": asdict(cfg)}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def acceptance(target: str, draft: str, prompts: list[list[int]], configs, device: str, dtype: str,
               max_tokens: int = 128) -> dict:
    """Mean accepted length (tokens per verify round, bonus included), greedy, per (K, S, N) config."""
    from spruce import LLM, SamplingParams

    result = {}
    for k, s, n in configs:
        llm = LLM(target, device=device, dtype=dtype, draft_model=draft, speculative_algorithm="EAGLE3",
                  speculative_num_steps=s, speculative_eagle_topk=k, speculative_num_draft_tokens=n,
                  max_running_requests=min(16, len(prompts)))
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        st = llm.engine.stats()["spec"]
        result[f"K={k},S={s},N={n}"] = st
        del llm
    return result
