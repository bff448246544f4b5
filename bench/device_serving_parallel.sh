#!/usr/bin/env bash
# Issue 16's serving bar, one run per GPU at once on a multi-GPU machine (nvidia-h100-x4: four, nvidia-h100-x2 or
# nvidia-h200-x2: two): each run is bench/device_serving_prefix.sh (plain, fixed, adaptive and a control copy,
# interleaved) on a GPU of its own (CUDA_VISIBLE_DEVICES) and its share of the machine's physical cores (taskset;
# --pin-cpus deals that share among its servers and its client): a quarter of the x4's 64 CPUs or half the x2's 32,
# like a one-GPU machine's 16 CPUs. A multi-GPU machine's held time counts in full against the device time and a
# one-GPU machine's at half (device README, 2026-11-26): four runs at once cost half the device time of four in turn,
# two at once the same as two in turn (when the x4 is not lent), in half the wall time. On the H100 x4 (2026-11-26)
# the control copy's spread against its twin was the one-GPU machine's: mean |.| per workload 0.6-1.5% at
# concurrency 1 and 0.7-6.5% at 8-64 (session 31's one-GPU runs: 0.7-1.0% and 1.9-5.8%). Results under $OUT/g0,
# g1, ... (the runs' own layout) and each run's log in $OUT/gN.log, bundled into $OUT/results.tgz at the end.
#   MODES="short short prefix prefix": each run's workload (device_serving_prefix.sh's MODE), one per GPU (on two
#   GPUs the first two); PASSESV="4 4 4 4": each run's passes (a multiple of the four servers: bench serving's
#   order and CPU sets balance over four passes; with three the adaptive server never ran on one of the four CPU
#   sets, on the H100 x2 at 779240c the one a plain server was fastest on); GPU_TESTS=1 (default): the `gpu` tests of
#   tests/test_adaptive.py first, on the last GPU and its cores; GPU_TESTS=all: the last GPU runs the `gpu` tests of
#   tests/test_adaptive.py, test_gpu.py and test_warm_eager.py instead of a serving run (its log: gN/gpu_tests.log);
#   BENCH_TIMEOUT: each run's time limit (seconds, device_serving_prefix.sh's); REQUESTS: requests per level
#   (default "64 512 1024 1024"); EXTRA_0, EXTRA_1, ...: one more server for that GPU's run only
#   (device_serving_prefix.sh's EXTRA="NAME=FLAGS"; EXTRA: for every run).
#   CPUS_PER_SERVER=N: each run's servers get N of its CPUs each (device_serving_prefix.sh's; default 3 of its 16).
# Run i is given `bench serving --rotation i`: it starts its servers from the i-th and runs its passes at the server
# orders and CPU sets of passes i, i+1, ...; until 2026-11-27 every run started the plain server first and ran it
# first in its first level, where its identical copy trailed it by 3.5 +- 0.4% (eight H100 x4 runs at concurrency 1;
# later passes 1.1 +- 0.6%).
# SRC_0, SRC_1, ... (with COMMIT_0, COMMIT_1, ...): that GPU's run imports spruce from another source tree and labels
# its results with that commit, so that two versions run side by side in one call, e.g. for 8345f06 on GPUs 2-3:
#   git archive 8345f06 src/spruce ':(exclude)src/spruce/assets' | tar x -C .carry/old   (then carry .carry)
#   SRC_2=.carry/old/src COMMIT_2=8345f06 SRC_3=.carry/old/src COMMIT_3=8345f06 bash bench/device_serving_parallel.sh
# (the scripts, the draft in bench/assets and the fixture model are this tree's).
# Usage (repo root, fixture model in .carry/models/pycode-19m, server wheels in .whl):
#   SPRUCE_GIT_COMMIT=<sha> bash bench/device_serving_parallel.sh
set -u
. bench/device_env.sh
export SPRUCE_WHEELS_INSTALLED=1 SPRUCE_PYCODE_19M=$PWD/.carry/models/pycode-19m SPRUCE_GIT_COMMIT=${SPRUCE_GIT_COMMIT:-unknown}
nvidia-smi -L; nproc
GPUS=$(nvidia-smi -L | wc -l)
python3 - "$GPUS" > /tmp/core-shares <<'PY'
import os
import sys
from spruce.bench.serving_launch import cpu_core
gpus = int(sys.argv[1])
cpus = sorted(os.sched_getaffinity(0))
cores = sorted({cpu_core(cpu) for cpu in cpus})
per = len(cores) // gpus
if gpus < 2 or per < 2:
    raise SystemExit(f"runs at once need at least two GPUs and two physical cores a GPU; this machine has {gpus} "
                     f"GPUs and {len(cores)} physical cores")
