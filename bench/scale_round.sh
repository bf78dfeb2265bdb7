#!/usr/bin/env bash
# The scaling run of the MegaBlocks ladder on the GPUs of one host (8 on an 8-GPU machine), or
# its CI-sized form on CPU ranks. Over a build made here and packed with `bash .ci/gpu --pack`
# (carry out/gpu-pack.tgz; there: tar xzf out/gpu-pack.tgz first), like bench/dist_round.sh.
#
#   bash bench/scale_round.sh [weak] [coll] [a2a] [restart] [resume]      (all by default)
#
#   weak     the 125M and 356M dMoE (64 experts top-1, seq 1024, micro-batch 8 per GPU; 4 for
#            356M) through bench/train_125m.lua on 1 GPU, on 2 with ep = 2, and on N with
#            ep = N, with ZeRO-3 (dp_shard = N, shard_params), and with ep = N and ep = N/2 (the
#            experts replicated twice) each with the rest sharded over dp_shard = N (ZeRO-2):
#            tokens/s per GPU, peak and model-state memory per GPU (a run that does not fit
#            is reported as out of memory)
#   coll     all_to_all and all_reduce bus bandwidth at 8, 64, 256 and 1024 MiB per rank,
#            moe.dist (bench/dist_collectives.lua) beside torch.distributed
#            (bench/dist_collectives_torch.py) on the same N GPUs (GPU only)
#   a2a      the expert-parallel layer's all_to_all time and how much of it is hidden
#            (bench/ep_overlap.lua, when present) on N ranks
#   restart  the 125M dMoE with ep = N under `moe-lua launch --max-restarts 1`: rank 1 is
#            killed with SIGKILL after step 15 (checkpoints every 10 steps); the job resumes
#            and finishes 30 steps; the timeline (bench/scale_restart.py). On CPU: 12 steps,
#            checkpoints every 4, the kill after step 6
#   resume   the restart run's checkpoint of step 20 (CPU: 8) resumed on 2 ranks (ep = 2,
#            grad_accum N/2) and on one (grad_accum N): the same global batch; the losses of
#            the next 5 steps (CPU: 2) beside the N-rank run's
#
# SCALE_RESUME_TOL: the relative loss difference the resumed runs may show (default 2e-2 on
# GPUs in bf16, 1e-4 on CPU in f32). SCALE_N: ranks (default: the GPUs visible; 8 on CPU). SCALE_DEVICE=cpu: CPU ranks and a tiny
# model of each shape (2 and 3 layers of 64, 8 experts, seq 64), a handful of steps: the form
# CI runs (tests/CMakeLists.txt, bench/scale_cpu). SCALE_STEPS: steps of each weak run
# (default 40 on GPU). SCALE_MODELS: "125m 356m" by default.
# Logs and JSON go to $OUT (default out/); bench/scale_report.py joins them into
# $OUT/scale.json and scale.md (device, date, versions), printed last.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out}; mkdir -p "$out"
cd "$root"
dev=${SCALE_DEVICE:-cuda}
if [ "$dev" = cuda ]; then
  . "$root/bench/gpu_env.sh"
  ml=${SCALE_MOE_LUA:-/work/main/build-gpu/moe-lua}
  n=${SCALE_N:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > "$out/gpus.txt"
  data=${SCALE_DATA:-data/bible_kjv}
  steps=${SCALE_STEPS:-40}
  common=(dtype=bf16 device=cuda)
  declare -A shape=([125m]="n_layers=12 d_model=768 n_heads=12 ffn=3072 batch_size=8"
                    [356m]="n_layers=24 d_model=1024 n_heads=16 ffn=4096 batch_size=4")
  train_shape="model.n_layers=12 model.d_model=768 model.n_heads=12 model.moe.ffn_hidden_size=3072 seq_len=1024 batch_size=8 model.moe.num_experts=64"
  r_steps=30 r_save=10 r_kill=15 r_at=20 r_stop=25
  tol=${SCALE_RESUME_TOL:-2e-2} # bf16 compute: the layouts add in other orders
else
  ml=${SCALE_MOE_LUA:-$root/build-cpu/moe-lua}
  n=${SCALE_N:-8}
  steps=${SCALE_STEPS:-4}
  common=(dtype=f32 device=cpu seq_len=64 experts=8 warmup=2)
  declare -A shape=([125m]="n_layers=2 d_model=64 n_heads=2 ffn=128 batch_size=2"
                    [356m]="n_layers=3 d_model=64 n_heads=2 ffn=128 batch_size=2")
  train_shape="model.n_layers=2 model.d_model=64 model.n_heads=2 model.moe.ffn_hidden_size=128 seq_len=64 batch_size=2 model.moe.num_experts=8"
  r_steps=12 r_save=4 r_kill=6 r_at=8 r_stop=10
  tol=${SCALE_RESUME_TOL:-1e-4}
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  data=$tmp/docs
  $ml preprocess input=$(ls docs/*.md | paste -sd,) output=$data split=blank_line > "$out/preprocess.log" 2>&1 ||
    { echo "preprocess failed"; cat "$out/preprocess.log"; exit 1; }
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
echo "$dev $n" > "$out/scale_setup.txt"
$ml --version > "$out/version.txt" 2>&1
models=(${SCALE_MODELS:-125m 356m})
status=0
summary=()
note() { summary+=("$1"); }
what=("$@"); [ ${#what[@]} -eq 0 ] && what=(weak coll a2a restart resume)
for s in "${what[@]}"; do
  t0=$(date +%s)
  case $s in
    weak)
      for m in "${models[@]}"; do
        args=(bench/train_125m.lua ${shape[$m]} "${common[@]}" steps=$steps log_every=$((steps / 4 > 0 ? steps / 4 : 1))
              data=$data)
        runs=("1" "2 ep=2" "$n ep=$n" "$n dp_shard=$n shard_params=true")
        runs+=("$n ep=$n dp_shard=$n")
        [ "$n" -ge 4 ] && runs+=("$n ep=$((n / 2)) dp_shard=$n")
        for r in "${runs[@]}"; do
          set -- $r; k=$1; shift
          name="weak_${m}_n${k}"; for x in "$@"; do name+="_${x//=/}"; done
          name=${name/_shard_paramstrue/_zero3}
          echo "${*:-one process}" > "$out/$name.layout"
          [ "$k" -gt "$n" ] && continue
          launch=(); [ "$k" -gt 1 ] && launch=(launch -n "$k")
          timeout 900 $ml "${launch[@]}" "${args[@]}" "$@" json="$out/$name.json" out_dir="$out/run_$name" \
            > "$out/$name.log" 2>&1
          rc=$?
          note "$name: rc=$rc $(grep -o '[0-9]* tokens/s, [0-9.]* ms/step.*GiB' "$out/$name.log" | tail -1) ($(($(date +%s) - t0)) s)"
          if [ $rc -ne 0 ] && ! grep -q "out of memory" "$out/$name.log"; then status=1; tail -5 "$out/$name.log"; fi
          rm -rf "$out/run_$name"
        done
      done ;;
    coll)
      if [ "$dev" != cuda ]; then note "coll: GPU only (skipped on CPU ranks)"; continue; fi
      mpi=(mpirun -n "$n" --bind-to none -x LUA_PATH -x LUA_CPATH -x NCCL_NVLS_ENABLE)
      timeout 600 "${mpi[@]}" $ml bench/dist_collectives.lua dtype=bf16 json="$out/coll_moe.json" > "$out/coll_moe.log" 2>&1
      note "coll moe.dist: rc=$? ($(($(date +%s) - t0)) s)"
      timeout 600 "${mpi[@]}" python3 bench/dist_collectives_torch.py --dtype bf16 --json "$out/coll_torch.json" \
        > "$out/coll_torch.log" 2>&1
      note "coll torch: rc=$? ($(($(date +%s) - t0)) s)" ;;
    a2a)
      if [ ! -f bench/ep_overlap.lua ]; then note "a2a: bench/ep_overlap.lua missing (not run)"; continue; fi
      small=(); omp=${OMP_NUM_THREADS:-}
      # on CPU ranks: the small layer, one sample (a check that the script runs; CPU times mean nothing)
      if [ "$dev" = cpu ]; then small=(size=small experts=$((2 * n)) repeats=1 warmup=0 chunks=1,2); omp=1; fi
      env ${omp:+OMP_NUM_THREADS=$omp} timeout 600 $ml launch -n "$n" bench/ep_overlap.lua device=$dev "${small[@]}" \
        json="$out/a2a.json" > "$out/a2a.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || { status=1; tail -5 "$out/a2a.log"; }
      note "a2a (bench/ep_overlap.lua, $n ranks): rc=$rc ($(($(date +%s) - t0)) s)" ;;
    restart)
      rm -rf "$out/run_restart"
      # shellcheck disable=SC2086
      python3 bench/scale_restart.py --moe-lua "$ml" --ranks "$n" --out-dir "$out/run_restart" --kill-after $r_kill \
        --json "$out/restart.json" --log "$out/restart.log" -- train data=$data model.vocab_size=257 \
        model.ffn=moe model.moe.kind=dmoe model.moe.top_k=1 model.moe.activation=gelu model.moe.loss_weight=0.1 \
        $train_shape parallel.ep=$n steps=$r_steps save_every=$r_save keep_last=3 eval_every=0 sample_tokens=0 \
        dtype=${common[0]#dtype=} device=$dev lr=6e-4 min_lr=6e-5 warmup=3 > "$out/restart_summary.txt" 2>&1
      rc=$?; [ $rc -eq 0 ] || status=1
      note "restart ($n ranks, ep = $n): rc=$rc; $(tail -1 "$out/restart_summary.txt")" ;;
    resume)
      ck="$out/run_restart/ckpt-$r_at"
      if [ ! -d "$ck" ]; then note "resume: $ck missing (run restart first; not run)"; status=1; continue; fi
      for k in 2 1; do
        ga=$((n / k)); [ $ga -ge 1 ] || ga=1
        par=(); [ $k -gt 1 ] && par=(parallel.ep=$k)
        launch=(); [ $k -gt 1 ] && launch=(launch -n $k)
        rm -rf "$out/run_resume$k"
        timeout 900 $ml "${launch[@]}" train data=$data model.vocab_size=257 model.ffn=moe model.moe.kind=dmoe \
          model.moe.top_k=1 model.moe.activation=gelu model.moe.loss_weight=0.1 $train_shape "${par[@]}" \
          grad_accum=$ga log_every=1 eval_every=0 sample_tokens=0 save_every=0 \
          dtype=${common[0]#dtype=} device=$dev lr=6e-4 min_lr=6e-5 warmup=3 steps=$r_steps stop_at=$r_stop \
          resume="$ck" out_dir="$out/run_resume$k" > "$out/resume$k.log" 2>&1
        rc=$?
        cp "$out/run_resume$k/metrics.jsonl" "$out/resume${k}_metrics.jsonl" 2>/dev/null
        note "resume of the $n-rank checkpoint on $k rank(s): rc=$rc ($(($(date +%s) - t0)) s)"
        if [ $rc -ne 0 ]; then
          if grep -q "out of memory" "$out/resume$k.log"; then note "  (out of memory on $k)"; else status=1; tail -5 "$out/resume$k.log"; fi
        fi
        rm -rf "$out/run_resume$k"
      done
      cp "$out/run_restart/metrics.jsonl" "$out/restart_metrics.jsonl" 2>/dev/null ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
rm -rf "$out/run_restart"
echo "== summary =="
printf '%s\n' "${summary[@]}"
python3 bench/scale_report.py "$out" "$out/scale" "$tol" || status=1
exit $status
