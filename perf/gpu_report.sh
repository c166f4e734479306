#!/usr/bin/env bash
# The GPU tables of docs/performance.md in one run: synthetic:qwen3-8b (random 5-layer draft, synthetic acceptance)
# and the embedded default pair (real acceptance), the registry's methods and workloads at the short length, each
# against transformers' generate in the same process; the kernels of a DDTree-15 round by device time; each Triton
# kernel against its reference.
#   bash perf/gpu_report.sh [OUTDIR]     (default gpu-report/; JSON results, logs and the profile land there)
set -euo pipefail
out=${1:-gpu-report}
mkdir -p "$out"
run() {  # name, then bench arguments: the table to stdout, the progress bar to a log
  echo "== $1"
  python3 -m engine bench --lengths short --hf-baseline --json "$out/$1.json" "${@:2}" 2>"$out/$1.log"
}
run qwen3-8b-synthetic --target synthetic:qwen3-8b --draft random:5 --acceptance synthetic
run default
echo "== profile: synthetic:qwen3-8b, DDTree budget 15"
python3 -m perf.profile_round --target synthetic:qwen3-8b --draft random:5 --method ddtree --budget 15 --rows 20 \
  | tee "$out/profile-qwen3-8b-ddtree15.txt" | head -30
echo "== kernels against their references"
python3 -m perf.kernel_times --json "$out/kernel-times.json" 2>"$out/kernel-times.log"
