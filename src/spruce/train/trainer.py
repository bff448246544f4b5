"""Training a draft head against a frozen target, with training-time test (TTT) unrolling.

Recipe (EAGLE-3 / SpecForge): for every window the frozen target yields its features and next-token
distributions; the head is unrolled `ttt_length` steps on its own hidden states and each step is trained with
soft cross-entropy against the target's distribution restricted to the draft vocabulary (positions whose
target argmax lies outside it are skipped), weighted 0.8**k. Its labels are the target's predictions, never
the data's next tokens. AdamW, linear warm-up, cosine decay to `min_lr_ratio`, gradient clipping at 1. bf16
autocast on CUDA; the head's weights and optimizer stay float32.

draft_arch "eagle3" (head.py): an EAGLE-3 head reading the target's aux states, over a draft vocabulary.
draft_arch "mtp" (mtp_head.py): one MTP layer of the target's own layer kind (served as NEXTN), reading the
target's final normed hidden state, over the full target vocabulary (every position scored).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from spruce.errors import SpruceError
from spruce.models.tokenizer import Tokenizer
from spruce.train.checkpoint import (STATE_FILE, load_state, make_head, save_checkpoint, save_mtp_checkpoint,
                                     save_state)
from spruce.train.data import PackedWindows, load_documents, split_heldout, tokenize_documents
from spruce.train.evaluate import acceptance, chain_and_tree
from spruce.train.head import Eagle3Head
from spruce.train.mtp_head import MTPHead, init_mtp_head, make_mtp_head
from spruce.train.target import FrozenTarget
from spruce.train.vocab import build_draft_vocab, draft_ids

logger = logging.getLogger("spruce")
STEP_DECAY = 0.8  # loss weight of unroll step k is STEP_DECAY**k
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DRAFT_ARCHS = ("eagle3", "mtp")


@dataclass
class TrainConfig:
    """One train-draft run. `steps` and `time_budget` (training seconds, summed over resumed runs) both end
    it, whichever comes first, and set the learning-rate schedule's length; `stop_after` ends this
    invocation early at that step without changing the schedule (continue with resume=True)."""

    target: str
    data: list[str]
    out: str
    steps: int | None = None
    time_budget: float | None = None
    stop_after: int | None = None
    draft_arch: str = "eagle3"  # or "mtp": one MTP layer, served as speculative_algorithm="NEXTN"
    draft_vocab_size: int | None = None  # eagle3 only
    ttt_length: int = 7
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    batch_size: int = 16
    max_length: int = 512
    device: str = "cpu"
    dtype: str = "float32"  # the frozen target's dtype
    seed: int = 0
    resume: bool = False
    save_every: int = 500
    heldout_docs: int = 8  # documents kept out of training; the final acceptance estimate runs on them
    eval_max_tokens: int = 64
    show_progress: bool = True


def init_head(head: Eagle3Head, target: FrozenTarget, d2t: torch.Tensor, t2d: torch.Tensor, seed: int) -> None:
    """Random matrices (std 0.02), unit norms, and a warm start of the output side: lm_head = the target's
    output rows of the draft vocabulary, norm = the target's final norm."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        head.lm_head.weight.copy_(target.output_weight[draft_ids(d2t).to(target.device)].float().cpu())
        head.norm.weight.copy_(target.model.norm.weight.float().cpu())
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)


def target_distribution(logits: torch.Tensor, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
    """Target logits [B, L, V] -> (probabilities over the draft vocabulary [B, L, Vd] float32, valid [B, L]:
    the target's argmax is in the draft vocabulary). No d2t / t2d: the full vocabulary, every position valid."""
    if d2t is None:
        return logits.float().softmax(-1), torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device)
    valid = t2d[logits.argmax(-1)]
    return logits[..., draft_ids(d2t)].float().softmax(-1), valid


