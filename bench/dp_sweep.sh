#!/usr/bin/env bash
# Data-parallel weak scaling of the 46M dMoE on the 2-GPU machine, in one call: the one-GPU
# baseline twice (first and last, to see the drift), and dp = 2 under a few gradient bucket
# sizes and NCCL channel limits. Over a pack (tar xzf out/gpu-pack.tgz first). Each run writes
# $OUT/sweep_<name>.json; the last lines are a table of tokens/s per GPU against the baseline.
#
#   bash bench/dp_sweep.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/gpu_env.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
ml=/work/main/build-gpu/moe-lua
a46=(bench/train_125m.lua n_layers=6 d_model=512 n_heads=8 ffn=2048 experts=64 batch_size=16
     steps=${SWEEP_STEPS:-100} log_every=20 data=data/bible_kjv)
run() { # name "ENV=V ..." "launcher prefix" "extra key=value"
  local name=$1 envs=$2 prefix=$3 extra=$4
  env $envs timeout 300 $ml $prefix "${a46[@]}" $extra out_dir=/tmp/sweep_$name \
    json="$out/sweep_$name.json" > "$out/sweep_$name.log" 2>&1
  echo "$name: rc=$?"
}
declare -A spec=(
  [dp1]='||' [dp1_a]='||' [dp1_b]='||'
  [dp2_b25]='|launch -n 2|bucket_mb=25' [dp2_b100]='|launch -n 2|bucket_mb=100'
  [dp2_b5]='|launch -n 2|bucket_mb=5'
  [ep2]='|launch -n 2|ep=2'
  [dp2_b25_ctas8]='NCCL_MAX_CTAS=8|launch -n 2|bucket_mb=25'
  [dp2_b25_ch4]='NCCL_MAX_NCHANNELS=4|launch -n 2|bucket_mb=25'
)
# SWEEP_RUNS picks (and orders) the runs; the one-GPU baseline opens and closes the list.
# A suffix _r<k> repeats a run (dp2_b25_r2): the table then shows the median of each.
for name in ${SWEEP_RUNS:-dp1_a dp2_b25 dp2_b100 dp2_b5 dp2_b25_ctas8 dp2_b25_ch4 dp1_b}; do
  IFS='|' read -r e p x <<< "${spec[${name%_r[0-9]*}]}"
  run "$name" "$e" "$p" "$x"
done
python3 - "$out" <<'PY'
import json, os, re, statistics, sys
out = sys.argv[1]
runs = {}
for f in sorted(os.listdir(out)):
    m = re.match(r"sweep_(.+?)(_r\d+)?\.json$", f)
    if m:
        runs.setdefault(m.group(1), []).append(json.load(open(os.path.join(out, f))))
base = [r["tokens_per_s"] for k in ("dp1", "dp1_a", "dp1_b") for r in runs.get(k, [])]
b = statistics.median(base) if base else None
print("| run | n | tokens/s per GPU (median) | all | ms/step (median) | vs one GPU |")
print("|---|---|---|---|---|---|")
for k, rs in runs.items():
    t = [r["tokens_per_s"] for r in rs]
    ms = statistics.median(r["ms_per_step"] for r in rs)
    tm = statistics.median(t)
    print(f"| {k} | {len(t)} | {tm:.0f} | {' '.join('%.0f' % x for x in t)} | {ms:.2f} | "
          + (f"{tm / b:.3f} |" if b else "|"))
PY
(cd "$out" && tar czf /tmp/dp_sweep.tgz sweep_* && rm -f sweep_* && mv /tmp/dp_sweep.tgz .)
