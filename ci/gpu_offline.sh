#!/usr/bin/env bash
# The GPU suite on a CUDA machine that has no network (an air-gapped runner, or a lent GPU box):
# wheels carried in $WHEELS (default ./.whl: spmd_types, megatron-core for that Python, ...) are
# installed into a private target so the image's own CUDA torch stays as it is, then
#   pytest -m gpu, python -m repro --device cuda, and the gpu benchmarks run,
# and their logs / JSON land in $EVIDENCE (default ./gpu-evidence).
# Usage: bash ci/gpu_offline.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
WHEELS=${WHEELS:-.whl}
EVIDENCE=${EVIDENCE:-gpu-evidence}
SITE=${SITE:-/tmp/stackfix-site}
mkdir -p "$EVIDENCE"

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  python3 -m pip list 2>/dev/null | grep -iE '^(torch|megatron-core|spmd.types|torchtitan|pytest) '
  PYTHONPATH=$SITE python3 -m pip list --path "$SITE" 2>/dev/null | tail -n +3
} > "$EVIDENCE/environment.txt" 2>&1

status=0
python3 -m pytest -m gpu -p no:cacheprovider -rA "$@" 2>&1 | tee "$EVIDENCE/pytest-gpu.log" || status=1
python3 -m repro --device cuda --json "$EVIDENCE/repro-cuda.json" 2>&1 | tee "$EVIDENCE/repro-cuda.log" || status=1
if [ -d benchmarks ]; then
  python3 -m pytest benchmarks -m gpu -p no:cacheprovider -p no:xdist \
    --benchmark-json="$EVIDENCE/bench-gpu.json" 2>&1 | tee "$EVIDENCE/bench-gpu.log" || status=1
fi
exit "$status"