def ttt_loss(step_logits: list[torch.Tensor], target_p: torch.Tensor, valid: torch.Tensor):
    """Weighted soft cross-entropy over the unroll steps -> (loss, [accuracy of step k] as 0-dim tensors).

    Step k's logits at index p predict token p+k+2, i.e. target_p[:, p+k+1]; the last k+1 indices are unscored.
    Accuracy: draft argmax == target argmax, over the valid positions."""
    length = target_p.shape[1]
    total = target_p.new_zeros(())
    accs = []
    for k, lg in enumerate(step_logits):
        n = length - k - 1
        if n <= 0:
            break
        p, v = target_p[:, k + 1:], valid[:, k + 1:]  # [B, n, Vd], [B, n]
        logq = lg[:, :n].float().log_softmax(-1)
        ce = -(p * logq).sum(-1)  # [B, n]
        denom = v.sum().clamp(min=1)
        total = total + STEP_DECAY ** k * (ce * v).sum() / denom
        accs.append(((logq.argmax(-1) == p.argmax(-1)) & v).sum() / denom)
    return total, accs


def learning_rate(cfg: TrainConfig, step: int, seconds: float) -> float:
    """Warm-up over `warmup_steps`, then cosine from lr to lr*min_lr_ratio over the run's length."""
    progress = 0.0
    if cfg.steps:
        progress = max(progress, step / cfg.steps)
    if cfg.time_budget:
        progress = max(progress, seconds / cfg.time_budget)
    cosine = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps)) * cosine


def train_step(head: Eagle3Head | MTPHead, target: FrozenTarget, opt: torch.optim.Optimizer, ids: torch.Tensor,
               ttt_length: int, lr: float) -> list[float]:
    """One optimizer step on windows ids [B, L] -> [loss, accuracy of each unroll step] (one host sync)."""
    aux, hidden, target_logits = target(ids)
    mtp = isinstance(head, MTPHead)
    target_p, valid = target_distribution(target_logits, *(() if mtp else (head.d2t, head.t2d)))
    del target_logits
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
        if mtp:
            step_logits = head(ids, hidden, ttt_length)
        else:
            step_logits = head(target.model.embed_tokens.weight, ids, aux, ttt_length)
    loss, accs = ttt_loss(step_logits, target_p, valid)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    return torch.stack([loss.detach(), *accs]).tolist()


