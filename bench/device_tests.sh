#!/usr/bin/env bash
# GPU test run on the device: kernels vs torch at real shapes, graphs vs eager, bf16 spec match, sanitizer.
# Usage (repo root, fixture model in .carry/models/pycode-19m, wheels in .whl): bash bench/device_tests.sh
# (test_engine_on_triton_equals_torch needs the bundled model, which stays behind to fit the 64 MiB upload;
# CI runs it through the Triton interpreter.)
set -u
. bench/device_env.sh
export SPRUCE_PYCODE_19M=$PWD/.carry/models/pycode-19m
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/device.txt"
SPRUCE_GPU_REPORT=$OUT/gpu_report.json timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider \
  tests/test_fused_ops.py tests/test_frontier.py tests/test_triton_attention.py tests/test_gpu.py \
  --deselect tests/test_triton_attention.py::test_engine_on_triton_equals_torch 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -40
timeout ${SAN_TIMEOUT:-180} compute-sanitizer --tool memcheck --print-limit 20 python3 bench/sanitize_run.py \
  "$SPRUCE_PYCODE_19M" "$PWD/bench/assets/pycode-19m-eagle3" > "$OUT/sanitizer.log" 2>&1
echo "sanitizer exit $?"; tail -15 "$OUT/sanitizer.log"
