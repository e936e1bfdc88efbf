# Call I for issue 22 on one H200 (2026-12-01, second session): the two CPU tests that failed on
# the GPU host in calls G and H (before this session too), after their fixes: the fork server's
# tests and repro.testing's fixtures from a source tree on PYTHONPATH. carry [".whl", ".megatron-lm"].
. ci/gpu_env.sh || exit 1
( time timeout 300 python3 -m pytest tests/test_forkserver.py tests/test_testing_helpers.py -m cpu \
  -p no:cacheprovider -p no:xdist -rA --tb=short ) > "$OUT/pytest-forkserver-testing-cpu.log" 2>&1
echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-forkserver-testing-cpu.log" | tail -n 5
