#!/usr/bin/env bash
# One call on one GPU for the training step: the GPU's GEMM rate and copy bandwidth (torch),
# then per model moe-lua (bench/train_125m.lua: a timed run, then a profiled run) and the PyTorch
# reference (bench/train_torch.py eager, and compiled when it takes --compile) on the same model
# and batch, the floor of the step (bench/step_floor.lua at the rates just measured), and one
# JSON + markdown table. Builds nothing: runs over a build made here and packed with
# `bash .ci/gpu --pack` (carry out/gpu-pack.tgz; there: tar xzf out/gpu-pack.tgz first), as
# bench/dist_round.sh does.
#
#   bash bench/step_round.sh [dmoe46] [dmoe125] [dense125]      (all three by default)
#
#   dmoe46    6 x 512, 64 experts top-1, ffn 2048, seq 1024, micro-batch 16
#   dmoe125   12 x 768, 64 experts top-1, ffn 3072, seq 1024, micro-batch 8
#   dense125  the dense GPT-125M (12 x 768, ffn 3072), micro-batch 8
#
# STEP_STEPS=N steps per timed run (default 40; tokens/s over the log intervals after the
# first 10 steps), STEP_PROFILE=N profiled steps (default 8; 0: no profile run), STEP_DATA=
# the dataset prefix (default data/bible_kjv), STEP_TORCH=0 skips PyTorch, STEP_BALANCE=N adds
# the routing-balance comparison of each dMoE over N steps (moe-lua and PyTorch from the same
# weights and batches, bench/balance_compare.py; run last), STEP_ARGS= more
# key=value arguments for train_125m.lua (after the model's), STEP_MOE_LUA= the moe-lua to run. Logs and JSON go to
# $OUT (default bench/results/step); the summary is $OUT/step_round.json and step_round.md,
# and the last lines printed are its short table. The call keeps within STEP_BUDGET seconds
# (default 570: the device machine allows 600 a command): parts that would not fit are skipped
# and named in the summary; all three models with torch.compile may need two calls (e.g.
# `dmoe46 dense125`, then `dmoe125`), each with its own rates and floor.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$root/bench/results/step}
. "$root/bench/gpu_env.sh"
ml=${STEP_MOE_LUA:-/work/main/build-gpu/moe-lua}
steps=${STEP_STEPS:-40}
psteps=${STEP_PROFILE:-8}
data=${STEP_DATA:-data/bible_kjv}
models=("$@"); [ ${#models[@]} -eq 0 ] && models=(dmoe46 dmoe125 dense125)
summary=()
note() { summary+=("$1"); echo "$1"; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
$ml --version > "$out/version.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda)" > "$out/torch_version.txt" 2>&1

# the ceilings: bf16 8192^3 GEMM, and a device-to-device copy counting bytes read + written
# (STEP_RATES="TFLOPS TBS" gives them instead: a smoke test without a GPU)
if [ -n "${STEP_RATES:-}" ]; then
  read -r g c <<< "$STEP_RATES"
  echo "{\"gemm_tflops\": $g, \"copy_tbs\": $c, \"device\": \"given\", \"method\": \"STEP_RATES\"}" > "$out/rates.json"
  echo "given: $STEP_RATES" > "$out/rates.log"
else
python3 - "$out/rates.json" > "$out/rates.log" 2>&1 <<'PY'
import json, sys, torch
dev = "cuda"
def timed(fn, iters, reps=7):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / iters)
    return sorted(ts)[len(ts) // 2]
n = 8192
x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
y = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
g = 2 * n ** 3 / timed(lambda: x @ y, 10) / 1e12
src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
dst = torch.empty_like(src)
c = 2 * src.numel() / timed(lambda: dst.copy_(src), 10) / 1e12
r = {"gemm_tflops": g, "copy_tbs": c, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
     "method": "median of 7 x 10 calls, CUDA events; GEMM bf16 8192^3, copy 1 GiB d2d (read + write)"}
json.dump(r, open(sys.argv[1], "w"))
print(json.dumps(r))
PY
fi
note "rates: rc=$? $(cat "$out/rates.log" | tail -1)"
read -r gemm copy < <(python3 -c "import json,sys; r=json.load(open('$out/rates.json')); print(r['gemm_tflops'], r['copy_tbs'])" 2>/dev/null || echo "0 0")

torch_compile=0
python3 bench/train_torch.py --help 2>/dev/null | grep -q -- "--compile" && torch_compile=1
model_args() {
  case $1 in
    dmoe46)   echo "n_layers=6 d_model=512 n_heads=8 ffn=2048 experts=64 top_k=1 batch_size=16" ;;
    dmoe125)  echo "n_layers=12 d_model=768 n_heads=12 ffn=3072 experts=64 top_k=1 batch_size=8" ;;
    dense125) echo "kind=dense n_layers=12 d_model=768 n_heads=12 ffn=3072 batch_size=8" ;;
    *) return 1 ;;
  esac
}
for m in "${models[@]}"; do
  model_args "$m" > /dev/null || { echo "unknown model $m (dmoe46, dmoe125, dense125)"; exit 2; }