def train(cfg: TrainConfig) -> dict:
    """Train (or resume) the head described by `cfg`; writes the checkpoint, train_log.jsonl and
    train_summary.json under cfg.out and returns the summary (with the held-out acceptance estimate)."""
    if cfg.draft_arch not in DRAFT_ARCHS:
        raise SpruceError(f"unknown draft architecture {cfg.draft_arch!r}; choose one of {', '.join(DRAFT_ARCHS)}")
    mtp = cfg.draft_arch == "mtp"
    if mtp and cfg.draft_vocab_size is not None:
        raise SpruceError("--draft-vocab-size applies to --draft-arch eagle3 only: an MTP layer predicts over the "
                          "full target vocabulary (its shared_head is the target's lm_head shape)")
    if cfg.steps is None and cfg.time_budget is None:
        raise SpruceError("give --steps N or --time-budget SECONDS")
    if cfg.ttt_length < 1 or cfg.max_length < cfg.ttt_length + 2:
        raise SpruceError(f"need ttt_length >= 1 and max_length >= ttt_length + 2, got {cfg.ttt_length}, "
                          f"{cfg.max_length}")
    t_setup = time.perf_counter()
    torch.manual_seed(cfg.seed)
    out, device = Path(cfg.out), torch.device(cfg.device)
    out.mkdir(parents=True, exist_ok=True)
    target = FrozenTarget(cfg.target, device, TORCH_DTYPES[cfg.dtype], aux_layers=() if mtp else None)
    tc = target.config
    tok = Tokenizer.from_dir(cfg.target, tc)
    if tok is None:
        raise SpruceError(f"the target {cfg.target} has no tokenizer.json; train-draft needs one to read text")
    docs, held = split_heldout(load_documents(cfg.data), cfg.heldout_docs, cfg.seed)
    windows = PackedWindows(tokenize_documents(cfg.target, tok, docs), cfg.max_length, cfg.seed)
    if mtp:
        head, vocab = make_mtp_head(tc, device), tc.vocab_size
        init_mtp_head(head, target, cfg.seed)

        def save():
            save_mtp_checkpoint(head, cfg.target, out)
    else:
        d2t, t2d = build_draft_vocab(windows.windows, tc.vocab_size, cfg.draft_vocab_size)
        head, vocab = make_head(tc, len(target.aux_layers), len(d2t)), len(d2t)
        init_head(head, target, d2t, t2d, cfg.seed)
        head.to(device)

        def save():
            save_checkpoint(head, tc, out)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    settings = {"target": str(cfg.target), "draft_arch": cfg.draft_arch, "target_vocab_size": tc.vocab_size,
                "target_hidden_size": tc.hidden_size, "draft_vocab_size": vocab, "max_length": windows.length,
                "batch_size": cfg.batch_size, "ttt_length": cfg.ttt_length, "seed": cfg.seed,
                "heldout_docs": cfg.heldout_docs}
    step, seconds = 0, 0.0
    log_path = out / "train_log.jsonl"
    if cfg.resume and (out / STATE_FILE).exists():
        step, seconds = load_state(out, head, opt, settings)
    else:
        if cfg.resume:
            logger.warning("train-draft: nothing to resume in %s (no %s); starting from scratch", out, STATE_FILE)
        log_path.unlink(missing_ok=True)
    setup_s = time.perf_counter() - t_setup
    on_cuda = device.type == "cuda"
    bar = tqdm(total=cfg.steps, initial=step, disable=not cfg.show_progress, desc="train-draft", unit="step")
    start_step, first, last = step, None, None
    with log_path.open("a") as log:
        while not ((cfg.steps and step >= cfg.steps) or (cfg.stop_after is not None and step >= cfg.stop_after)
                   or (cfg.time_budget and seconds >= cfg.time_budget)):
            t0 = time.perf_counter()
            ids = windows.batch(step, cfg.batch_size).to(device, non_blocking=True)  # [B, L]
            lr = learning_rate(cfg, step, seconds)
            values = train_step(head, target, opt, ids, cfg.ttt_length, lr)
            step += 1
            dt = time.perf_counter() - t0
            seconds += dt
            first = values[0] if first is None else first
            last = values[0]
            record = {"step": step, "loss": round(values[0], 5), "acc": [round(a, 4) for a in values[1:]],
                      "lr": lr, "tokens_per_s": round(ids.numel() / dt), "seconds": round(seconds, 2)}
            log.write(json.dumps(record) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{values[0]:.3f}", acc=" ".join(f"{a:.2f}" for a in values[1:]),
                            tok_s=f"{record['tokens_per_s'] / 1e3:.0f}k")
            if step % cfg.save_every == 0:
                log.flush()
                save_state(out, head, opt, step, seconds, settings)
                save()
    bar.close()
    save_state(out, head, opt, step, seconds, settings)
    save()
    summary = {"steps": step, "steps_this_run": step - start_step, "first_loss": first, "last_loss": last,
               "train_seconds": round(seconds, 1), "setup_seconds": round(setup_s, 1),
               "train_tokens": windows.num_tokens, "windows": len(windows), "window_length": windows.length,
               "epochs": round(step * cfg.batch_size / len(windows), 3), "draft_arch": cfg.draft_arch,
               "draft_vocab_size": vocab, "aux_layers": list(target.aux_layers), "heldout_docs": len(held),
               "config": asdict(cfg)}
    if held:
        del head, opt, target, save
        prompts = [tok.encode(t)[:128] for t in held]
        summary["heldout_acceptance"] = acceptance(
            cfg.target, str(out), prompts, chain_and_tree(min(5, cfg.ttt_length)), cfg.device,
            "bfloat16" if on_cuda else "float32", max_tokens=cfg.eval_max_tokens,
            algorithm="NEXTN" if mtp else "EAGLE3")
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
