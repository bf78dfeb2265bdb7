#!/usr/bin/env bash
# One call on the 2-GPU machine (kind nvidia-h100-x2) for moe.dist's NCCL engine: the GPU
# collective tests, then bench/dist_collectives.lua beside bench/dist_collectives_torch.py,
# each under `mpirun -n 2 --bind-to none`. Over a build made here and packed with
# `bash .ci/gpu --pack` (carry out/gpu-pack.tgz; there: tar xzf out/gpu-pack.tgz first).
#
#   bash bench/dist_round.sh [tests] [bench] [dp] [train46] [index] [layouts] [layouts2] [ckpt] [ckpt3] [scale125]
#                                                           (tests bench by default)
#
#   dp       tests/dist/dp_equivalence.lua with device=cuda (dp = 2 against one process, NCCL)
#   train46  the 46M dMoE of the MegaBlocks ladder (6 x 512, 64 experts top-1, seq 1024,
#            micro-batch 16 per GPU) on one GPU, then with `moe-lua launch -n 2` (dp = 2):
#            tokens/s per GPU, weak scaling
#   index    the CUDA index/routing tests (scatter_add's integer path)
#   layouts  expert parallelism and expert-tensor sharding (tests/dist/ep_train.lua), sharded
#            data parallelism (tests/dist/zero_equivalence.lua) and parameter sharding
#            (tests/dist/zero3_equivalence.lua) with device=cuda on 2 GPUs (LAYOUT_STEPS=N: fewer steps)
#   layouts2 the rest of the layout tests with device=cuda on 2 GPUs, their 2-rank cases (the
#            4-rank ones, HSDP 2 x 2 among them, stay on the CPU): ZeRO-3 with ep and with etp
#            (tests/dist/zero3_layouts.lua), layouts as Lua functions (tests/dist/layouts.lua),
#            per-GPU model-state bytes under FSDP from the CUDA allocator (tests/dist/fsdp_memory.lua),
#            and the collective timing with GPU tensors (tests/dist/comm_timing.lua, CUDA events)
#   ckpt     sharded checkpoints on 2 GPUs: tests/dist/ckpt_resume.lua and ckpt_ep.lua (its 2-rank
#            and one-process phases) with device=cuda, and tests/dist/ckpt_restart.lua: rank 1
#            killed with SIGKILL mid-step under --max-restarts 2 against an uninterrupted run;
#            then ckpt3
#   ckpt3    checkpoints of parameter sharding (tests/dist/ckpt_zero3.lua, its 2-rank cases)
#            with device=cuda on 2 GPUs
#   scale125 the 125M dMoE (12 x 768, 64 experts top-1, micro-batch 8 per GPU) on one GPU, then
#            on two with dp = 2, ep = 2, dp_shard = 2 (ZeRO-2) and dp_shard = 2 with
#            shard_params (ZeRO-3): tokens/s per GPU, peak and model-state memory per GPU;
#            then a 125M with more experts than one GPU holds (BIG_EXPERTS, default by the
#            card's memory) on one GPU (expected to run out of memory), with ep = 2 and with
#            ZeRO-3 (SCALE_STEPS=N: steps per run, default 60). The ep = 2 and ZeRO-3 runs time
#            their collectives (comm_profile=true: all_to_all, all_gather, reduce_scatter ms per
#            step on the communication stream); bench/layouts_report.py writes the table to
#            $OUT/layouts_125m.md (copy it to bench/results/dist/). SCALE_RUNS="gpu1 ep2 zero3" runs
#            only the named runs (of gpu1 dp2 ep2 zero2 zero3 big_gpu1 big_ep2 big_zero3);
#            SCALE_ARGS adds key=value arguments to every run (e.g. batch_size=32);
#            ZERO3_PREFETCH="2 4" adds ZeRO-3 runs gathering that many blocks ahead
#            (parallel.prefetch; the zero3 run keeps the default), named zero3_p<N>
#
# Logs and JSON go to $OUT (default out/), packed into one archive at the end; the last lines
# are a short summary and the moe / torch comparison table. DIST_ROUNDS=N times each side N
# times, alternating (default 1); DIST_ARGS adds key=value arguments to the Lua benchmark
# (e.g. DIST_ARGS="dtype=f32"; the torch side gets the same dtype through DIST_DTYPE).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/gpu_env.sh"
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
    layouts2)
      ls=${LAYOUT_STEPS:+steps=$LAYOUT_STEPS}
      timeout 300 $ml launch -n 2 tests/dist/zero3_layouts.lua device=cuda $ls > "$out/zero3_layouts_cuda.log" 2>&1
      note "zero3_layouts (cuda, 2-rank cases: ep = 2 x dp_shard = 2, etp = 2 x dp_shard = 2, shard_params): rc=$? ($(($(date +%s) - t0)) s); $(grep -o 'zero3_layouts: ok.*' "$out/zero3_layouts_cuda.log")"
      grep -E "within|FAILED|error" "$out/zero3_layouts_cuda.log" | head -6
      timeout 300 $ml launch -n 2 tests/dist/layouts.lua device=cuda $ls > "$out/layouts_cuda.log" 2>&1
      note "layouts (cuda: custom_layout ep = 2 x dp_shard = 2 with sharded attention, and the errors): rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "within|FAILED|error" "$out/layouts_cuda.log" | head -6
      timeout 300 $ml launch -n 2 tests/dist/fsdp_memory.lua device=cuda verbose=true > "$out/fsdp_memory_cuda.log" 2>&1
      note "fsdp_memory (cuda, CUDA allocator bytes): rc=$? ($(($(date +%s) - t0)) s); $(grep -o 'the largest ratio [0-9.]*' "$out/fsdp_memory_cuda.log")"
      grep -E "^rank|FAILED|error" "$out/fsdp_memory_cuda.log" | head -6
      MOE_DIST_DEVICE=cuda timeout 120 $ml launch -n 2 tests/dist/comm_timing.lua > "$out/comm_timing_cuda.log" 2>&1
      note "comm_timing (GPU tensors, NCCL, CUDA events): rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "calls|FAILED|error|ok" "$out/comm_timing_cuda.log" | head -9 ;;
    ckpt)
      timeout 300 $ml launch -n 2 tests/dist/ckpt_resume.lua device=cuda > "$out/ckpt_resume_cuda.log" 2>&1
      note "ckpt_resume (cuda, 2 GPUs): rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "bit|close|FAILED|rel" "$out/ckpt_resume_cuda.log" | head -8
      d=$(mktemp -d)
      timeout 300 $ml launch -n 2 tests/dist/ckpt_ep.lua device=cuda phase=save dir=$d/c > "$out/ckpt_ep_cuda.log" 2>&1
      note "ckpt_ep phase=save (cuda, ep = 2, etp = 2, ep x dp_shard): rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "bit|close|FAILED|rel" "$out/ckpt_ep_cuda.log" | head -8
      t1=$(date +%s)
      timeout 300 $ml launch -n 2 --max-restarts 2 tests/dist/ckpt_restart.lua device=cuda \
        dir=$d/k kill=true > "$out/ckpt_restart_cuda.log" 2>&1
      rk=$?; t2=$(date +%s)
      timeout 300 $ml launch -n 2 tests/dist/ckpt_restart.lua device=cuda dir=$d/u kill=false \
        > "$out/ckpt_restart_ref_cuda.log" 2>&1
      ru=$?
      cat $d/k/losses-1.txt > "$out/ckpt_restart_losses_restarted.txt" 2>/dev/null
      cat $d/u/losses-0.txt > "$out/ckpt_restart_losses_uninterrupted.txt" 2>/dev/null
      same=$(python3 - "$out" <<'PY'
import sys
o = sys.argv[1]
def rd(n):
    try: return dict(l.split() for l in open(f"{o}/ckpt_restart_losses_{n}.txt"))
    except OSError: return {}
a, b = rd("restarted"), rd("uninterrupted")
common = [s for s in a if s in b]
print(f"{sum(a[s] == b[s] for s in common)}/{len(common)} steps after the restart bit-identical" if common else "no losses")
PY
)
      note "ckpt_restart (cuda, kill -9 of rank 1 at step 7, --max-restarts 2): rc=$rk in $((t2 - t1)) s; uninterrupted rc=$ru; $same"
      grep -E "restart|died|resum" "$out/ckpt_restart_cuda.log" | head -6
      rm -rf $d ;&
    ckpt3)
      t1=$(date +%s)
      timeout 400 $ml launch -n 2 tests/dist/ckpt_zero3.lua device=cuda > "$out/ckpt_zero3_cuda.log" 2>&1
      note "ckpt_zero3 (cuda, 2 GPUs: ZeRO-3 checkpoints resumed on the same and other layouts): rc=$? ($(($(date +%s) - t1)) s)"
      grep -E "^ok|bit|close|FAILED|rel" "$out/ckpt_zero3_cuda.log" | head -12 ;;
    scale125)
      st=${SCALE_STEPS:-60}
      a125=(bench/train_125m.lua steps=$st log_every=10 data=data/bible_kjv ${SCALE_ARGS:-})
      run125() { # name launcher-args... -- train args...
        local name=$1; shift
        if [ -n "${SCALE_RUNS:-}" ] && [[ " $SCALE_RUNS " != *" $name "* ]]; then return; fi
        rm -rf /tmp/s125_$name # a run of an earlier call on a machine kept warm
        timeout 400 "$@" json="$out/s125_$name.json" out_dir=/tmp/s125_$name > "$out/s125_$name.log" 2>&1
        local rc=$?
        note "125M $name: rc=$rc $(grep -o '[0-9]* tokens/s, [0-9.]* ms/step.*GiB' "$out/s125_$name.log" | tail -1) ($(($(date +%s) - t0)) s)"
        local cl; cl=$(grep -o 'collectives per step.*' "$out/s125_$name.log" | tail -1)
        [ -n "$cl" ] && note "  $name: $cl"
        [ $rc -eq 0 ] || tail -4 "$out/s125_$name.log"
      }
      run125 gpu1 $ml "${a125[@]}"
      run125 dp2 $ml launch -n 2 "${a125[@]}"
      run125 ep2 $ml launch -n 2 "${a125[@]}" ep=2 comm_profile=true
      run125 zero2 $ml launch -n 2 "${a125[@]}" dp_shard=2
      run125 zero3 $ml launch -n 2 "${a125[@]}" dp_shard=2 shard_params=true comm_profile=true
      for pf in ${ZERO3_PREFETCH:-}; do
        run125 zero3_p$pf $ml launch -n 2 "${a125[@]}" dp_shard=2 shard_params=true comm_profile=true prefetch=$pf
      done
      mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      be=${BIG_EXPERTS:-$([ "$mem" -gt 100000 ] && echo 192 || echo 128)}
      b125=("${a125[@]}" experts=$be steps=$((st / 2)))
      run125 big_gpu1 $ml "${b125[@]}"
      run125 big_ep2 $ml launch -n 2 "${b125[@]}" ep=2 comm_profile=true
      run125 big_zero3 $ml launch -n 2 "${b125[@]}" dp_shard=2 shard_params=true comm_profile=true
      grep -hE "out of memory|OOM|cudaMalloc" "$out"/s125_big_gpu1.log 2>/dev/null | head -2
      python3 bench/layouts_report.py "$out" "$out/layouts_125m" > "$out/layouts_125m.log" 2>&1
      note "layouts_report.py: rc=$? (\$OUT/layouts_125m.md)" ;;
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
