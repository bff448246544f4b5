#!/usr/bin/env bash
# Issue 16's serving bar on the device: pycode-19m served plain, with a fixed EAGLE-3 (S, K, N) = (5, 4, 8) and with
# adaptive speculation over the same (5, 4, 8); concurrency 1, 8, 32, 64; 128-2048 requests of 128 output tokens per
# level (below), every level run three times (passes 1-3, all reported) on each server; the three servers run at once and
# each level runs on each in turn (--interleave), so the comparison is side by side in time. One result JSON (+ PNG and the
# server logs) per workload under $OUT. Adaptive must never be slower than the better of plain and fixed.
#   MODE=prefix (default): every request is one shared 1024-token prefix + its own 256-token held-out prompt,
#                          prefix cache on (speculation loses on pycode-19m: accept length ~1.2 at that context).
#   MODE=short:            128-token prompts, no shared prefix (speculation wins: accept length ~4.7), then the
#                          prefix workload without the prefix cache, smaller (64 requests per level, one pass).
#   EXTRA="NAME=FLAGS":    one more server in the comparison; NO_CACHE_RUN=0: MODE=short without its second part.
#   CONTROL=1:             a second, identical copy of the workload's better server ("fixed-again" for short prompts,
#                          "plain-again" with the shared prefix): the spread between two servers that run the same
#                          code, the floor under any adaptive-against-better figure of the same run.
#   SERVER_EXTRA="FLAGS":  flags every server gets (default --scheduler-delay-factor 4, as issue 16's runs; "" for none).
#   ADAPTIVE_EXTRA="FLAGS": flags the adaptive server alone gets (--log-level debug: every epoch the policy closes is
#                          logged, spruce.adaptive.epochs, and grepped with the switches into adaptive-policy.log).
#                          Session 36's bar runs also gave it "--speculative-num-draft-tokens 16
#                          --speculative-adaptive-widths 8" (the last flag of a name wins): rounds of 16 or 8 nodes.
#   PASSES=N:              passes per level instead of 4 (pass-to-pass noise on the H100 is 10-30%; a multiple of the
#                          servers balances their order and CPU sets: 4 with CONTROL=1, 6 without).
#   MAX_TOKENS_MIN=N:      each request's max_tokens drawn from [N, 128] instead of 128 for all (the same draw for
#                          request i on every server): equal lengths end a level's requests together, and at
#                          concurrency 64 every server's batch then swings between 64 and a few (mean 35-41).
#   PIN_CPUS=0:            servers and client share every CPU (default: --pin-cpus, each server's processes on CPUs of
#                          their own and the client on the rest, so that no placement favours one server; pinned,
#                          2026-11-25, adaptive still trailed plain at concurrency 1 by ~8%, as unpinned).
#   CPUS_PER_SERVER=N:     with pinning, N CPUs for each server and the client the rest (bench serving
#                          --cpus-per-server; default 3: 12 of 16 for four servers, 4 to the client, which used at most
#                          ~2.4 at 32-64; give 2 with EXTRA, or "" for bench serving's own split, a quarter of the CPUs
#                          per two servers). Until session 60 the default was that split, 2 CPUs for a server's HTTP
#                          and engine processes, which kept 1.65-1.7 of them busy: a few percent more host work
#                          lengthened every step there (session 59); with 3 they kept 1.3-2.0 busy.
#   REQUESTS="A B C D":    requests per level instead of 128 1024 2048 2048 (short) or 128 512 1024 2048 (prefix): levels
#                          of 5-17 s on the H100 (2026-11-23); 256-1024 requests made levels of 2-5 s at concurrency
#                          8-64, too short for the adaptive policy to settle or for a figure to mean much.
# The device image lacks the server's packages: carry their wheels in .whl (fastapi, starlette, uvicorn, httptools,
# pydantic, pydantic-core, annotated-types, annotated-doc, typing-inspection, opentelemetry-api, uvloop; the versions
# the local .venv holds; bench/device_env.sh installs them). Pool runs with python bench/serving_bar.py RESULTS...
# Usage (repo root, fixture model in .carry/models/pycode-19m): SPRUCE_GIT_COMMIT=<sha> MODE=prefix bash bench/device_serving_prefix.sh
set -u
. bench/device_env.sh
lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name)" ; cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list
M19=$PWD/.carry/models/pycode-19m
D19=$PWD/bench/assets/pycode-19m-eagle3
FIXED="--speculative-algorithm EAGLE3 --speculative-draft-model-path $D19 --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
SERVER="--model $M19 --max-running-requests 64 --cuda-graph-max-bs 64 ${SERVER_EXTRA---scheduler-delay-factor 4}"
CPS=${CPUS_PER_SERVER-3}  # (set but empty: bench serving's own split)
bench() {  # workload-name control-flags bench-flags... ($SERVER: every server's flags; control-flags: the better
  # server's, for CONTROL=1)
  local name=$1 control=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout ${BENCH_TIMEOUT:-540} python3 -m spruce.cli bench serving --server-args "$SERVER" \
    --launch "plain=" --launch "fixed=$FIXED" --launch "adaptive=$FIXED --speculative-adaptive ${ADAPTIVE_EXTRA:-}" \
    ${EXTRA:+--launch "$EXTRA"} ${CONTROL:+--launch "$control"} \
    $( [ "${PIN_CPUS:-1}" = 1 ] && echo --pin-cpus ${CPS:+--cpus-per-server $CPS} ) ${ROTATION:+--rotation $ROTATION} --max-tokens 128 ${MAX_TOKENS_MIN:+--max-tokens-min $MAX_TOKENS_MIN} --concurrency 1 8 32 64 --interleave --prompts "$M19/heldout_prompts.jsonl" --tokenizer "$M19" \
    --out-dir "$OUT/$name" "$@" 2>&1 | tee "$OUT/$name/bench.log" | grep -v "^pass" | tail -40
  grep -h "spruce.adaptive" "$OUT/$name/server-logs/adaptive.log" > "$OUT/$name/adaptive-policy.log"
  for f in "$OUT/$name"/server-logs/*.log; do echo "== $f"; grep -iE "error|traceback" "$f" | head -5; done
}
case "${MODE:-prefix}" in
  prefix) bench prefix "plain-again=" --shared-prefix-tokens 1024 --prompt-tokens 256 --num-requests ${REQUESTS:-128 512 1024 2048} --passes ${PASSES:-4} ;;
  short)
    bench short "fixed-again=$FIXED" --prompt-tokens 128 --num-requests ${REQUESTS:-128 1024 2048 2048} --passes ${PASSES:-4}
    [ "${NO_CACHE_RUN:-1}" = 1 ] && SERVER="$SERVER --disable-radix-cache" BENCH_TIMEOUT=200 \
      CONTROL= bench prefix-no-cache "" --shared-prefix-tokens 1024 --prompt-tokens 256 --num-requests 64 ;;
  *) echo "MODE must be prefix or short, got ${MODE}" >&2; exit 2 ;;
esac
# A device call returns at most 8 files from $OUT (session 27 lost a run's JSON to that limit): more are bundled into
# one archive, $OUT/results.tgz.
# The archive's temporary name is this run's own: four runs at once (bench/device_serving_parallel.sh) that ended
# within a second shared one name, and one run's files were lost (2026-11-26).
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  archive=$(mktemp /tmp/bench-results-XXXXXX.tgz)
  tar czf "$archive" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$archive" "$OUT/results.tgz"
fi
ls -laR "$OUT"
