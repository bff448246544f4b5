#!/usr/bin/env bash
# DeepSeek-target run on the device. Usage (repo root; .carry/models/pycode-mla = a copy of the fixture; wheels
# in .whl): bash bench/device_deepseek.sh tests|sanitize|nextn|latency [more modes...]
#   tests     GPU tests: MLA kernel and fused MoE vs torch at real shapes, graphs == eager, Triton == torch,
#             bf16 spec vs plain (near-tie gaps in gpu_report.json)
#   sanitize  compute-sanitizer memcheck: page 64 + topk 8 and page 4 + topk 8 with graphs and overlap,
#             EAGLE-3 and NEXTN drafts
#   nextn     plain vs NEXTN accept lengths and tokens/s at bs 1 and 16 on held-out prompts
#   latency   spruce bench latency --model-shape deepseek-v2-lite (random weights): decode step vs the roofline
#             of the bytes a step reads, measured copy bandwidth, speculative round ratio, same run
set -u
. bench/device_env.sh
export SPRUCE_PYCODE_MLA=$PWD/.carry/models/pycode-mla
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
for mode in "${@:-tests}"; do
case "$mode" in
tests)
  SPRUCE_GPU_REPORT=$OUT/gpu_report.json timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider \
    -m gpu ${TEST_FILES:-tests/test_triton_mla.py tests/test_moe.py tests/test_gpu_deepseek.py} --durations=10 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -40 ;;
sanitize)  # EAGLE-3 (random head) and NEXTN (the fixture's own MTP layer), page 64 and 4, topk 8, graphs
  for draft in "" NEXTN; do
    timeout ${SAN_TIMEOUT:-270} compute-sanitizer --tool memcheck --print-limit 20 python3 bench/sanitize_run.py \
      "$SPRUCE_PYCODE_MLA" $draft > "$OUT/sanitizer_mla${draft:+_$draft}.log" 2>&1
    echo "sanitizer ${draft:-EAGLE3} exit $?"; tail -8 "$OUT/sanitizer_mla${draft:+_$draft}.log"
  done ;;
nextn)  # accept lengths and tokens/s, plain vs NEXTN, bs 1 and 16, graphs, held-out prompts, one run
  timeout ${BENCH_TIMEOUT:-400} python3 -m spruce.cli bench latency --model "$SPRUCE_PYCODE_MLA" \
    --speculative-algorithm NEXTN --spec 1,1,2 3,1,4 3,4,8 --batch-sizes 1 16 --input-len 256 --output-len 128 \
    --prompts "$SPRUCE_PYCODE_MLA/heldout_prompts.jsonl" --num-prompts 32 --repeats 2 --out-dir "$OUT" 2>&1 \
    | tee "$OUT/nextn.log" | grep -v Warning | tail -12 ;;
latency)
  timeout ${BENCH_TIMEOUT:-560} python3 -m spruce.cli bench latency --model-shape deepseek-v2-lite \
    --batch-sizes 1 16 --spec 5,4,8 --input-len 128 --output-len 64 --num-prompts 16 --repeats 2 \
    --out-dir "$OUT" 2>&1 | tee "$OUT/latency.log" | grep -v Warning | tail -20 ;;
esac
done
