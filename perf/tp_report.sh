#!/usr/bin/env bash
# Width 2 against width 1 on one machine (issue 32's table): synthetic:qwen3-8b (random 5-layer draft, synthetic
# acceptance), AR, DFlash and DDTree-15, the all-reduce plain and fused with the next norm (ENGINE_TP_FUSED_NORM=1),
# the draft replicated and sharded (ENGINE_SHARD_DRAFT=1), alternating so that drift shows; then the kernels of one
# width-2 step and of one DDTree-15 verify, each variant. Needs 2 GPUs.
#   bash perf/tp_report.sh [OUTDIR] [REPEATS]     (default tp-report/ and 3; tables to stdout, logs and traces there)
set -uo pipefail
out=${1:-tp-report}
repeats=${2:-3}
mkdir -p "$out"
bench=(-m engine bench --target synthetic:qwen3-8b --draft random:5 --acceptance synthetic --lengths short
       --repeats "$repeats" --methods ar,dflash,ddtree-15)
run() {  # name, environment assignments...: one bench, its table rows to stdout
  echo "== $1"
  env "${@:2}" timeout -s KILL 300 torchrun --nproc_per_node=2 "${bench[@]}" --tp 2 --json "$out/$1.json" \
    2>"$out/$1.log" | grep -E "^(ar|dflash|ddtree)"
}
echo "== tp1"
CUDA_VISIBLE_DEVICES=0 timeout -s KILL 300 python3 "${bench[@]}" --json "$out/tp1.json" 2>"$out/tp1.log" \
  | grep -E "^(ar|dflash|ddtree)"
for round in 1 2; do
  run "tp2-plain-$round" ENGINE_TP_FUSED_NORM=0
  run "tp2-fused-$round" ENGINE_TP_FUSED_NORM=1
done
run tp2-fused-sharded-draft ENGINE_TP_FUSED_NORM=1 ENGINE_SHARD_DRAFT=1
for v in 0 1; do
  for method in ar ddtree; do
    echo "== profile, width 2, $method, ENGINE_TP_FUSED_NORM=$v"
    ENGINE_TP_FUSED_NORM=$v timeout -s KILL 200 torchrun --nproc_per_node=2 -m perf.profile_round \
      --target synthetic:qwen3-8b --draft random:5 --method "$method" --budget 15 --by-stage --tp 2 --rows 12 \
      --replays 10 --trace "$out/trace-$method-fused$v" 2>>"$out/profile.log" | grep -A 14 "^verify"
  done
done
