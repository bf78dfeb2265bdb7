#!/usr/bin/env bash
# One call on the 2-GPU machine (kind nvidia-h100-x2) for the checkpoints of the 125M dMoE
# (bench/train_125m.lua's shapes: 12 x 768, 12 heads, 64 experts top-1, ffn 3072, seq 1024,
# micro-batch 8 per GPU, bf16): save time (synchronous, and the stall of an asynchronous save),
# load time, bytes read and size on disk, on one GPU (single-file checkpoint) and sharded on two
# (dp = 2, dp_shard = 2, ep = 2), then the restart test on two GPUs: rank 1 killed with SIGKILL
# mid-step under `moe-lua launch --max-restarts 1 --timeline`, with its timeline (failure,
# detection, restart, first step after it). Over a build made here and packed with
# `bash .ci/gpu --pack` (carry out/gpu-pack.tgz; there: tar xzf out/gpu-pack.tgz first).
#
#   bash bench/ckpt_round.sh [gpu1] [gpu2] [restart] [report]      (all four by default)
#   (or one step a call on the same warm machine: the results meet in CKPT_KEEP, below)
#
#   gpu1     bench/ckpt_stall.lua layout=single on one GPU: modes none, sync, load
#   gpu2     moe-lua launch -n 2 bench/ckpt_stall.lua layout=zero_ep: none, sync, load, async
#   restart  moe-lua launch -n 2 --max-restarts 1 --timeline T tests/dist/ckpt_restart.lua
#            (dp 2, dp_shard 2, ep 2; synchronous saves every 3 steps, rank 1 killed in step 5,
#            5 steps; CKPT_REF=1 also runs it uninterrupted and compares the losses after the restart)
#   report   bench/ckpt_report.lua: $OUT/ckpt_125m.json + .md (device, date, versions: what to
#            commit as bench/results/dist/ckpt_125m.json + .md), copied
#            to bench/results/dist/ of this tree, and a short table printed last
#
# The 125M dMoE has 3.65 B parameters (64 experts): a checkpoint (bf16 weights, fp32 master
# weights and AdamW moments) is about 51 GB, so each mode writes one (steps 6, a save at step 4,
# keep_last 0) and removes it once measured; free disk for two (CKPT_SCRATCH, default
# /tmp/moe-ckpt-round) and host memory for one (an asynchronous save's buffers).
# Logs and JSON go to $OUT (default out/); the last lines are the summary and the short table.
# CKPT_CPU=1 runs every step on the CPU at a tiny size with build-cpu/ (the script's own test);
# CKPT_MODEL overrides the model's arguments, CKPT_STEPS / CKPT_SAVE_EVERY the runs'; CKPT_DATA is the
# dataset (a byte-vocabulary prefix; default data/bible_kjv when carried, else bench/ckpt_corpus.lua's).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out}; mkdir -p "$out"
# the results of every step are kept in CKPT_KEEP too (default /tmp/moe-ckpt-round-results on the
# device machine) and copied to $OUT at the end: steps run in separate calls (each under a
# per-call time limit) while the machine stays warm still meet in the report
keep=${CKPT_KEEP:-/tmp/moe-ckpt-round-results}; mkdir -p "$keep"
final_out=$out; out=$keep
cd "$root" || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
if [ "${CKPT_CPU:-0}" = 1 ]; then
  ml=${ML:-$root/build-cpu/moe-lua}; dev=cpu
  model=${CKPT_MODEL:-d_model=32 layers=2 heads=2 experts=4 top_k=1 ffn=64 seq_len=32 batch_size=2 dtype=f32}
else
  keep_out=$out; . "$root/bench/gpu_env.sh"; out=$keep_out # its links and Lua paths
  ml=${ML:-/work/main/build-gpu/moe-lua}; dev=cuda
  model=${CKPT_MODEL:-d_model=768 layers=12 heads=12 experts=64 top_k=1 ffn=3072 seq_len=1024 batch_size=8 dtype=bf16}
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$out/gpus.txt"
fi
[ "$dev" = cuda ] && export MASTER_PORT=${MASTER_PORT:-29541} # on the CPU launch picks a free port
scratch=${CKPT_SCRATCH:-/tmp/moe-ckpt-round}
steps=${CKPT_STEPS:-6}; every=${CKPT_SAVE_EVERY:-4}; tmo=${CKPT_TIMEOUT:-1500}
"$ml" --version > "$out/version.txt" 2>&1
# the data: CKPT_DATA (a byte-vocabulary dataset prefix), else data/bible_kjv when carried, else a
# word corpus made here (the tests' 60-document corpus is too short for seq_len 1024)
data=${CKPT_DATA:-}
if [ -z "$data" ] && [ -f data/bible_kjv.bin ] && [ "$dev" = cuda ]; then data=data/bible_kjv; fi
if [ -z "$data" ]; then
  data=${CKPT_CORPUS:-/tmp/moe-ckpt-corpus}/words
  [ -f "$data.bin" ] || "$ml" bench/ckpt_corpus.lua prefix="$data" > "$out/corpus.log" 2>&1
