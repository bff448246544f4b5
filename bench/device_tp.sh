#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (nvidia-h200-x2): NCCL, CUDA graphs with the collectives inside them.
#   (a) tp2 vs tp1 greedy match rate in bf16 on pycode-19m, top-2 gaps at every divergence (tp-parity)
#   (b) Llama-3.1-8B shape (random bf16 weights made on the GPUs): plain decode step at tp1 and tp2, next to the
#       roofline of bytes one GPU reads / copy bandwidth, and the collectives a step pays (measured alone)
#   (c) Llama-3.1-70B shape (random bf16, 141 GB: does not fit one GPU): tp2 plain decode and the EAGLE-3 round
#       (K=8, S=6, N=32: --spec 6,8,32) ratio, with the same roofline and collectives
#   and the GPU test (tp2 == tp1 in float32 under CUDA graphs).
# Results JSON under $OUT (bench/results/ layout). Usage (repo root, fixture in .carry/models/pycode-19m):
#   SPRUCE_GIT_COMMIT=<literal sha> MODE="parity 8b" bash bench/device_tp.sh   (2 GPUs count in full: split the modes)
set -u
. bench/device_env.sh
export NCCL_NVLS_ENABLE=0
M19=$PWD/.carry/models/pycode-19m
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/tp-device.txt"
# MODE (space separated; default all): parity 8b 70b test. Each fits one 600 s device call on its own.
for mode in ${MODE:-parity 8b 70b test}; do
  SECONDS=0
  case $mode in
    parity) timeout 300 python3 -m spruce.cli bench tp-parity --model "$M19" --prompts "$M19/heldout_prompts.jsonl" \
              --tp-size 2 --num-prompts 16 --max-tokens 96 --prompt-tokens 128 --device cuda --dtype bfloat16 \
              --cuda-graph --out-dir "$OUT" 2>&1 | grep -v Warning | tee "$OUT/tp-parity.log" | tail -20 ;;
    8b) timeout 560 python3 -m spruce.cli bench latency --model-shape llama-3.1-8b --tp-size 1 2 --batch-sizes 1 8 32 \
          --input-len 512 --output-len 128 --num-prompts 8 --spec --device cuda --dtype bfloat16 --repeats 2 \
          --out-dir "$OUT" 2>&1 | grep -v Warning | tee "$OUT/tp-latency-8b.log" | tail -12 ;;
    70b) timeout 560 python3 -m spruce.cli bench latency --model-shape llama-3.1-70b --tp-size 2 --batch-sizes 1 8 \
           --input-len 512 --output-len 64 --num-prompts 8 --spec 6,8,32 --device cuda --dtype bfloat16 --repeats 1 \
           --out-dir "$OUT" 2>&1 | grep -v Warning | tee "$OUT/tp-latency-70b.log" | tail -12 ;;
    test) SPRUCE_PYCODE_19M=$M19 SPRUCE_PYCODE_MLA=$PWD/.carry/models/pycode-mla timeout 560 \
            python3 -m pytest -q -m gpu tests/test_gpu_tp.py 2>&1 | tail -5 ;;
  esac
  echo "[mode $mode: ${SECONDS}s]"
done
