#!/usr/bin/env bash
# Issue 16's serving bar on the device: pycode-19m served plain, with a fixed EAGLE-3 (S, K, N) = (5, 4, 8) and
# with adaptive speculation over the same (5, 4, 8), each with and without the prefix cache; every request is one
# shared 1024-token prefix + its own 256-token held-out prompt; concurrency 1, 8, 32, 64. One result JSON (+ PNG
# and the server logs) under $OUT. Adaptive must never be slower than the better of plain and fixed at any level.
# Usage (repo root, fixture model in .carry/models/pycode-19m): SPRUCE_GIT_COMMIT=<sha> bash bench/device_serving_prefix.sh
set -u
. bench/device_env.sh
M19=$PWD/.carry/models/pycode-19m
D19=$PWD/bench/assets/pycode-19m-eagle3
FIXED="--speculative-algorithm EAGLE3 --speculative-draft-model-path $D19 --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
timeout ${BENCH_TIMEOUT:-570} python3 -m spruce.cli bench serving \
  --server-args "--model $M19 --max-running-requests 64 --cuda-graph-max-bs 64" \
  --launch "plain=" --launch "fixed=$FIXED" --launch "adaptive=$FIXED --speculative-adaptive" --compare-prefix-cache \
  --shared-prefix-tokens 1024 --prompt-tokens 256 --max-tokens 128 --concurrency 1 8 32 64 --num-requests 64 \
  --prompts "$M19/heldout_prompts.jsonl" --tokenizer "$M19" --out-dir "$OUT" 2>&1 | tail -60
for f in "$OUT"/server-logs/*.log; do echo "== $f"; grep -iE "error|traceback" "$f" | head -5; done
ls -la "$OUT"
