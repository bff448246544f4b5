#!/usr/bin/env bash
# Train EAGLE-3 heads for pycode-19m and the bundled pycode-6m on the device's own site-packages (held-out
# files excluded), then measure acceptance on the held-out prompts. Results/heads as tarballs under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M19=$PWD/.carry/models/pycode-19m
M6=$PWD/src/spruce/assets/models/pycode-6m
python3 bench/make_train_data.py /tmp/train_data "$M19/heldout_prompts.jsonl" 80 | tee "$OUT/data.json"
train() {  # name target budget
  python3 -m spruce.cli train-draft --target "$2" --data /tmp/train_data --out "/tmp/heads/$1" \
    --time-budget "$3" --batch-size 32 --max-length 512 --ttt-length 6 --lr 2e-3 --dtype bfloat16 2>&1 \
    | tr '\r' '\n' | grep -v "^train-draft" | tail -3
  tail -1 "/tmp/heads/$1/train_log.jsonl"
}
train pycode-19m-eagle3 "$M19" "${BUDGET19:-300}"
train pycode-6m-eagle3 "$M6" "${BUDGET6:-110}"
python3 bench/eval_acceptance.py "$M19" /tmp/heads/pycode-19m-eagle3 "$M19/heldout_prompts.jsonl" "$OUT/accept-pycode-19m.json"
python3 bench/eval_acceptance.py "$M6" /tmp/heads/pycode-6m-eagle3 "$M19/heldout_prompts.jsonl" "$OUT/accept-pycode-6m.json" 4,5,16
for h in pycode-19m-eagle3 pycode-6m-eagle3; do
  tar -C /tmp/heads -czf "$OUT/$h.tar.gz" "$h/model.safetensors" "$h/config.json" "$h/train_log.jsonl" "$h/train_summary.json"
done
ls -la "$OUT"
