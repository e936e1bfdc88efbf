# shellcheck shell=bash
# Sourced (". ci/gpu_env.sh") on a CUDA machine without network, from the repository root: installs
# the wheels carried in $WHEELS (default ./.whl) into a private target ($SITE) so the image's own
# CUDA torch stays as it is, verl releases carried in $WHEELS/verl under $STACKFIX_VERL_ROOT (the
# layout of `python -m repro.verl_release install`), and points STACKFIX_MEGATRON_LM at a
# Megatron-LM dev tree in ./.megatron-lm when one is there. ci/gpu_offline.sh and one-off GPU
# batches (python -m benchmarks.megatron_scale ...) both start from it.
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/stackfix-site}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || return 1
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# A package packed as a tarball of its installed files (ci/gpu_verl_engine.sh: ray without its
# cluster daemons, to fit one call) goes into the same target.
for tarball in "$WHEELS"/*.tar.xz; do
  [ -e "$tarball" ] || continue
  mkdir -p "$SITE" && tar -xJf "$tarball" -C "$SITE" || return 1
  case ":$PYTHONPATH:" in *":$SITE:"*) ;; *) export PYTHONPATH="$SITE:$PYTHONPATH" ;; esac
done
if compgen -G "$WHEELS/verl/verl-*.whl" >/dev/null; then
  export STACKFIX_VERL_ROOT=${STACKFIX_VERL_ROOT:-/tmp/stackfix-verl}
  for whl in "$WHEELS"/verl/verl-*.whl; do
    version=$(basename "$whl" | cut -d- -f2)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
      --target "$STACKFIX_VERL_ROOT/$version" "$whl" || return 1
  done
fi
if [ -d .megatron-lm/megatron ]; then
  export STACKFIX_MEGATRON_LM=${STACKFIX_MEGATRON_LM:-$PWD/.megatron-lm}
fi
# The tree's own history, where the caller carried it as a git bundle (.gpu/head.bundle: `git
# bundle create .gpu/head.bundle HEAD` here): a copy of the tree on another machine may hold a
# stale .git (the device tool's named the session's first commit), and pytest-benchmark and
# ci/gpu_run.py record the commit and whether the tree is dirty from git.
if [ -f .gpu/head.bundle ] && command -v git >/dev/null; then
  bundled=$(git bundle list-heads .gpu/head.bundle | awk 'NR == 1 {print $1}')
  if [ "$(git rev-parse -q --verify HEAD 2>/dev/null)" != "$bundled" ]; then  # once per tree
    rm -rf .git && git init -q && git fetch -q .gpu/head.bundle HEAD && git reset -q FETCH_HEAD \
      || return 1
  fi
  # Tracked files left out of the copy come back from the bundle (a device's copy of the tree
  # is size-limited: the evidence folders, tens of MiB, are left out of it; missing, they made
  # every run read "-dirty"). A file changed in the copy is left as it is.
  git ls-files -d -z | xargs -0 -r git checkout -q -- || return 1
  export STACKFIX_COMMIT=${STACKFIX_COMMIT:-$bundled}
fi
export PYTHONUNBUFFERED=1
