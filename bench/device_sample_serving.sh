#!/usr/bin/env bash
# Issue 16 on the device: where plain, fixed (5, 4, 8) and adaptive servers spend their host time, sampled from
# outside with py-spy (bench/sample_servers.py, py-spy carried as a wheel in .whl) while `spruce bench serving`
# drives the three of them interleaved, two passes per level:
#   prefix: a shared 1024-token prefix + 256-token prompts, prefix cache on (plain is the better server there);
#   short:  128-token prompts (fixed is the better server there).
# Per workload under $OUT: <workload>.json (the serving result, with each server's engine counters per level) and
# <workload>-profile.json (per server and engine process: busy seconds and the top functions by own and total
# samples, start-up left out). Raw recordings and server logs stay in $WORK.
#   SERVER_EXTRA="FLAGS": flags every server gets (default --scheduler-delay-factor 4, as issue 16's last runs).
#   PREFIX_LEVELS / PREFIX_REQUESTS, SHORT_LEVELS / SHORT_REQUESTS: concurrency levels and requests per level.
#   WORKLOADS="prefix short": the workloads to run (e.g. WORKLOADS=short for 128-token prompts alone).
#   BENCH_EXTRA="FLAGS": more `spruce bench serving` flags (e.g. --pin-cpus, as the serving bar runs).
#   RAW=1: the raw recordings (collapsed stacks per process) come back too, as $OUT/<workload>-raw.tgz.
# Usage (repo root, fixture model in .carry/models/pycode-19m): bash bench/device_sample_serving.sh
set -u
. bench/device_env.sh
WORK=${WORK:-/tmp/sample-serving}
M19=$PWD/.carry/models/pycode-19m
D19=$PWD/bench/assets/pycode-19m-eagle3
FIXED="--speculative-algorithm EAGLE3 --speculative-draft-model-path $D19 --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
SERVER="--model $M19 --max-running-requests 64 --cuda-graph-max-bs 64 ${SERVER_EXTRA:---scheduler-delay-factor 4}"
sampled() {  # workload-name bench-flags...
  local name=$1; shift
  mkdir -p "$WORK/$name"
  python3 bench/sample_servers.py watch "$WORK/$name/raw" --rate 500 & local watcher=$!
  timeout ${BENCH_TIMEOUT:-280} python3 -m spruce.cli bench serving --server-args "$SERVER" \
    --launch "plain=" --launch "fixed=$FIXED" --launch "adaptive=$FIXED --speculative-adaptive" \
    --max-tokens 128 --interleave --passes 2 --prompts "$M19/heldout_prompts.jsonl" --tokenizer "$M19" \
    --out-dir "$WORK/$name" ${BENCH_EXTRA:-} "$@" 2>&1 | grep -v "^== " | tail -30
  kill -INT $watcher; wait $watcher
  cp "$WORK/$name"/serving-*.json "$OUT/$name.json"
  python3 bench/sample_servers.py summarize "$WORK/$name/raw" "$OUT/$name-profile.json" --rate 500 --top 60 \
    > "$WORK/$name/profile.txt"
  [ "${RAW:-0}" = 1 ] && tar czf "$OUT/$name-raw.tgz" -C "$WORK/$name" raw
  for f in "$WORK/$name"/server-logs/*.log; do echo "== $f"; grep -iE "error|traceback" "$f" | head -5; done
}
py-spy --version || exit 1
case " ${WORKLOADS:-prefix short} " in *" prefix "*) sampled prefix --shared-prefix-tokens 1024 --prompt-tokens 256 --concurrency ${PREFIX_LEVELS:-1 8} \
  --num-requests ${PREFIX_REQUESTS:-128 256} ;; esac
case " ${WORKLOADS:-prefix short} " in *" short "*) sampled short --prompt-tokens 128 --concurrency ${SHORT_LEVELS:-8 64} --num-requests ${SHORT_REQUESTS:-1024 2048} ;; esac
ls -la "$OUT"
