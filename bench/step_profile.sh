#!/usr/bin/env bash
# Nsight Systems profile of training steps on the GPU machine, over a build made here and packed
# with `bash .ci/gpu --pack` (carry out/gpu-pack.tgz and out/dw: Debian's libdw1 and libelf1
# unpacked with dpkg -x, which the importer needs and the machine lacks).
#
#   bash bench/step_profile.sh NAME [train_125m.lua arguments...]
#
# Writes $OUT/NAME_kern.csv (time per kernel), NAME_api.csv (CUDA API calls: launches, copies,
# synchronisations) and NAME.log, and prints the top kernels and the per-step API counts.
# Steps are counted from the run's own arguments (steps=, default 20).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/gpu_env.sh"
name=$1; shift
steps=20
for a in "$@"; do case $a in steps=*) steps=${a#steps=} ;; esac; done
ns=/opt/nvidia/nsight-compute/2025.3.1/host/target-linux-x64/nsys
imp=/opt/nvidia/nsight-compute/2025.3.1/host/linux-desktop-glibc_2_11_3-x64/QdstrmImporter
rm -f /tmp/prof_$name.*
$ns profile -t cuda -o /tmp/prof_$name /work/main/build-gpu/moe-lua bench/train_125m.lua steps=$steps log_every=$steps \
  out_dir=/tmp/prof_run_$name "$@" > "$out/${name}.log" 2>&1
echo "$name: profile rc=$?"
LD_LIBRARY_PATH=$root/out/dw/usr/lib/x86_64-linux-gnu $imp -i /tmp/prof_$name.qdstrm >> "$out/${name}.log" 2>&1
$ns stats -r cuda_gpu_kern_sum,cuda_api_sum -f csv -o "$out/$name" /tmp/prof_$name.nsys-rep >> "$out/${name}.log" 2>&1
python3 - "$out/$name" "$steps" <<'PY'
import csv, sys
base, steps = sys.argv[1], int(sys.argv[2])
def rows(suffix):
    try:
        return list(csv.DictReader(open(f"{base}_{suffix}.csv")))
    except OSError:
        return []
k = rows("cuda_gpu_kern_sum")
tot = sum(float(r["Total Time (ns)"]) for r in k)
print(f"kernel time {tot / 1e6 / steps:.2f} ms per step (all {steps} steps incl. the first)")
for r in k[:12]:
    print(f"  {float(r['Total Time (ns)']) / 1e6 / steps:8.3f} ms/step {int(r['Instances']) / steps:7.1f}/step  {r['Name'][:90]}")
for r in rows("cuda_api_sum")[:12]:
    print(f"  api {r['Name']:<32} {int(r['Num Calls']) / steps:8.1f}/step {float(r['Total Time (ns)']) / 1e6 / steps:8.3f} ms/step")
PY
