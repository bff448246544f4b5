#!/usr/bin/env bash
# `spruce bench serving` on the device: pycode-19m served with its trained EAGLE-3 head and without
# speculation, each with overlap scheduling on and off, at concurrency 1, 8, 32 and 64 (results JSON and plots
# under $OUT).
set -u
. bench/device_env.sh
M19=$PWD/.carry/models/pycode-19m
D19=$PWD/bench/assets/pycode-19m-eagle3
run() {  # name port extra-server-flags...
  local name=$1 port=$2; shift 2
  setsid python3 -m spruce.cli serve --model "$M19" --port "$port" --max-running-requests 64 --cuda-graph-max-bs 64 "$@" \
    > "/tmp/server-$name.log" 2>&1 &
  for _ in $(seq 300); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" 2>/dev/null && break; sleep 1; done
  timeout ${BENCH_TIMEOUT:-200} python3 -m spruce.cli bench serving --base-url "http://127.0.0.1:$port" \
    --concurrency 1 8 32 64 --num-requests 64 --prompts "$M19/heldout_prompts.jsonl" --tokenizer "$M19" \
    --prompt-tokens 256 --max-tokens 128 --out-dir "$OUT" 2>&1 | tail -8
  tail -4 "/tmp/server-$name.log"
  pkill -f "spruce.cli serve --model $M19 --port $port" || true
  sleep 2
}
EAGLE3=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$D19" --speculative-num-steps 6
        --speculative-eagle-topk 8 --speculative-num-draft-tokens 32)
run eagle3 30001 "${EAGLE3[@]}"
run eagle3-no-overlap 30002 "${EAGLE3[@]}" --disable-overlap-schedule
run plain 30003
run plain-no-overlap 30004 --disable-overlap-schedule
ls -la "$OUT"
