# Concurrency 1 served (plain, adaptive N=16/widths 8, adaptive8, plain-again), 8 passes, with each server
# process's threads' CPU ticks sampled every 15 s ($OUT/c1/threads.txt).
. bench/device_env.sh
M19=$PWD/.carry/models/pycode-19m; D19=$PWD/bench/assets/pycode-19m-eagle3
FIXED="--speculative-algorithm EAGLE3 --speculative-draft-model-path $D19 --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
SERVER="--model $M19 --max-running-requests 64 --cuda-graph-max-bs 64 --scheduler-delay-factor 4"
mkdir -p $OUT/c1
python3 .carry/threads.py $OUT/c1/threads.txt 12 &
timeout 400 python3 -m spruce.cli bench serving --server-args "$SERVER" --launch "plain=" --launch "adaptive=$FIXED --speculative-adaptive --speculative-num-draft-tokens 16 --speculative-adaptive-widths 8" --launch "adaptive8=$FIXED --speculative-adaptive" --launch "plain-again=" --pin-cpus --max-tokens 128 --concurrency 1 --interleave --prompts "$M19/heldout_prompts.jsonl" --tokenizer "$M19" --shared-prefix-tokens 1024 --prompt-tokens 256 --num-requests 64 --passes 8 --out-dir $OUT/c1 > $OUT/c1/bench.log 2>&1
echo rc=$?; grep -v "^pass" $OUT/c1/bench.log | tail -5
taskset -c 0,1 python3 -c "import torch; print('torch threads', torch.get_num_threads(), torch.__config__.parallel_info())" 2>&1 | head -12
wait
cd $OUT && tar czf results.tgz c1 && rm -rf c1
