# Call H for issue 22 on one H200 (2026-12-01, second session): the whole CPU suite on the GPU
# host with room to finish (call G's ran out of its 200 s with two failures unseen), after the
# atexit test's fix. carry [".whl", ".megatron-lm"].
. ci/gpu_env.sh || exit 1
( time timeout 470 python3 -m pytest tests -m cpu -n 16 -p no:cacheprovider -q -rfE --tb=short \
  --durations=15 ) > "$OUT/pytest-cpu-n16.log" 2>&1; echo "cpu suite rc=$?"
tail -n 30 "$OUT/pytest-cpu-n16.log"
