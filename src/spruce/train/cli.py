"""`spruce train-draft`: train an EAGLE-3 head for a Llama-family target."""

from __future__ import annotations

import json


def add_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE-3 draft head for a target model")
    p.add_argument("--target", required=True, help="HF target model directory")
    p.add_argument("--data", nargs="+", required=True, help="text/.py files, JSONL ({'text'}) or directories")
    p.add_argument("--out", required=True, help="output directory (EAGLE-3 checkpoint)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=None, help="seconds")
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", help="target dtype (the head trains in float32, bf16 autocast on GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from spruce.errors import SpruceError
    from spruce.train.trainer import TrainConfig, train

    if args.steps is None and args.time_budget is None:
        raise SpruceError("give --steps N or --time-budget SECONDS")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(target=args.target, data=args.data, out=args.out, steps=args.steps,
                      time_budget=args.time_budget, draft_vocab_size=args.draft_vocab_size, ttt_length=args.ttt_length,
                      lr=args.lr, batch_size=args.batch_size, max_length=args.max_length, device=device,
                      dtype=args.dtype, seed=args.seed, resume=args.resume)
    print(json.dumps(train(cfg), indent=2))
    return 0
