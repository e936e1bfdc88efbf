#!/bin/bash
# Wall time of the runner's cheap answers and of one CPU repro, 3 runs each, with the 1-minute
# load average at each start (the CPU machines are shared). Usage, from a checkout:
#   benchmarks/cli_timing.sh LABEL [PYTHON] > results.tsv
# Columns: label, arguments, exit status, seconds, load. STACKFIX_MEGATRON_LM is unset.
label=${1:?label}; py=${2:-python}
unset STACKFIX_MEGATRON_LM
for args in "--help" "--list" "--only nosuch" "--only mtp-shape-megatron-dev" \
            "--only mtp-shape-megatron-dev-verl080" "--only mesh-recompute"; do
  for _ in 1 2 3; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    $py -m repro $args >/dev/null 2>&1; rc=$?
    end=$(date +%s.%N)
    printf "%s\t%s\t%d\t%.2f\tload1=%s\n" "$label" "$args" "$rc" "$(echo "$end - $start" | bc)" "$load"
  done
done