for i in range(gpus):
    mine = set(cores[i * per:(i + 1) * per])
    print(",".join(str(cpu) for cpu in cpus if cpu_core(cpu) in mine))
PY
cat /tmp/core-shares || exit 2
ROOT=$OUT; T0=$SECONDS
gpu_tests() {  # the `gpu` tests of the files after the time limit $1, on this run's GPU and cores ($cpus), into $OUT
  local limit=$1; shift
  SPRUCE_GPU_REPORT=$OUT/gpu_report.json timeout "$limit" taskset -c "$cpus" python3 -m pytest -q -p no:cacheprovider \
    -m gpu "$@" -rs > "$OUT/gpu_tests.log" 2>&1
}
MODES=(${MODES:-short short prefix prefix}); PASSESV=(${PASSESV:-4 4 4 4})
for ((i = 0; i < GPUS; i++)); do
  cpus=$(sed -n "$((i + 1))p" /tmp/core-shares)
  (
    export CUDA_VISIBLE_DEVICES=$i OUT=$ROOT/g$i; mkdir -p "$OUT"
    extra_var=EXTRA_$i; export EXTRA="${!extra_var:-${EXTRA:-}}"
    src_var=SRC_$i; commit_var=COMMIT_$i
    if [ -n "${!src_var:-}" ]; then
      [ -d "${!src_var}/spruce" ] || { echo "g$i: $src_var=${!src_var} holds no spruce package" >&2; exit 2; }
      export SPRUCE_SRC=$PWD/${!src_var} SPRUCE_GIT_COMMIT=${!commit_var:-${!src_var}}
    fi
    if [ $i = $((GPUS - 1)) ] && [ "${GPU_TESTS:-1}" = all ]; then
      gpu_tests 480 tests/test_adaptive.py tests/test_gpu.py tests/test_warm_eager.py
      echo "g$i gpu tests t=$((SECONDS - T0)):"; tail -4 "$OUT/gpu_tests.log"
      exit 0
    fi
    if [ $i = $((GPUS - 1)) ] && [ "${GPU_TESTS:-1}" = 1 ]; then
      gpu_tests 150 tests/test_adaptive.py
      echo "g$i gpu tests t=$((SECONDS - T0)): $(tail -1 "$OUT/gpu_tests.log")"
    fi
    ROTATION=$i MODE=${MODES[$i]} PASSES=${PASSESV[$i]} REQUESTS=${REQUESTS:-64 512 1024 1024} CONTROL=1 PIN_CPUS=1 NO_CACHE_RUN=0 \
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-530} taskset -c "$cpus" bash bench/device_serving_prefix.sh > "$ROOT/g$i.log" 2>&1
    echo "g$i ${MODES[$i]} done t=$((SECONDS - T0))"
    grep "pass by pass vs the best\|rror" "$ROOT/g$i.log" | tail -8
  ) &
done
wait
archive=$(mktemp /tmp/parallel-results-XXXXXX.tgz)
tar czf "$archive" -C "$ROOT" . && find "$ROOT" -mindepth 1 -delete && mv "$archive" "$ROOT/results.tgz"
echo "t=$((SECONDS - T0))"