done
# seconds left of the call's budget (STEP_BUDGET, default 570 of the machine's 600 per command),
# at most $1: a part that would not fit is skipped, and the table is still written
start=$(date +%s)
left() { local l=$((${STEP_BUDGET:-570} - ($(date +%s) - start))); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
run_part() { # name limit log command...
  local name=$1 limit=$2 log=$3; shift 3
  local l; l=$(left "$limit")
  if [ "$l" -lt 20 ]; then note "$name: skipped (the call's time budget is spent)"; return 1; fi
  local t0; t0=$(date +%s)
  timeout "$l" "$@" > "$log" 2>&1
  local rc=$?
  local pat='[0-9]+ tokens/s, [0-9.]+ ms/step'
  [[ $name == *profile ]] && pat='wall [0-9.]+ ms/step.*'
  note "$name: rc=$rc $(grep -oE "$pat" "$log" | tail -1) ($(($(date +%s) - t0)) s)"
  return $rc
}
# the timed runs and PyTorch eager first, then the profiles, then torch.compile (the slowest to
# start): what the budget cuts is the end of this list
for m in "${models[@]}"; do
  rm -rf /tmp/step_export_$m /tmp/step_run_$m "$out"/{moe,prof,torch,torchc}_$m.*
  run_part "$m moe-lua" 400 "$out/moe_$m.log" $ml bench/train_125m.lua $(model_args $m) ${STEP_ARGS:-} \
    data=$data steps=$steps log_every=10 export=/tmp/step_export_$m out_dir=/tmp/step_run_$m \
    json="$out/moe_$m.json"
  rm -rf /tmp/step_run_$m
  if [ "${STEP_TORCH:-1}" != 0 ] && [ -f "$out/moe_$m.json" ]; then
    run_part "$m torch eager" 400 "$out/torch_$m.log" python3 bench/train_torch.py \
      --export /tmp/step_export_$m --config "$out/moe_$m.json" --json "$out/torch_$m.json"
  fi
done
if [ "$psteps" -gt 0 ]; then
  for m in "${models[@]}"; do
    run_part "$m profile" 300 "$out/prof_$m.log" $ml bench/train_125m.lua $(model_args $m) ${STEP_ARGS:-} \
      data=$data steps=$((10 + psteps + 1)) log_every=10 profile=true profile_steps=$psteps \
      out_dir=/tmp/step_prof_$m json="$out/prof_$m.json"
    rm -rf /tmp/step_prof_$m
  done
fi
if [ "${STEP_TORCH:-1}" != 0 ] && [ $torch_compile = 1 ]; then
  for m in "${models[@]}"; do
    [ -f "$out/moe_$m.json" ] || continue
    run_part "$m torch compile" 500 "$out/torchc_$m.log" python3 bench/train_torch.py \
      --export /tmp/step_export_$m --config "$out/moe_$m.json" --compile --json "$out/torchc_$m.json"
  done
fi
for m in "${models[@]}"; do rm -rf /tmp/step_export_$m; done

# routing balance (STEP_BALANCE=N steps, dMoE models only): moe-lua with a record per step, then
# PyTorch from the same initial weights on the same batches with its per-step balance file, set
# side by side by bench/balance_compare.py ($OUT/balance_<model>.md and .png)
if [ "${STEP_BALANCE:-0}" -gt 0 ] && [ "${STEP_TORCH:-1}" != 0 ]; then
  for m in "${models[@]}"; do
    [ "$m" = dense125 ] && continue
    b=/tmp/step_balance_$m; rm -rf "$b"
    run_part "$m balance moe-lua" 300 "$out/balance_moe_$m.log" $ml bench/train_125m.lua $(model_args $m) \
      ${STEP_ARGS:-} data=$data steps=$STEP_BALANCE log_every=1 export=$b out_dir=$b/out \
      json="$out/balance_moe_$m.json" || continue
    cp "$b/out/metrics.jsonl" "$out/balance_moe_$m.jsonl"
    run_part "$m balance torch" 300 "$out/balance_torch_$m.log" python3 bench/train_torch.py \
      --init $b --config "$out/balance_moe_$m.json" --steps $STEP_BALANCE \
      --balance-jsonl "$out/balance_torch_$m.jsonl" --json "$out/balance_torch_$m.json" || continue
    python3 bench/balance_compare.py "$out/balance_moe_$m.jsonl" "$out/balance_torch_$m.jsonl" \
      "$out/balance_$m" --title "$m on $(head -1 "$out/gpu.txt" | cut -d, -f2 | sed 's/^ //')" \
      > "$out/balance_$m.log" 2>&1
    note "$m balance: rc=$? ($out/balance_$m.md)"
    rm -rf "$b"
  done
fi

$ml bench/step_floor.lua gemm_tflops=$gemm copy_tbs=$copy models=$(IFS=,; echo "${models[*]}") \
  json="$out/floor.json" > "$out/floor.log" 2>&1
note "floor: rc=$? (GEMM $gemm TFLOP/s, copy $copy TB/s)"

python3 bench/step_report.py "$out" "${models[@]}" > "$out/step_report.log" 2>&1
rc=$?
[ -f "$out/step_round.md" ] && cat "$out/step_round.md"
echo "== summary =="
printf '%s\n' "${summary[@]}"
echo "== the step: moe-lua, PyTorch and the floor (GEMM $gemm TFLOP/s, copy $copy TB/s) =="
if [ $rc -eq 0 ]; then cat "$out/step_report.log"; else tail -20 "$out/step_report.log"; fi
