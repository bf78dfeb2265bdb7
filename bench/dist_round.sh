#!/usr/bin/env bash
# One call on the 2-GPU machine (kind nvidia-h100-x2) for moe.dist's NCCL engine: the GPU
# collective tests, then bench/dist_collectives.lua beside bench/dist_collectives_torch.py,
# each under `mpirun -n 2 --bind-to none`. Over a build made here and packed with
# `bash .ci/gpu --pack` (carry out/gpu-pack.tgz; there: tar xzf out/gpu-pack.tgz first).
#
#   bash bench/dist_round.sh [tests] [bench] [dp] [train46] [index]   (tests bench by default)
#
#   dp       tests/dist/dp_equivalence.lua with device=cuda (dp = 2 against one process, NCCL)
#   train46  the 46M dMoE of the MegaBlocks ladder (6 x 512, 64 experts top-1, seq 1024,
#            micro-batch 16 per GPU) on one GPU, then with `moe-lua launch -n 2` (dp = 2):
#            tokens/s per GPU, weak scaling
#   index    the CUDA index/routing tests (scatter_add's integer path)
#   layouts  expert parallelism and expert-tensor sharding (tests/dist/ep_train.lua), sharded
#            data parallelism (tests/dist/zero_equivalence.lua) and parameter sharding
#            (tests/dist/zero3_equivalence.lua) with device=cuda on 2 GPUs (LAYOUT_STEPS=N: fewer steps)
#
# Logs and JSON go to $OUT (default out/), packed into one archive at the end; the last lines
# are a short summary and the moe / torch comparison table. DIST_ROUNDS=N times each side N
# times, alternating (default 1); DIST_ARGS adds key=value arguments to the Lua benchmark
# (e.g. DIST_ARGS="dtype=f32"; the torch side gets the same dtype through DIST_DTYPE).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out}; mkdir -p "$out"
cd "$root"
[ -e build-gpu ] || ln -s "$root/.deps/gpu" build-gpu
if [ "$root" != /work/main ] && [ ! -e /work/main ]; then mkdir -p /work && ln -s "$root" /work/main; fi
export LUA_PATH="$root/.deps/lua/share/?.lua;$root/.deps/lua/share/?/init.lua;;"
export LUA_CPATH="$root/.deps/lua/lib/?.so;;"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
export MASTER_PORT=${MASTER_PORT:-29533}
ml=/work/main/build-gpu/moe-lua
dtype=${DIST_DTYPE:-bf16}
mpi=(mpirun -n 2 --bind-to none -x LUA_PATH -x LUA_CPATH -x NCCL_NVLS_ENABLE -x MASTER_PORT)
summary=()
note() { summary+=("$1"); }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$out/gpus.txt"
$ml --version > "$out/version.txt" 2>&1
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests bench)
for s in "${steps[@]}"; do
  t0=$(date +%s)
  case $s in
    tests)
      timeout 300 "${mpi[@]}" $ml tests/dist/gpu_collectives.lua > "$out/test_gpu_collectives.log" 2>&1
      rc=$?
      note "tests/dist/gpu_collectives.lua: rc=$rc, $(grep -c '^PASS' "$out/test_gpu_collectives.log") PASS, $(grep -c ': OK$' "$out/test_gpu_collectives.log") ranks OK ($(($(date +%s) - t0)) s)"
      [ $rc -eq 0 ] || tail -20 "$out/test_gpu_collectives.log"
      grep -E "moe-lua: \[rank|rank 0: " "$out/test_gpu_collectives.log" | head -5
      # the CPU (MPI) dist tests of the suite, on this machine too
      MOE_DIST_DEVICE=cuda timeout 300 $ml launch -n 2 tests/dist/functional.lua \
        > "$out/test_gpu_functional.log" 2>&1
      note "tests/dist/functional.lua (GPU tensors, NCCL): rc=$?"
      timeout 300 $ml launch -n 2 tests/dist/dp_layers.lua device=cuda > "$out/test_gpu_dp_layers.log" 2>&1
      note "tests/dist/dp_layers.lua (GPU, NCCL): rc=$? $(grep -c '^ok' "$out/test_gpu_dp_layers.log") ok"
      MOE_DIST_DEVICE=cuda timeout 300 $ml launch -n 2 tests/dist/debug.lua > "$out/test_gpu_debug.log" 2>&1
      note "tests/dist/debug.lua (GPU tensors): rc=$?"
      t1=$(date +%s)
      MOE_DIST_DEVICE=cuda timeout 300 $ml launch -n 2 tests/dist/launch_kill_train.lua \
        > "$out/test_gpu_kill.log" 2>&1
      note "kill -9 of rank 1 mid-step (GPU training): launcher rc=$? after $(($(date +%s) - t1)) s; $(grep -o 'rank 1 died without a word[^)]*)' "$out/test_gpu_kill.log" | head -1)"
      for sc in collectives functional debug timeout; do
        timeout 300 "${mpi[@]}" $ml tests/dist/$sc.lua > "$out/test_cpu_$sc.log" 2>&1
        note "tests/dist/$sc.lua (CPU, 2 ranks): rc=$?"
      done ;;
    bench)
      for n in $(seq 1 "${DIST_ROUNDS:-1}"); do
        timeout 600 "${mpi[@]}" $ml bench/dist_collectives.lua dtype=$dtype ${DIST_ARGS:-} \
          json="$out/dist_moe_$n.json" > "$out/dist_moe_$n.log" 2>&1
        note "moe.dist bench #$n: rc=$? ($(($(date +%s) - t0)) s)"
        timeout 600 "${mpi[@]}" python3 bench/dist_collectives_torch.py --dtype $dtype \
          --json "$out/dist_torch_$n.json" > "$out/dist_torch_$n.log" 2>&1
        note "torch bench #$n: rc=$? ($(($(date +%s) - t0)) s)"
      done
      python3 - "$out" "${DIST_ROUNDS:-1}" > "$out/dist_compare.md" 2>&1 <<'EOF'
