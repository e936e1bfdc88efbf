#!/usr/bin/env bash
# The GPU runs on a CUDA machine that has no network (an air-gapped runner, or a lent GPU box):
# wheels carried in $WHEELS (default ./.whl: spmd_types, megatron-core for that Python, ...) are
# installed into a private target so the image's own CUDA torch stays as it is; verl releases
# carried in $WHEELS/verl go to $STACKFIX_VERL_ROOT the way `python -m repro.verl_release install`
# lays them out; a Megatron-LM dev tree in ./.megatron-lm (see README) is used when present. Then
# the targets of ci/gpu_run.py (`python3 ci/gpu_run.py --list` names them and their commands),
# their logs / JSON and run.json in $EVIDENCE (default ./gpu-evidence), with environment.txt.
# Usage: bash ci/gpu_offline.sh [--parallel] [TARGET ...]   (default: suite repro bench)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
EVIDENCE=${EVIDENCE:-gpu-evidence}
mkdir -p "$EVIDENCE"
# shellcheck source=ci/gpu_env.sh
. ci/gpu_env.sh || exit 1
# NVLink multicast off, in this process and its children (it can take shared GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "gpus", torch.cuda.device_count())'
  python3 -m pip list 2>/dev/null | grep -iE '^(torch|megatron-core|spmd.types|torchtitan|pytest) '
  PYTHONPATH=$SITE python3 -m pip list --path "$SITE" 2>/dev/null | tail -n +3
  echo "STACKFIX_VERL_ROOT=${STACKFIX_VERL_ROOT:-} STACKFIX_MEGATRON_LM=${STACKFIX_MEGATRON_LM:-}"
} > "$EVIDENCE/environment.txt" 2>&1

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(suite repro bench)
python3 ci/gpu_run.py --out "$EVIDENCE" "${args[@]}"
status=$?
grep -E "^=====|passed|failed" "$EVIDENCE/steps.log" | tail -n 40
exit "$status"
