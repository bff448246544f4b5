"""`spruce train-draft`: train a draft for a target on plain text / source / JSONL: an EAGLE-3 head (default) or
one MTP layer (--draft-arch mtp, served as speculative_algorithm="NEXTN")."""

from __future__ import annotations

import argparse
import json


def add_parser(sub, add_engine_args) -> None:
    """Register `train-draft` on the `spruce` subcommand parser (its flags are its own, not the engine's)."""
    p = sub.add_parser(
        "train-draft", help="train an EAGLE-3 draft head (or an MTP layer) for a target model",
        description="Train an EAGLE-3 head (published LlamaForCausalLMEagle3 format) or one MTP layer (DeepSeek's "
                    "published layout, served with --speculative-algorithm NEXTN --speculative-draft-model-path "
                    "OUT) to match a frozen target's next-token distributions, with training-time-test unrolling.")
    p.add_argument("--target", required=True, help="HF target model directory (config, safetensors, tokenizer.json)")
    p.add_argument("--data", nargs="+", required=True,
                   help="text/.py files (one document each), JSONL files ({\"text\": ...} per line) or directories")
    p.add_argument("--out", required=True, help="output directory: the draft checkpoint, logs, trainer state")
    p.add_argument("--draft-arch", choices=["eagle3", "mtp"], default="eagle3",
                   help="eagle3: an EAGLE-3 head (LlamaForCausalLMEagle3); mtp: one MTP layer of the target's own "
                        "layer kind, saved as the target's config + model-mtp.safetensors (NEXTN)")
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps")
    p.add_argument("--time-budget", type=float, default=None, help="total training seconds (over resumed runs)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="end this run at step N without shortening the schedule (continue with --resume)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="eagle3 only: the V most frequent target tokens of the data (default: the full target "
                        "vocabulary)")
    p.add_argument("--ttt-length", type=int, default=7, help="training-time-test unroll steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=16, help="windows per step")
    p.add_argument("--max-length", type=int, default=512, help="tokens per window")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the frozen target's dtype (default: bfloat16 on cuda, float32 on cpu); the head trains "
                        "in float32 with bf16 autocast on cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the trainer state saved in --out")
    p.add_argument("--save-every", type=int, default=500, help="steps between saved states")
    p.add_argument("--heldout-docs", type=int, default=8,
                   help="documents kept out of training for the final acceptance estimate (0: none)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Train, then print the summary (steps, losses, held-out mean accept length) as JSON."""
    import torch

    from spruce.train.trainer import TrainConfig, train

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    cfg = TrainConfig(target=args.target, data=args.data, out=args.out, steps=args.steps,
                      time_budget=args.time_budget, stop_after=args.stop_after, draft_arch=args.draft_arch,
                      draft_vocab_size=args.draft_vocab_size, ttt_length=args.ttt_length, lr=args.lr,
                      warmup_steps=args.warmup_steps, batch_size=args.batch_size, max_length=args.max_length,
                      device=device, dtype=dtype, seed=args.seed, resume=args.resume, save_every=args.save_every,
                      heldout_docs=args.heldout_docs)
    summary = train(cfg)
    summary.pop("config")
    print(json.dumps(summary, indent=2))
    return 0
