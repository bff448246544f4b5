# Served A/B on a multi-GPU machine: per GPU one run of plain, adaptive (this tree), adaptive-v (.carry/old/src),
# plain-again; 1k shared prefix; concurrency 1 8 32 64; 4 passes; CPS CPUs a server (default 3).
. bench/device_env.sh
export SPRUCE_WHEELS_INSTALLED=1
M19=$PWD/.carry/models/pycode-19m; D19=$PWD/bench/assets/pycode-19m-eagle3
FIXED="--speculative-algorithm EAGLE3 --speculative-draft-model-path $D19 --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
AD="$FIXED --speculative-adaptive --log-level debug --speculative-num-draft-tokens 16 --speculative-adaptive-widths 8"
SERVER="--model $M19 --max-running-requests 64 --cuda-graph-max-bs 64 --scheduler-delay-factor 4"
GPUS=$(nvidia-smi -L | wc -l); nproc
python3 - "$GPUS" > /tmp/core-shares <<'PY'
import os, sys
from spruce.bench.serving_launch import cpu_core
gpus = int(sys.argv[1]); cpus = sorted(os.sched_getaffinity(0)); cores = sorted({cpu_core(c) for c in cpus}); per = len(cores) // gpus
for i in range(gpus):
    mine = set(cores[i * per:(i + 1) * per]); print(",".join(str(c) for c in cpus if cpu_core(c) in mine))
PY
cat /tmp/core-shares
for ((i = 0; i < GPUS; i++)); do
  cpus=$(sed -n "$((i + 1))p" /tmp/core-shares); mkdir -p $OUT/g$i
  CUDA_VISIBLE_DEVICES=$i timeout ${BT:-540} taskset -c "$cpus" python3 -m spruce.cli bench serving --server-args "$SERVER" \
    --launch "plain=" --launch "adaptive=$AD" --launch "adaptive-v=$AD" --launch-src adaptive-v=$PWD/.carry/old/src --launch "plain-again=" \
    --pin-cpus --cpus-per-server ${CPS:-3} --rotation $i --max-tokens 128 --concurrency 1 8 32 64 --interleave \
    --prompts "$M19/heldout_prompts.jsonl" --tokenizer "$M19" --shared-prefix-tokens 1024 --prompt-tokens 256 \
    --num-requests 64 512 1024 1024 --passes 4 --out-dir $OUT/g$i > $OUT/g$i/bench.log 2>&1 &
done
wait
for ((i = 0; i < GPUS; i++)); do echo "== g$i"; grep "pass by pass vs\|rror" $OUT/g$i/bench.log | tail -5;
  for n in adaptive adaptive-v; do grep -h "spruce.adaptive" $OUT/g$i/server-logs/$n.log > $OUT/g$i/$n-policy.log; done; done
cd $OUT && tar czf /tmp/ab.tgz g* && rm -rf g* && mv /tmp/ab.tgz results.tgz
