# GPU batch M (1 GPU): where a reclaim's step time goes at H=1024 S=2048 (launch-bound steps)
. ci/gpu_env.sh || exit 1
for s in ours verl-0.8.0; do
  timeout 150 python3 ci/gpu_batches/round5-steptime_probe.py $s gpt-mtp bf16 1024 2048 40 > "$OUT/probe-$s.log" 2>&1; echo "rc=$?" >> "$OUT/probe-$s.log"
  head -8 "$OUT/probe-$s.log"
done
