# Call G for issue 22 on one H200 (2026-12-01, second session): call F's run of the fork server's
# tests ran out of its 120 s with one failure unseen; here with room and the failures shown, that
# test at 80950d4 (before this session, git archive into the ignored .old-80950d4; carried), and
# the whole CPU suite on the GPU host. carry [".whl", ".megatron-lm", ".old-80950d4"].
. ci/gpu_env.sh || exit 1
( time timeout 300 python3 -m pytest tests/test_forkserver.py -m cpu -p no:cacheprovider -rA --tb=short \
  -p no:xdist --durations=10 ) > "$OUT/pytest-forkserver-cpu.log" 2>&1; echo "forkserver tests rc=$?"
( cd .old-80950d4 && PYTHONPATH="$SITE:$PWD" timeout 120 python3 -m pytest \
  "tests/test_forkserver.py::test_a_forked_child_runs_its_own_atexit_handlers_not_the_servers" \
  -p no:cacheprovider -rA --tb=short -p no:xdist ) > "$OUT/pytest-forkserver-atexit-80950d4.log" 2>&1
echo "atexit at 80950d4 rc=$?"
( time timeout 200 python3 -m pytest tests -m cpu -n 8 -p no:cacheprovider -q -rfEs --tb=short \
  --durations=15 ) > "$OUT/pytest-cpu-n8.log" 2>&1; echo "cpu suite rc=$?"
tail -n 3 "$OUT"/*.log
