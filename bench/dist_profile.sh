#!/usr/bin/env bash
# Nsight Systems traces of the 125M dMoE's layouts on the GPU machine, every rank, and how much of
# the collectives' time the step waits on (bench/overlap_report.py). Over a build made here and
# packed with `bash .ci/gpu --pack` (carry out/gpu-pack.tgz and out/dw, as bench/step_profile.sh).
#
#   bash bench/dist_profile.sh RUN [RUN ...]      RUN: gpu1 dp2 ep2 zero2 zero3, or
#                                                 NAME:key=value,key=value (extra arguments)
#
# Each run: bench/train_125m.lua for PROF_STEPS steps (default 14) under nsys (one process, or
# mpirun -n 2 with one trace per rank), its GPU trace as CSV ($OUT/NAME.rR.csv.gz), and one
# table over all runs in $OUT/overlap.md (printed at the end). PROF_ARGS adds key=value
# arguments to every run.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/gpu_env.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
export MASTER_PORT=${MASTER_PORT:-29541}
ns=/opt/nvidia/nsight-compute/2025.3.1/host/target-linux-x64/nsys
imp=/opt/nvidia/nsight-compute/2025.3.1/host/linux-desktop-glibc_2_11_3-x64/QdstrmImporter
ml=/work/main/build-gpu/moe-lua
st=${PROF_STEPS:-14}
args=(bench/train_125m.lua steps=$st log_every=$((st / 2)) data=data/bible_kjv ${PROF_ARGS:-})
traces=()
for run in "$@"; do
  name=${run%%:*}; extra=()
  [ "$name" != "$run" ] && IFS=, read -r -a extra <<< "${run#*:}"
  case $name in
    gpu1*) n=1; lay=() ;;
    dp2*) n=2; lay=() ;;
    ep2*) n=2; lay=(ep=2) ;;
    zero2*) n=2; lay=(dp_shard=2) ;;
    zero3*) n=2; lay=(dp_shard=2 shard_params=true) ;;
    *) echo "unknown run $name"; continue ;;
  esac
  rm -rf /tmp/dprof_$name.* /tmp/dprof_run_$name
  t0=$(date +%s)
  if [ $n = 1 ]; then
    timeout 300 $ns profile -t cuda --sample=none --cpuctxsw=none -o /tmp/dprof_$name.r0 \
      $ml "${args[@]}" "${lay[@]}" "${extra[@]}" out_dir=/tmp/dprof_run_$name > "$out/$name.log" 2>&1
  else
    timeout 400 mpirun -n 2 --bind-to none -x LUA_PATH -x LUA_CPATH -x NCCL_NVLS_ENABLE -x MASTER_PORT \
      $ns profile -t cuda --sample=none --cpuctxsw=none -o "/tmp/dprof_$name.r%q{OMPI_COMM_WORLD_RANK}" \
      $ml "${args[@]}" "${lay[@]}" "${extra[@]}" out_dir=/tmp/dprof_run_$name > "$out/$name.log" 2>&1
  fi
  echo "$name: rc=$? ($(($(date +%s) - t0)) s) $(grep -o '[0-9]* tokens/s, [0-9.]* ms/step' "$out/$name.log" | tail -1)"
  for r in $(seq 0 $((n - 1))); do
    p=/tmp/dprof_$name.r$r
    LD_LIBRARY_PATH=$root/out/dw/usr/lib/x86_64-linux-gnu $imp -i $p.qdstrm >> "$out/$name.log" 2>&1
    $ns stats -r cuda_gpu_trace -f csv -o $p $p.nsys-rep >> "$out/$name.log" 2>&1
    if [ -f ${p}_cuda_gpu_trace.csv ]; then
      cp ${p}_cuda_gpu_trace.csv /tmp/$name.r$r.csv
      traces+=(/tmp/$name.r$r.csv)
      gzip -c /tmp/$name.r$r.csv > "$out/$name.r$r.csv.gz"
    else
      echo "$name rank $r: no trace"
    fi
  done
done
python3 bench/overlap_report.py "${PROF_TITLE:-125M dMoE by layout}" "${traces[@]}" | tee "$out/overlap.md"
