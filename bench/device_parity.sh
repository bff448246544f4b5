#!/usr/bin/env bash
# `spruce bench parity` on the device: pycode-19m with its trained EAGLE-3 head, bf16, CUDA graphs on,
# 16 held-out prompts x 96 greedy tokens, plain vs K=1 S=5 N=6, K=4 S=5 N=16, K=8 S=6 N=32 at page sizes
# 1, 16, 64; every divergence is checked for a near-tie (results JSON under $OUT/parity-*.json).
# Usage (repo root, fixture model in .carry/models/pycode-19m): bash bench/device_parity.sh
set -u
. bench/device_env.sh
M19=$PWD/.carry/models/pycode-19m
D19=$PWD/bench/assets/pycode-19m-eagle3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/parity-device.txt"
timeout ${PARITY_TIMEOUT:-540} python3 -m spruce.cli bench parity --model "$M19" --draft "$D19" \
  --prompts "$M19/heldout_prompts.jsonl" --num-prompts 16 --max-tokens 96 --prompt-tokens 128 \
  --spec 5,1,6 5,4,16 6,8,32 --page-sizes 1,16,64 --device cuda --dtype bfloat16 --cuda-graph \
  --out "$OUT/parity-bf16-graphs.json" 2>&1 | grep -v Warning | tee "$OUT/parity.log" | tail -40
echo "parity exit ${PIPESTATUS[0]} (0: identical or near-ties, 1: a divergence that is not a near-tie)"
