#!/usr/bin/env bash
# verl's own Megatron engine on a CUDA machine without network (issue 33; tests/test_verl_engine.py):
# per model (dense Qwen2, Qwen3-MoE; full recompute) three runs side by side -- plugin on, plugin
# off (verl's reclaim), no reclaim -- each initialised by verl's MegatronEngineWithLMHead and
# trained twice through its train_batch; the runs' figures land in $EVIDENCE/verl-engine-*.json.
#
#   prepare   (here, on a machine with the package index): the wheels the engine imports that the
#             H200 image lacks (KINDS.md's list), for CPython 3.12 manylinux x86_64, into
#             $WHEELS (default ./.whl; add "/.whl/" to .git/info/exclude first).
#   run       (on the GPU machine, through `bash ci/gpu_offline.sh verl-engine`): . ci/gpu_env.sh
#             (installs $WHEELS into a private target), then the gpu test, one pytest per model.
#
# The exact commands of the later session (repository root, main checkout):
#   bash ci/gpu_verl_engine.sh prepare            # here: 25 MiB in .whl (2026-12-01), ~5 min
#   device run, kind nvidia-h200, carry [".whl"], timeout_s 600:
#     WHEELS=.whl EVIDENCE=$OUT timeout 590 bash ci/gpu_offline.sh verl-engine
#   then commit $OUT's verl-engine-*.json and logs under benchmarks/results/evidence/<date>-h200-<topic>/ (its README names the commit).
#
# Ray: `import verl` imports ray (verl/protocol.py, verl/single_controller/base/worker.py), and
# ray's wheel (79 MB) is over one call's 64 MiB. The engine runs in one process and starts no
# Ray cluster, so `prepare` carries ray's Python package without the cluster's daemons
# (ray/core/src/ray/raylet, ray/core/src/ray/gcs) and its Java jars (ray/jars), xz-packed
# ($WHEELS/ray-*-nodaemons.tar.xz); ci/gpu_env.sh unpacks it into the same target. Nothing
# that `import ray` loads is left out (checked with the 3.11 build: `import ray, verl` and the
# engine modules import from such a copy). Not measured on the H200 yet: whether any import on the
# way needs a package not carried here (the list below is what `import verl` plus the engine's
# modules loaded in tox -e verl, less the image's packages).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
WHEELS=${WHEELS:-.whl}
EVIDENCE=${EVIDENCE:-gpu-evidence}

# name==version: verl 0.9.1's engine closure (ci/constraints-verl091.txt's pins), mbridge, and
# megatron-core 0.16.1 (its cp312 wheel): mbridge 0.15.1, the newest, reads
# ModelType.encoder_and_decoder, which megatron-core 0.19 removed (H200, 2026-12-01: engine
# initialize() raised AttributeError in mbridge/core/util.py:83 on 0.19.2)
CARRIED=(
  verl==0.9.1 mbridge==0.15.1 megatron-core==0.16.1 tensordict==0.10.0 pyvers==0.1.0
  orjson==3.13.0 importlib-metadata==10.2.0 zipp==4.1.2 omegaconf==2.3.1 codetiming==1.4.0 datasets==4.7.0 dill==0.4.0
  multiprocess==0.70.18 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 tyro==1.0.17 docstring-parser==0.18.0
  typeguard==4.6.1 platformdirs==4.14.9
)
# omegaconf pins antlr4 4.9.*, published as a source archive only: built into a wheel here
# (pure Python)
FROM_SOURCE=(antlr4-python3-runtime==4.9.3)
RAY=ray==2.60.0

prepare() {
  mkdir -p "$WHEELS"
  local platform=(--only-binary=:all: --python-version 3.12 --implementation cp
                  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
                  --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps "${platform[@]}" -d "$WHEELS" "${CARRIED[@]}" || return 1
  python3 -m pip wheel -q --no-deps -w "$WHEELS" "${FROM_SOURCE[@]}" || return 1
  local tmp
  tmp=$(mktemp -d) || return 1
  python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp" "$RAY" || return 1
  (cd "$tmp" && unzip -q ray-*.whl && rm -rf ray-*.whl ray/core/src/ray/raylet \
     ray/core/src/ray/gcs ray/jars \
   && tar -cf - ray ray-*.dist-info | xz -T0 -9) > "$WHEELS/${RAY/==/-}-nodaemons.tar.xz" || return 1
  rm -rf "$tmp"
  du -sh "$WHEELS"
}

run() {
  mkdir -p "$EVIDENCE"
  # shellcheck source=ci/gpu_env.sh
  . ci/gpu_env.sh || return 1
  # NVLink multicast off, in this process and its children (KINDS.md)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export STACKFIX_EVIDENCE=$EVIDENCE
  python3 -c 'import sys, torch, verl, mbridge, megatron.core, ray; print(sys.version.split()[0], "torch", torch.__version__, torch.cuda.get_device_name(), "verl", verl.__version__, "megatron-core", megatron.core.__version__, "ray", ray.__version__)' \
    > "$EVIDENCE/verl-engine-environment.txt" 2>&1
  cat "$EVIDENCE/verl-engine-environment.txt"
  # The two models side by side (one process each: the GPU has room for both); each test runs
  # its three runs one after another, so the step time ratio compares like with like.
  local status=0 pids=() kind
  for kind in dense moe; do
    python3 -m pytest tests/test_verl_engine.py -m gpu -k "$kind" -p no:cacheprovider \
      -p no:xdist -rA -s "$@" > "$EVIDENCE/verl-engine-$kind.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  tail -n 5 "$EVIDENCE"/verl-engine-*.log
  return "$status"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash ci/gpu_verl_engine.sh prepare | run [pytest args...]" >&2; exit 2 ;;
esac
