#!/usr/bin/env bash
# Latency benchmarks on the device (results JSON under $OUT): Llama-3.1-8B shape with random weights
# (plain vs EAGLE-3 K=8,S=6,N=32, HBM roofline measured in the same run) and pycode-19m side by side with
# transformers' generate. Usage: DRAFT19=path bash bench/device_bench.sh
set -u
. bench/device_env.sh
M19=$PWD/.carry/models/pycode-19m
if [ "${DRAFT19:-}" = "random" ]; then  # an untrained EAGLE-3 head: measures overheads, not speedups
  DRAFT19=/tmp/pycode-19m-random-eagle3
  python3 -c "import sys; sys.path.insert(0, 'tests'); from checkpoints import write_eagle3_checkpoint as w; w('$DRAFT19', '$M19', seed=7)"
fi
timeout ${B8_TIMEOUT:-240} python3 -m spruce.cli bench latency --model-shape llama-3.1-8b --batch-sizes 1 \
  --input-len 128 --output-len 64 --spec 6,8,32 --out-dir "$OUT" 2>&1 | grep -v Warning | tail -6
if [ -n "${DRAFT19:-}" ]; then
  timeout ${B19_TIMEOUT:-240} python3 -m spruce.cli bench latency --model "$M19" --draft "$DRAFT19" \
    --batch-sizes 1 16 --input-len 128 --output-len 128 --spec 5,1,6 5,4,16 6,8,32 --graphs on off --compare-hf \
    --prompts "$M19/heldout_prompts.jsonl" --out-dir "$OUT" 2>&1 | grep -v Warning | tail -20
fi
