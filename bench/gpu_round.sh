#!/usr/bin/env bash
# One call on the GPU machine for the checks and benchmarks of the MoE work,
# over a build made here and packed with `bash .ci/gpu --pack` (carry .deps
# and data). Each step writes its logs and JSON under $OUT; the last lines of
# the output are a short summary.
#
#   bash bench/gpu_round.sh [tests] [quickstart] [glu_check] [moe_mlp] [matmul]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out}; mkdir -p "$out"
cd "$root"
[ -e build-gpu ] || ln -s "$root/.deps/gpu" build-gpu
if [ "$root" != /work/main ] && [ ! -e /work/main ]; then mkdir -p /work && ln -s "$root" /work/main; fi
export LUA_PATH="$root/.deps/lua/share/?.lua;$root/.deps/lua/share/?/init.lua;;"
export LUA_CPATH="$root/.deps/lua/lib/?.so;;"
ml=/work/main/build-gpu/moe-lua
summary=()
note() { summary+=("$1"); }
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests quickstart glu_check moe_mlp)
for s in "${steps[@]}"; do
  t0=$(date +%s)
  case $s in
    tests)
      (cd build-gpu && ctest -j4 --output-on-failure) > "$out/ctest.log" 2>&1
      note "tests: rc=$? $(grep -E 'tests passed' "$out/ctest.log") ($(($(date +%s) - t0)) s)"
      grep -E "Failed|\*\*\*Timeout" "$out/ctest.log" | head -20 ;;
    quickstart)
      $ml experiments/quickstart.lua device=cuda out_dir="$out/quickstart" > "$out/quickstart.log" 2>&1
      note "quickstart(cuda): rc=$? $(grep -E 'validation loss' "$out/quickstart.log" | tail -1) ($(($(date +%s) - t0)) s)"
      tail -5 "$out/quickstart.log" ;;
    glu_check)
      mkdir -p "$out/glu" && $ml bench/moe_glu_check.lua --dir "$out/glu" > "$out/glu_check.log" 2>&1 &&
        python3 bench/moe_glu_check.py "$out/glu" >> "$out/glu_check.log" 2>&1
      note "glu_check: rc=$? $(grep -E 'PASS|FAIL' "$out/glu_check.log" | tail -1)" ;;
    moe_mlp)
      $ml bench/moe_mlp.lua --json "$out/moe_mlp_moe.json" > "$out/moe_mlp_moe.log" 2>&1
      python3 bench/moe_mlp_torch.py --json "$out/moe_mlp_torch.json" > "$out/moe_mlp_torch.log" 2>&1
      python3 bench/moe_mlp_report.py "$out/moe_mlp_moe.json" "$out/moe_mlp_torch.json" "$out" \
        --command "bash bench/gpu_round.sh moe_mlp" > "$out/moe_mlp_report.log" 2>&1
      note "moe_mlp: rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "\| (grouped|sparse|torch_grouped_mm) \||NOT met|: met" "$out/moe_mlp.md" ;;
    matmul)
      $ml bench/matmul.lua --json "$out/matmul_moe.json" > "$out/matmul_moe.log" 2>&1
      python3 bench/matmul_torch.py --json "$out/matmul_torch.json" > "$out/matmul_torch.log" 2>&1
      python3 bench/matmul_report.py "$out/matmul_moe.json" "$out/matmul_torch.json" "$out" \
        --command "bash bench/gpu_round.sh matmul" > "$out/matmul_report.log" 2>&1
      note "matmul: rc=$? ($(($(date +%s) - t0)) s)" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
# The machine hands back only a few files: everything small goes into one archive.
(cd "$out" && tar czf round.tgz --exclude='*.safetensors' --exclude='tb' --exclude=round.tgz . &&
  find . -mindepth 1 -maxdepth 1 ! -name round.tgz -exec rm -rf {} +)
echo "== summary =="
printf '%s\n' "${summary[@]}"
