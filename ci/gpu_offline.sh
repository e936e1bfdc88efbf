#!/usr/bin/env bash
# The GPU suite on a CUDA machine that has no network (an air-gapped runner, or a lent GPU box):
# wheels carried in $WHEELS (default ./.whl: spmd_types, megatron-core for that Python, ...) are
# installed into a private target so the image's own CUDA torch stays as it is; verl releases
# carried in $WHEELS/verl go to $STACKFIX_VERL_ROOT the way `python -m repro.verl_release install`
# lays them out; a Megatron-LM dev tree in ./.megatron-lm (see README) is used when present. Then
#   pytest -m gpu (xdist workers: $GPU_WORKERS, default 4) and python -m repro --device cuda run
#   side by side, then the gpu benchmarks,
# and their logs / JSON land in $EVIDENCE (default ./gpu-evidence).
# Usage: bash ci/gpu_offline.sh [pytest args...]
#        bash ci/gpu_offline.sh verl-engine [pytest args...]  (verl's own Megatron engine, three
#        runs per model: ci/gpu_verl_engine.sh, which says how its wheels are prepared)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
if [ "${1:-}" = verl-engine ]; then
  shift
  exec bash ci/gpu_verl_engine.sh run "$@"
fi
EVIDENCE=${EVIDENCE:-gpu-evidence}
GPU_WORKERS=${GPU_WORKERS:-4}
mkdir -p "$EVIDENCE"
# shellcheck source=ci/gpu_env.sh
. ci/gpu_env.sh || exit 1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "gpus", torch.cuda.device_count())'
  python3 -m pip list 2>/dev/null | grep -iE '^(torch|megatron-core|spmd.types|torchtitan|pytest) '
  PYTHONPATH=$SITE python3 -m pip list --path "$SITE" 2>/dev/null | tail -n +3
  echo "STACKFIX_VERL_ROOT=${STACKFIX_VERL_ROOT:-} STACKFIX_MEGATRON_LM=${STACKFIX_MEGATRON_LM:-}"
} > "$EVIDENCE/environment.txt" 2>&1

workers=()
python3 -c 'import xdist' 2>/dev/null && workers=(-n "$GPU_WORKERS")
status=0
python3 -m repro --device cuda --json "$EVIDENCE/repro-cuda.json" > "$EVIDENCE/repro-cuda.log" 2>&1 &
repro_pid=$!
python3 -m pytest -m gpu -p no:cacheprovider -rA "${workers[@]}" "$@" 2>&1 \
  | tee "$EVIDENCE/pytest-gpu.log" || status=1
wait "$repro_pid" || status=1
cat "$EVIDENCE/repro-cuda.log"
if [ -d benchmarks ]; then
  python3 -m pytest benchmarks -m gpu -p no:cacheprovider -p no:xdist \
    --benchmark-json="$EVIDENCE/bench-gpu.json" 2>&1 | tee "$EVIDENCE/bench-gpu.log" || status=1
fi
exit "$status"
