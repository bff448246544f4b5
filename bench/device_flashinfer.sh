#!/usr/bin/env bash
# FlashInfer backend on the device (issue 14). Wheels in .whl (flashinfer-python, apache-tvm-ffi: --no-deps),
# fixture model in .carry/models/pycode-19m. Modes (MODE env, space separated):
#   phases   per-phase FlashInfer vs torch (tests/test_gpu_flashinfer.py::test_flashinfer_equals_torch_every_phase)
#   table    bench/attention_table.py -> $OUT/attention-table.json
#   engine   greedy spec == plain, graphs == eager on pycode-19m
#   auto     `auto` (the CUDA default) on pycode-19m: the H100's per-phase choice, spec == plain, a mixed
#            triton/flashinfer composite's graphs == eager (tests/test_gpu_auto.py)
#   sanitize compute-sanitizer memcheck, page 64 + topk 8 and page 4 + topk 8
#   latency  Llama-3.1-8B shape: decode at 32k context and a 16k prefill, triton vs flashinfer
#   mla      FlashInfer MLA per phase vs torch, and pycode-mla graphs == eager (fixture in .carry/models/pycode-mla)
# The JIT cache lives under FLASHINFER_WORKSPACE_BASE (carried in .carry/fi-cache when present).
set -u
. bench/device_env.sh
export SPRUCE_PYCODE_19M=$PWD/.carry/models/pycode-19m
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if [ -f .carry/fi-cache.tgz ]; then tar xzf .carry/fi-cache.tgz -C "$FLASHINFER_WORKSPACE_BASE"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch, triton, flashinfer; print("torch", torch.__version__, "triton", triton.__version__, "flashinfer", flashinfer.__version__)' 2>&1 | tail -3 | tee -a "$OUT/device.txt"
for mode in ${MODE:-phases table}; do
  SECONDS=0
  case $mode in
    phases) SPRUCE_GPU_REPORT=$OUT/gpu_report.json timeout ${PHASES_TIMEOUT:-400} python3 -m pytest -q -x -p no:cacheprovider \
              tests/test_gpu_flashinfer.py -k "${PHASES_K:-every_phase}" 2>&1 | tee "$OUT/phases.log" | tail -25 ;;
    table) timeout ${TABLE_TIMEOUT:-240} python3 bench/attention_table.py --out "$OUT/attention-table.json" \
              ${TABLE_ARGS:-} 2>&1 | tail -40 ;;
    engine) SPRUCE_GPU_REPORT=$OUT/gpu_report.json timeout ${ENGINE_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider \
              tests/test_gpu_flashinfer.py -k "${ENGINE_K:-not every_phase}" 2>&1 | tee "$OUT/engine.log" | tail -25 ;;
    auto) SPRUCE_GPU_REPORT=$OUT/gpu_report.json timeout ${AUTO_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider \
              tests/test_gpu_auto.py 2>&1 | tee "$OUT/auto.log" | tail -25 ;;
    mla) SPRUCE_PYCODE_MLA=$PWD/.carry/models/pycode-mla SPRUCE_GPU_REPORT=$OUT/gpu_report.json \
           timeout ${MLA_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_flashinfer.py -k mla 2>&1 \
           | tee "$OUT/mla.log" | tail -25 ;;
    sanitize) SANITIZE_BACKEND=flashinfer timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool memcheck --print-limit 20 \
              python3 bench/sanitize_run.py "$SPRUCE_PYCODE_19M" > "$OUT/sanitizer.log" 2>&1
              echo "sanitizer exit $?"; tail -12 "$OUT/sanitizer.log" ;;
    latency) for be in ${LAT_BACKENDS:-flashinfer triton}; do
               timeout ${LAT_TIMEOUT:-200} python3 -m spruce.cli bench latency --model-shape llama-3.1-8b --batch-sizes 1 \
                 --input-len ${LAT_INPUT:-32768} --output-len 64 --num-prompts 1 --repeats 1 --spec --attention-backend $be \
                 --out-dir "$OUT/latency-$be" 2>&1 | tail -4; done ;;
  esac
  echo "[mode $mode: ${SECONDS}s]"
done
if [ -n "${SAVE_CACHE:-}" ]; then tar czf "$OUT/fi-cache.tgz" -C "$FLASHINFER_WORKSPACE_BASE" .cache 2>/dev/null; ls -la "$OUT/fi-cache.tgz"; fi
