# Concurrency 1 and 8 served: plain, adaptive, plain-again, adaptive-again; 8 passes; /proc counters of every
# server process sampled every 3 s ($OUT/c1/procstat.jsonl).
. bench/device_env.sh
M19=$PWD/.carry/models/pycode-19m; D19=$PWD/bench/assets/pycode-19m-eagle3
FIXED="--speculative-algorithm EAGLE3 --speculative-draft-model-path $D19 --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
AD="$FIXED --speculative-adaptive --speculative-num-draft-tokens 16 --speculative-adaptive-widths 8"
SERVER="--model $M19 --max-running-requests 64 --cuda-graph-max-bs 64 --scheduler-delay-factor 4"
mkdir -p $OUT/c1
python3 .carry/procstat.py $OUT/c1/procstat.jsonl 540 &
timeout 530 python3 -m spruce.cli bench serving --server-args "$SERVER" --launch "plain=" --launch "adaptive=$AD" --launch "plain-again=" --launch "adaptive-again=$AD" --pin-cpus --max-tokens 128 --concurrency 1 8 --interleave --prompts "$M19/heldout_prompts.jsonl" --tokenizer "$M19" --shared-prefix-tokens 1024 --prompt-tokens 256 --num-requests 64 512 --passes ${PASSES:-8} --out-dir $OUT/c1 > $OUT/c1/bench.log 2>&1
echo rc=$?; grep -v "^pass" $OUT/c1/bench.log | tail -12
kill %1 2>/dev/null
cd $OUT && tar czf results.tgz c1 && rm -rf c1
