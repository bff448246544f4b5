#!/usr/bin/env bash
# DeepSeek-target run on the device. Usage (repo root; .carry/models/pycode-mla = the fixture without its MTP
# shard; wheels in .whl): bash bench/device_deepseek.sh tests|sanitize|latency
#   tests     GPU tests: MLA kernel and fused MoE vs torch at real shapes, graphs == eager, Triton == torch,
#             bf16 spec vs plain (near-tie gaps in gpu_report.json)
#   sanitize  compute-sanitizer memcheck: page 64 + topk 8 and page 4 + topk 8 with graphs and overlap
#   latency   spruce bench latency --model-shape deepseek-v2-lite (random weights): decode step vs the roofline
#             of the bytes a step reads, measured copy bandwidth, speculative round ratio, same run
set -u
. bench/device_env.sh
export SPRUCE_PYCODE_MLA=$PWD/.carry/models/pycode-mla
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
case "${1:-tests}" in
tests)
  SPRUCE_GPU_REPORT=$OUT/gpu_report.json timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/test_triton_mla.py tests/test_moe.py tests/test_gpu_deepseek.py --durations=10 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -40 ;;
sanitize)
  timeout ${SAN_TIMEOUT:-540} compute-sanitizer --tool memcheck --print-limit 20 python3 bench/sanitize_run.py \
    "$SPRUCE_PYCODE_MLA" > "$OUT/sanitizer_mla.log" 2>&1
  echo "sanitizer exit $?"; tail -15 "$OUT/sanitizer_mla.log" ;;
latency)
  timeout ${BENCH_TIMEOUT:-560} python3 -m spruce.cli bench latency --model-shape deepseek-v2-lite \
    --batch-sizes 1 16 --spec 5,4,8 --input-len 128 --output-len 64 --num-prompts 16 --repeats 2 \
    --out-dir "$OUT" 2>&1 | tee "$OUT/latency.log" | grep -v Warning | tail -20 ;;
esac
