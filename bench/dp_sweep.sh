#!/usr/bin/env bash
# Data-parallel weak scaling of the 46M dMoE on the 2-GPU machine, in one call: the one-GPU
# baseline twice (first and last, to see the drift), and dp = 2 under a few gradient bucket
# sizes and NCCL channel limits. Over a pack (tar xzf out/gpu-pack.tgz first). Each run writes
# $OUT/sweep_<name>.json; the last lines are a table of tokens/s per GPU against the baseline.
#
#   bash bench/dp_sweep.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out}; mkdir -p "$out"
cd "$root"
[ -e build-gpu ] || ln -s "$root/.deps/gpu" build-gpu
if [ "$root" != /work/main ] && [ ! -e /work/main ]; then mkdir -p /work && ln -s "$root" /work/main; fi
export LUA_PATH="$root/.deps/lua/share/?.lua;$root/.deps/lua/share/?/init.lua;;"
export LUA_CPATH="$root/.deps/lua/lib/?.so;;"
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
run dp1_a "MOE_X=1" "" ""
run dp2_b25 "MOE_X=1" "launch -n 2" "bucket_mb=25"
run dp2_b100 "MOE_X=1" "launch -n 2" "bucket_mb=100"
run dp2_b5 "MOE_X=1" "launch -n 2" "bucket_mb=5"
run dp2_b25_ctas8 "NCCL_MAX_CTAS=8" "launch -n 2" "bucket_mb=25"
run dp2_b25_ch4 "NCCL_MAX_NCHANNELS=4" "launch -n 2" "bucket_mb=25"
run dp1_b "MOE_X=1" "" ""
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def get(n):
    p = os.path.join(out, f"sweep_{n}.json")
    return json.load(open(p)) if os.path.exists(p) else None
base = [r["tokens_per_s"] for r in (get("dp1_a"), get("dp1_b")) if r]
b = sum(base) / len(base) if base else None
print("| run | tokens/s per GPU | ms/step | vs one GPU (mean of two) |")
print("|---|---|---|---|")
for n in ["dp1_a", "dp1_b", "dp2_b25", "dp2_b100", "dp2_b5", "dp2_b25_ctas8", "dp2_b25_ch4"]:
    r = get(n)
    if not r:
        print(f"| {n} | not run | | |"); continue
    print(f"| {n} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.2f} | "
          f"{r['tokens_per_s'] / b:.3f} |" if b else f"| {n} | {r['tokens_per_s']:.0f} | | |")
PY