fi
model="$model data=$data"
df -h "$(dirname "$scratch")" > "$out/disk.txt" 2>&1
summary=(); failed=0
note() { summary+=("$1"); }
check() { [ "$1" -eq 0 ] || failed=1; }
rc_restart=$(cat "$out/restart_rc" 2>/dev/null || echo -1)
run_steps=("$@"); [ ${#run_steps[@]} -eq 0 ] && run_steps=(gpu1 gpu2 restart report)
for s in "${run_steps[@]}"; do
  t0=$(date +%s)
  case $s in
    gpu1)
      rm -rf "$scratch"
      # shellcheck disable=SC2086
      timeout "$tmo" "$ml" bench/ckpt_stall.lua layout=single device=$dev $model steps=$steps save_every=$every \
        modes=none,sync,load scratch="$scratch/gpu1" json="$out/ckpt_gpu1.json" > "$out/ckpt_gpu1.log" 2>&1
      rc=$?; check $rc
      note "1 GPU, single-file: rc=$rc ($(($(date +%s) - t0)) s)"
      grep -E "^(none|sync|load) " "$out/ckpt_gpu1.log" ;;
    gpu2)
      rm -rf "$scratch"
      # shellcheck disable=SC2086
      timeout "$tmo" "$ml" launch -n 2 bench/ckpt_stall.lua layout=zero_ep device=$dev $model steps=$steps \
        save_every=$every modes=none,sync,load,async scratch="$scratch/gpu2" json="$out/ckpt_gpu2.json" \
        > "$out/ckpt_gpu2.log" 2>&1
      rc=$?; check $rc
      note "2 GPUs, sharded (dp 2, dp_shard 2, ep 2): rc=$rc ($(($(date +%s) - t0)) s)"
      grep -E "^(none|sync|load|async) " "$out/ckpt_gpu2.log" ;;
    restart)
      rm -rf "$scratch"; mkdir -p "$scratch"
      # shellcheck disable=SC2206 # $model: key=value words
      ra=(device=$dev $model steps=5 save_every=3 kill_step=5 keep_last=0 async=false ep=2 dp_shard=2)
      # shellcheck disable=SC2086
      timeout "$tmo" "$ml" launch -n 2 --max-restarts 1 --timeline "$out/restart_timeline.jsonl" \
        tests/dist/ckpt_restart.lua "${ra[@]}" dir="$scratch/k" kill=true > "$out/restart.log" 2>&1
      rc_restart=$?; check $rc_restart; echo $rc_restart > "$out/restart_rc"
      cp "$scratch/k/losses-1.txt" "$out/restart_losses_restarted.txt" 2>/dev/null
      note "restart (kill -9 of rank 1 in step 5, --max-restarts 1): rc=$rc_restart ($(($(date +%s) - t0)) s)"
      grep -E "restart|died" "$out/restart.log" | head -4
      if [ "${CKPT_REF:-0}" = 1 ]; then
        rm -rf "$scratch/k"
        timeout "$tmo" "$ml" launch -n 2 tests/dist/ckpt_restart.lua "${ra[@]}" dir="$scratch/u" kill=false \
          > "$out/restart_ref.log" 2>&1
        note "uninterrupted reference: rc=$?"
        cp "$scratch/u/losses-0.txt" "$out/restart_losses_uninterrupted.txt" 2>/dev/null
        same=0; n=0
        while read -r st v; do
          w=$(awk -v s="$st" '$1 == s { print $2 }' "$out/restart_losses_uninterrupted.txt" 2>/dev/null)
          [ -n "$w" ] && { n=$((n + 1)); [ "$w" = "$v" ] && same=$((same + 1)); }
        done < "$out/restart_losses_restarted.txt"
        note "losses after the restart equal to the uninterrupted run's: $same/$n steps"
      fi
      rm -rf "$scratch" ;;
    report)
      rn=""
      [ -f "$out/restart_losses_restarted.txt" ] &&
        rn="the restarted run trained steps $(awk '{printf "%s ", $1}' "$out/restart_losses_restarted.txt")"
      "$ml" bench/ckpt_report.lua device=$dev single="$out/ckpt_gpu1.json" sharded="$out/ckpt_gpu2.json" \
        timeline="$out/restart_timeline.jsonl" restart_rc="$rc_restart" restart_note="$rn" \
        json="$out/ckpt_125m.json" > "$out/report.log" 2>&1
      rc=$?; check $rc
      note "report: rc=$rc"
      mkdir -p bench/results/dist
      [ "$dev" = cuda ] && cp "$out/ckpt_125m.json" "$out/ckpt_125m.md" bench/results/dist/ 2>/dev/null ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
[ "$final_out" != "$out" ] && cp -r "$out/." "$final_out/"
echo "== summary =="
printf '%s\n' "${summary[@]}"
[ -f "$out/report.log" ] && sed -n '/^== checkpoints/,$p' "$out/report.log"
exit $failed