import json, os, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def load(kind):
    best = {}
    for n in range(1, rounds + 1):
        p = os.path.join(out, f"dist_{kind}_{n}.json")
        if not os.path.exists(p):
            continue
        for r in json.load(open(p))["results"]:
            k = (r["op"], r["mib"])
            if k not in best or r["busbw_gbps"] > best[k]["busbw_gbps"]:
                best[k] = r
    return best
m, t = load("moe"), load("torch")
print("| op | MiB per rank | moe.dist ms | torch ms | moe busbw GB/s | torch busbw GB/s | moe / torch |")
print("|---|---|---|---|---|---|---|")
for k in sorted(set(m) | set(t), key=lambda k: (k[0], k[1])):
    a, b = m.get(k), t.get(k)
    f = lambda r, key, fmt: (fmt % r[key]) if r else "not run"
    ratio = "%.2f" % (a["busbw_gbps"] / b["busbw_gbps"]) if a and b else "-"
    print(f"| {k[0]} | {k[1]} | {f(a, 'ms', '%.3f')} | {f(b, 'ms', '%.3f')} | "
          f"{f(a, 'busbw_gbps', '%.1f')} | {f(b, 'busbw_gbps', '%.1f')} | {ratio} |")
EOF
      ;;
    dp)
      timeout 600 $ml launch -n 2 tests/dist/dp_equivalence.lua device=cuda verbose=true \
        > "$out/dp_equivalence_cuda.log" 2>&1
      note "dp_equivalence (cuda, 2 GPUs): rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "max rel|bit-identical|FAILED|ok$|error" "$out/dp_equivalence_cuda.log" | head -14 ;;
    train46)
      a46=(bench/train_125m.lua n_layers=6 d_model=512 n_heads=8 ffn=2048 experts=64 batch_size=16
           steps=${TRAIN46_STEPS:-120} log_every=20 data=data/bible_kjv)
      timeout 600 $ml "${a46[@]}" out_dir=/tmp/t46_dp1 json="$out/train46_dp1.json" \
        > "$out/train46_dp1.log" 2>&1
      note "train46 dp=1: rc=$? ($(($(date +%s) - t0)) s)"
      timeout 600 $ml launch -n 2 "${a46[@]}" out_dir=/tmp/t46_dp2 json="$out/train46_dp2.json" \
        > "$out/train46_dp2.log" 2>&1
      note "train46 dp=2: rc=$? ($(($(date +%s) - t0)) s)"
      python3 bench/train46_compare.py "$out" > "$out/train46_compare.md" 2>&1
      cat "$out/train46_compare.md" ;;
    layouts)
      ls=${LAYOUT_STEPS:+steps=$LAYOUT_STEPS}
      timeout 300 $ml launch -n 2 tests/dist/ep_train.lua device=cuda verbose=true $ls > "$out/ep_train_cuda.log" 2>&1
      note "ep_train (cuda: ep = 2, etp = 2, ep = 2 x dp_shard = 2): rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "max|FAILED|ok" "$out/ep_train_cuda.log" | grep -v "^ *step" | head -8
      timeout 300 $ml launch -n 2 tests/dist/zero_equivalence.lua device=cuda $ls > "$out/zero_cuda.log" 2>&1
      note "zero_equivalence (cuda, dp_shard = 2): rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "max|bit|FAILED|ok$" "$out/zero_cuda.log" | head -8
      timeout 300 $ml launch -n 2 tests/dist/zero3_equivalence.lua device=cuda $ls > "$out/zero3_cuda.log" 2>&1
      note "zero3_equivalence (cuda, dp_shard = 2, shard_params): rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "max|bit|FAILED|ok$" "$out/zero3_cuda.log" | head -8 ;;
    index)
      (cd build-gpu && ctest -R "index_cuda|routing_cuda|routers|grouped_cuda" --output-on-failure) \
        > "$out/index_tests.log" 2>&1
      note "index tests: rc=$? $(grep -E 'tests passed' "$out/index_tests.log")" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
(cd "$out" && tar czf /tmp/dist_round.tgz --exclude='*.tgz' . &&
  find . -mindepth 1 -maxdepth 1 ! -name '*.tgz' -exec rm -rf {} + && mv /tmp/dist_round.tgz .)
echo "== summary =="
printf '%s\n' "${summary[@]}"
if [ -f "$out/dist_round.tgz" ] && tar xzf "$out/dist_round.tgz" -O ./dist_compare.md >/dev/null 2>&1; then
  echo "== moe.dist vs torch.distributed ($dtype, best of ${DIST_ROUNDS:-1}; busbw as nccl-tests) =="
  tar xzf "$out/dist_round.tgz" -O ./dist_compare.md
fi
