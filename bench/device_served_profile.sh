#!/usr/bin/env bash
# Where served engines spend their prefill launches (issue 16): `spruce bench serving` with the 1k shared prefix (the
# bar's prefix workload) on a plain and an adaptive server (the bar's flags), recorded whole by py-spy (--subprocesses
# --nonblocking: the processes are read, not stopped), then bench/served_pyspy.py splits each engine's samples inside
# Engine._launch_prefill by call path, in ms a prefill (the level's prefill counts from the result JSON).
#   CONCURRENCY="32 64", REQUESTS="1024 1024", PASSES=2 (a multiple of the two servers), RATE=200 (samples a second; at 250 py-spy fell 2 s behind),
#   ROOT=_launch_prefill (the function split; its figures are ms a prefill, another root's ms a decode step, e.g.
#   _launch_decode, Engine.step or _EngineServer.run, the engine process's loop), ADAPTIVE_EXTRA: the adaptive
#   server's extra flags (default the bar's).
# Needs py-spy among the carried wheels (.whl). Usage (repo root, fixture model in .carry/models/pycode-19m):
#   SPRUCE_GIT_COMMIT=<sha> bash bench/device_served_profile.sh
set -u
. bench/device_env.sh
M19=$PWD/.carry/models/pycode-19m
D19=$PWD/bench/assets/pycode-19m-eagle3
FIXED="--speculative-algorithm EAGLE3 --speculative-draft-model-path $D19 --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
ADAPTIVE="$FIXED --speculative-adaptive ${ADAPTIVE_EXTRA:---speculative-num-draft-tokens 16 --speculative-adaptive-widths 8}"
RATE=${RATE:-200}
mkdir -p "$OUT/served-profile"
timeout ${BENCH_TIMEOUT:-400} py-spy record --subprocesses --nonblocking -r "$RATE" --format raw \
  -o "$OUT/served-profile/pyspy.raw" -- python3 -m spruce.cli bench serving \
  --server-args "--model $M19 --max-running-requests 64 --cuda-graph-max-bs 64 --scheduler-delay-factor 4" \
  --launch "plain=" --launch "adaptive=$ADAPTIVE" --pin-cpus --interleave --max-tokens 128 \
  --concurrency ${CONCURRENCY:-32 64} --num-requests ${REQUESTS:-1024 1024} --passes ${PASSES:-2} \
  --prompts "$M19/heldout_prompts.jsonl" --tokenizer "$M19" --shared-prefix-tokens 1024 --prompt-tokens 256 \
  --out-dir "$OUT/served-profile" 2>&1 | grep -v "^pass" | tail -30
per=$( [ "${ROOT:-_launch_prefill}" = _launch_prefill ] && echo prefill || echo decode )  # ms a prefill, else a decode step
calls=$(python3 - "$OUT"/served-profile/serving-*.json "$per" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))["figures"]["runs"]
print(" ".join(f"{r['name']}={sum(lv['engine']['steps'][sys.argv[2]] for lv in r['levels'])}" for r in runs))
PY
)
echo "$per steps: $calls"
python3 bench/served_pyspy.py "$OUT/served-profile/pyspy.raw" --root "${ROOT:-_launch_prefill}" --rate "$RATE" \
  --calls $calls --depth 4 --out "$OUT/served-profile/served-pyspy.json" | tee "$OUT/served-profile/served-pyspy.txt"
xz -T4 "$OUT/served-profile/pyspy.raw"  # (other roots, read here later: ~1/20 the size)
