# Call B for issue 22 on one H200 (2026-12-01), after call A showed the "torch" fork server
# refusing to fork there ("2 threads, not 1"): which import starts that thread, where a CUDA
# child's time goes, and the gpu suite's slowest tests. One device call, carry [".whl", ".megatron-lm"].
. ci/gpu_env.sh || exit 1
python3 ci/diagnose_forkserver_threads.py torch > "$OUT/forkserver-threads.log" 2>&1
PYTORCH_NVML_BASED_CUDA_CHECK=1 python3 ci/diagnose_forkserver_threads.py torch \
  > "$OUT/forkserver-threads-nvml.log" 2>&1
timeout 100 python3 -m benchmarks.child_phases --device cuda --probes 2 --only shared-view-reclaim \
  --only mtp-shape --json "$OUT/child-phases-cuda.json" > "$OUT/child-phases-cuda.log" 2>&1
echo "phases rc=$?"
( time timeout 330 python3 -m pytest tests -m gpu -n 8 -p no:cacheprovider -q -rs --durations=40 \
  -p repro.harness.skip_audit --skip-audit=gpu ) > "$OUT/pytest-gpu-n8.log" 2>&1; echo "gpu suite rc=$?"
tail -n 4 "$OUT"/*.log
