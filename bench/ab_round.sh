#!/usr/bin/env bash
# A/B on one GPU machine in one call: the build of a base commit and the build of this
# tree, interleaved: the whole ctest suite of this tree (AB_TESTS=1), short training runs of
# the MegaBlocks ladder dMoE 46M / 125M and the dense GPT (AB_MODELS="46 125 dense"),
# AB_ROUNDS rounds, and with AB_MLP=1 / AB_ATTN=1 the MoE MLP and attention benchmarks
# (moe side).
#
# Here, with the base commit checked out in /work/main (the builds carry absolute paths):
#   cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release && cmake --build build-gpu -j
#   bash .ci/gpu --pack && mv out/gpu-pack.tgz out/base.tgz
#   git archive HEAD lua bench experiments tests | gzip > out/base_src.tgz
# then the same build and pack (out/gpu-pack.tgz) of the new commit; carry out/ and run
#   bash bench/ab_round.sh
# there. AB_BASE_FLAGS=1 (default) when the base benchmarks take --json FILE, 0 for json=FILE.
set -uo pipefail
cd "$(dirname "$0")/.."
new=$(pwd)
out=${OUT:-$new/out/ab}; mkdir -p "$out"
tests=${AB_TESTS:-1} rounds=${AB_ROUNDS:-2} models=${AB_MODELS-46 125 dense}
mlp=${AB_MLP:-0} attn=${AB_ATTN:-0} base_flags=${AB_BASE_FLAGS:-1}
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
# /work/main is where both builds look for their Lua files: a link, switched per run
if [ "$new" = /work/main ] && [ ! -L /work/main ]; then mv /work/main /work/main_new; new=/work/main_new; cd "$new"; fi
mkdir -p /work
tar xzf out/gpu-pack.tgz && ln -sfn "$new/.deps/gpu" build-gpu
base=/tmp/moe-ab-base; rm -rf $base; mkdir -p $base
tar xzf out/base_src.tgz -C $base && tar xzf out/base.tgz -C $base && ln -sfn $base/.deps/gpu $base/build-gpu
use() {
  ln -sfn "$1" /work/main; cd "$1"
  export LUA_PATH="$1/.deps/lua/share/?.lua;$1/.deps/lua/share/?/init.lua;;" LUA_CPATH="$1/.deps/lua/lib/?.so;;"
}
ml=/work/main/build-gpu/moe-lua
use "$new"
if [ "$tests" = 1 ]; then
  t0=$(date +%s)
  (cd build-gpu && ctest -j4 --output-on-failure) > "$out/ctest.log" 2>&1
  echo "new tests rc=$? $(grep -E 'tests passed' "$out/ctest.log") $(($(date +%s) - t0)) s"
  grep -E "\(Failed\)|Timeout" "$out/ctest.log" | head
fi
for k in $(seq 1 "$rounds"); do
  for v in base new; do
    use "$([ $v = base ] && echo $base || echo "$new")"
    if [ $v = base ] && [ "$base_flags" = 1 ]; then J() { echo "--json $1"; }; else J() { echo "json=$1"; }; fi
    for m in $models; do
      case $m in
        46) a="d_model=512 n_layers=6 n_heads=8 ffn=2048 batch_size=16 steps=60" ;;
        125) a="experts=64 batch_size=8 steps=40" ;;
        dense) a="kind=dense batch_size=8 steps=40" ;;
        *) echo "unknown model $m"; exit 2 ;;
      esac
      f=$out/train_${v}_${m}_$k.json
      $ml bench/train_125m.lua $a log_every=10 data=data/bible_kjv out_dir=/tmp/moe-ab-$m json="$f" \
        > "${f%.json}.log" 2>&1
      echo "$v train $m #$k rc=$? $(python3 -c "import json,sys;j=json.load(open(sys.argv[1]))
print('ms/step %.2f tok/s %d peak %.2f GB loss %.4f' % (j['ms_per_step'], j['tokens_per_s'],
      j['peak_allocated_bytes'] / 1e9, j['last_loss']))" "$f" 2>&1 | tail -1)"
    done
    if [ "$mlp" = 1 ]; then
      $ml bench/moe_mlp.lua $(J "$out/mlp_${v}_$k.json") > "$out/mlp_${v}_$k.log" 2>&1
      echo "$v moe_mlp #$k rc=$?"
    fi
    if [ "$attn" = 1 ]; then
      $ml bench/attention.lua $(J "$out/attn_${v}_$k.json") > "$out/attn_${v}_$k.log" 2>&1
      echo "$v attention #$k rc=$?"
    fi
  done
done
# the machine hands back few files: one archive
(cd "$out" && tar czf /tmp/moe-ab.tgz . && find . -mindepth 1 -maxdepth 1 -exec rm -rf {} + &&
  mv /tmp/moe-ab.tgz .)
