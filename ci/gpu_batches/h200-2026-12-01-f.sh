# Call F for issue 22 on one H200 (2026-12-01, second session), after the fork server learned to
# fork a profile's server from the server of the profile it extends (torch from spmd, torchtitan
# from torch): the fork server's own tests where importing megatron.core starts a CUDA driver
# thread, the start-up phases, the GPU main job (with the CPU time by process) and the gpu suite
# on 8 workers. One device call, carry [".whl", ".megatron-lm"].
. ci/gpu_env.sh || exit 1
( time timeout 120 python3 -m pytest tests/test_forkserver.py -m cpu -p no:cacheprovider -q -rs \
  -p no:xdist ) > "$OUT/pytest-forkserver-cpu.log" 2>&1; echo "forkserver tests rc=$?"
timeout 60 python3 -m benchmarks.child_phases --device cuda --probes 1 --only shared-view-reclaim \
  --only mtp-shape --json "$OUT/child-phases-cuda.json" > "$OUT/child-phases-cuda.log" 2>&1
echo "phases rc=$?"
( time timeout 150 python3 -m benchmarks.proc_cpu --json "$OUT/proc-cpu-repro-cuda.json" -- \
  python3 -m repro --device cuda --json "$OUT/repro-cuda-j.json" ) > "$OUT/repro-cuda-j.log" 2>&1
echo "repro rc=$?"
( time timeout 230 python3 -m pytest tests -m gpu -n 8 -p no:cacheprovider -q -rs --durations=25 \
  -p repro.harness.skip_audit --skip-audit=gpu ) > "$OUT/pytest-gpu-n8.log" 2>&1; echo "gpu suite rc=$?"
tail -n 4 "$OUT"/*.log
