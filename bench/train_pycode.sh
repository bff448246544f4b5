#!/usr/bin/env bash
# Train EAGLE-3 heads for pycode-19m and pycode-6m on this machine's own site-packages (held-out prompts
# excluded), then measure mean accept length on the held-out prompts with spruce: chain K=1,S=5,N=6 and trees
# K=4,S=5,N=16 and K=8,S=6,N=32.
#
# Usage (repo root, on the GPU machine): bash bench/train_pycode.sh MODELS_DIR [OUT_DIR]
#   MODELS_DIR holds pycode-19m (with heldout_prompts.jsonl) and optionally pycode-6m (else the bundled one).
#   OUT_DIR (default $OUT): results JSON, logs, and each head as a tarball (config.json + model.safetensors +
#   train_log.jsonl + train_summary.json).
# The two heads start together on the one GPU; pycode-6m's shorter budget ends first and pycode-19m then has
# the GPU alone. Budgets are training seconds: BUDGET19 (default 450), BUDGET6 (default 240). Whole run: about
# 9 minutes (data 15 s, setup 20 s, training, evaluation 30 s).
set -u -o pipefail
MODELS=${1:?usage: bash bench/train_pycode.sh MODELS_DIR [OUT_DIR]}
[ -n "${2:-}" ] && OUT=$2
source bench/device_env.sh  # PYTHONUNBUFFERED, $OUT (default /tmp/out), carried wheels, spruce on PYTHONPATH
MODELS=$(cd "$MODELS" && pwd); OUT=$(cd "$OUT" && pwd)
M19=$MODELS/pycode-19m
M6=$MODELS/pycode-6m; [ -f "$M6/config.json" ] || M6=$PWD/src/spruce/assets/models/pycode-6m
HELD=$M19/heldout_prompts.jsonl
WORK=${WORK:-/tmp/spruce-train}; rm -rf "$WORK"; mkdir -p "$WORK"
T0=$(date +%s)

python3 bench/make_train_data.py "$WORK/data.jsonl" "$HELD" "${DATA_MB:-60}" | tee "$OUT/data.json"

train() {  # name target budget extra-flags...
  local name=$1 target=$2 budget=$3; shift 3
  python3 -m spruce.cli train-draft --target "$target" --data "$WORK/data.jsonl" --out "$WORK/$name" \
    --time-budget "$budget" --ttt-length 7 --max-length 512 --lr 2e-3 --warmup-steps 100 --save-every 100000 \
    --heldout-docs 0 "$@" > "$WORK/$name.log" 2>&1
  echo "$name: exit $?, last step $(tail -1 "$WORK/$name/train_log.jsonl")"
}
train pycode-19m-eagle3 "$M19" "${BUDGET19:-450}" --batch-size 32 &
train pycode-6m-eagle3 "$M6" "${BUDGET6:-240}" --batch-size 32 &
wait

python3 bench/eval_acceptance.py "$M19" "$WORK/pycode-19m-eagle3" "$HELD" "$WORK/accept-19m.json" &
python3 bench/eval_acceptance.py "$M6" "$WORK/pycode-6m-eagle3" "$HELD" "$WORK/accept-6m.json" &
wait

python3 - "$WORK" "$OUT" "$(( $(date +%s) - T0 ))" <<'EOF'
import json, sys
import torch
work, out, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
result = {"device": device, "wall_seconds": seconds, "data": json.load(open(f"{out}/data.json")),
          "heads": {}}
for name, acc in (("pycode-19m-eagle3", "accept-19m.json"), ("pycode-6m-eagle3", "accept-6m.json")):
    entry = {}
    try:
        s = json.load(open(f"{work}/{name}/train_summary.json"))
        entry["training"] = {k: s[k] for k in ("steps", "first_loss", "last_loss", "train_seconds", "setup_seconds",
                                               "train_tokens", "epochs", "draft_vocab_size", "aux_layers")}
        log = [json.loads(line) for line in open(f"{work}/{name}/train_log.jsonl")]
        tail = log[-20:]
        entry["training"]["final_acc_per_step"] = [round(sum(r["acc"][k] for r in tail) / len(tail), 4)
                                                   for k in range(len(tail[0]["acc"]))]
        entry["training"]["tokens_per_s"] = round(sum(r["tokens_per_s"] for r in tail) / len(tail))
        entry["acceptance"] = json.load(open(f"{work}/{acc}"))
    except (OSError, ValueError, KeyError, IndexError) as e:
        entry["error"] = repr(e)
    result["heads"][name] = entry
json.dump(result, open(f"{out}/train_pycode.json", "w"), indent=2)
for name, entry in result["heads"].items():
    for cfg, st in entry.get("acceptance", {}).get("results", {}).items():
        print(f"{name} {cfg}: mean accept length {st['mean_accept_length']:.3f}")
    if "error" in entry:
        print(name, "ERROR", entry["error"])
EOF

for name in pycode-19m-eagle3 pycode-6m-eagle3; do
  tr '\r' '\n' < "$WORK/$name.log" | grep -E 'train-draft:|rror' | tail -1 > "$OUT/$name.log"  # final progress
  [ -f "$WORK/$name/model.safetensors" ] && tar -C "$WORK" -czf "$OUT/$name.tar.gz" "$name/config.json" \
    "$name/model.safetensors" "$name/train_log.jsonl" "$name/train_summary.json"
done
ls -la "$OUT"
