#!/usr/bin/env bash
# Peer comparison on the device: gpt-fast (its model.py/generate.py exported into .carry/gpt-fast, never
# committed) decoding pycode-19m at bs 1, 16 heldout prompts (cut to 128 tokens) x 128 new tokens, bf16, with
# decode_one_token under torch.compile(mode="reduce-overhead", fullgraph=True) as its main() does; spruce's
# greedy tokens for the same prompts are generated first so the result records how far the outputs agree.
# Usage (repo root, fixture in .carry/models/pycode-19m, gpt-fast in .carry/gpt-fast): bash bench/device_peer.sh
# Results under $OUT: gpt-fast-<device>-<time>.json, spruce-greedy-tokens.json. Bounded to ~3 minutes.
set -u
. bench/device_env.sh
M19=$PWD/.carry/models/pycode-19m
GF=$PWD/.carry/gpt-fast
COMMON=(--model "$M19" --prompts "$M19/heldout_prompts.jsonl" --num-prompts 16 --input-len 128 --output-len 128
        --device cuda --dtype bfloat16)
timeout ${SPRUCE_TIMEOUT:-45} python3 bench/gpt_fast_peer.py "${COMMON[@]}" --run-spruce \
  --spruce-tokens "$OUT/spruce-greedy-tokens.json" 2>&1 | grep -v Warning | tail -3
echo "spruce tokens exit ${PIPESTATUS[0]}"
ST=()
[ -s "$OUT/spruce-greedy-tokens.json" ] && ST=(--spruce-tokens "$OUT/spruce-greedy-tokens.json")
timeout ${GF_TIMEOUT:-135} python3 bench/gpt_fast_peer.py "${COMMON[@]}" --gpt-fast-dir "$GF" --repeats 2 \
  ${ST[@]+"${ST[@]}"} --out "$OUT" > "$OUT/gpt-fast.log" 2>&1
echo "gpt-fast exit $?"
grep -v -i warn "$OUT/gpt-fast.log" | grep -E "gpt-fast on|vs spruce|wrote|Error|error" | tail -8
ls -la "$OUT"
