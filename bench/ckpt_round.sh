#!/usr/bin/env bash
# The checkpoints of the 125M dMoE (bench/train_125m.lua's shapes: 12 x 768, 12 heads, 64 experts
# top-1, ffn 3072, seq 1024, micro-batch 8 per GPU, bf16; 3.65 B parameters, a checkpoint of about
# 51 GB: bf16 weights, fp32 master weights and two fp32 AdamW moments) on GPUs, one part per
# device call. Each part builds the model once and leaves its own complete results in $OUT;
# `report` joins the parts' files (copied into one folder) into bench/results/dist/ckpt_125m.*.
# Over a build made here and packed with `bash .ci/gpu --pack` (carry out/gpu-pack.tgz; there:
# tar xzf out/gpu-pack.tgz first).
#
#   bash bench/ckpt_round.sh gpu1        one call: 1 GPU, single-file checkpoints
#   bash bench/ckpt_round.sh gpu2        one call: 2 GPUs, sharded (dp 2, dp_shard 2, ep 2)
#   bash bench/ckpt_round.sh restart     one call: 2 GPUs, kill -9 and --max-restarts 1
#   bash bench/ckpt_round.sh signals     SIGTERM and SIGINT on one GPU, SIGTERM under launch -n 2
#   CKPT_RESULTS=DIR bash bench/ckpt_round.sh report   (here, on the CPU: DIR holds the parts' files)
#
#   gpu1     bench/ckpt_stall.lua layout=single in one process: model build, 2 warm-up steps, 3 timed
#            steps, a synchronous save (checkpoint.save: write, fsync, digests.txt), the verification
#            of every file (checkpoint.verify), the read of it into the same model and optimizer
#            (par:load_checkpoint), removed, 1 more step, then an asynchronous save (save_async: the
#            sharded format with one shard) as gpu2's -> $OUT/ckpt_gpu1.json + .md
#   gpu2     moe-lua launch -n 2 bench/ckpt_stall.lua layout=zero_ep: the same, with the loop's sharded
#            save, then an asynchronous save: its stall (the copy to host memory), 3 steps while it
#            writes, its finish (the rest of the write, barrier, commit) -> $OUT/ckpt_gpu2.json + .md
#            (CKPT_ASYNC_SAVES=2: a second asynchronous save, the buffer reused: the steady stall)
#   restart  moe-lua launch -n 2 --max-restarts 1 --timeline T tests/dist/ckpt_restart.lua (dp 2,
#            dp_shard 2, ep 2; a synchronous save after step 3, rank 1 killed in step 5, 5 steps; the
#            restart resumes with resume=latest) -> $OUT/restart_timeline.jsonl, restart_rc,
#            restart_losses_restarted.txt, restart.log (CKPT_REF=1: also the uninterrupted run after
#            it, and the losses compared: one more build and save, about 100 s more)
#   report   bench/ckpt_report.lua over CKPT_RESULTS (default $OUT): ckpt_gpu1.json, ckpt_gpu2.json,
#            the restart's files -> $OUT/ckpt_125m.json + .md, copied to bench/results/dist/ when the
#            inputs came from GPUs; the short table is printed last
#
# Where the time goes (estimates for 3.65 B parameters, a 51 GB checkpoint). Measured here with
# bench/ckpt_stall.lua on this project's 2-core CPU machine (shared, so +-30 %) at 139 M parameters
# (d_model 512, 4 layers, 16 experts, ffn 2048, bf16: a 1.94 GB checkpoint; one process and two ranks)
# and scaled by parameters or bytes, assuming the GPU host's cores are as fast as these and 16 of
# them serve a rank; D (GB/s) is the GPU machine's disk write speed with fsync, the one unknown:
#   model build    166 ns of CPU time a parameter (Philox normal draws, the f32 -> bf16 cast, the
#                  move): 3.65 B on 16 cores ~ 38 s a rank (each rank of a two-GPU job builds every
#                  expert, then keeps its half). init=device (CKPT_INIT, the default for gpu1 and gpu2)
#                  draws the experts on the GPU: a few s. The restart test builds on the CPU, twice.
#   first step     optimizer state and CUDA set-up: a few s; then 86-95 ms a step (layouts_125m.md)
#   sync save      the copy to the host in 8 MiB pieces, the write and fsync: 51 / D s at best, and
#                  digests.txt hashing every file again (XXH64, one thread, 2.9-5.4 GB/s here): 10-17 s
#   verify         checkpoint.verify, every file read and hashed (page cache; 4.7 GB/s here, 2.9 GB/s
#                  a rank when two ranks hash at once): ~11 s on one GPU, ~18 s on two
#   read           par:load_checkpoint, each rank reading what it holds (pread into a fresh host
#                  tensor, then the copy to the device): 0.84 GB/s here (0.65 GB/s for two ranks sharing
#                  2 cores): 51 GB ~ 30-60 s on one GPU, 26 GB a rank ~ 15-30 s on two
#   async stall    each rank's 26 GB copied to the host and into the writer's buffer (fresh pages): at
#                  the 0.85 GB/s seen here ~30 s, less with a faster host; finish: what is left of the
#                  write (51 / D s after the stall) plus rank 0's hashing, 10-17 s
# Per part: gpu1 ~ 85-140 s + 51 / D; gpu2 ~ 110-170 s + 2 x 51 / D; restart ~ 145-180 s + 51 / D.
# At D = 1 GB/s: 140-190, 210-270 and 195-230 s; gpu2 with D under ~1 GB/s: two calls,
# CKPT_ASYNC_SAVES=0 (sync, verify, read) then CKPT_SYNC=0 (the asynchronous save alone). Each part
# stops at CKPT_TIMEOUT (default 300 s: SIGTERM, SIGKILL 20 s later) keeping what it measured: the
# JSON is rewritten after every phase ("complete": false until the end, the phases with their times).
#
# Disk and memory: one checkpoint on disk at a time (each is removed once measured): CKPT_SCRATCH
# (default /tmp/moe-ckpt-round) needs about 52 GB free (checked before the part starts: CKPT_NEED_GB);
# the 1-GPU machine's 64 GB disk may not hold it next to the system: the 2-GPU machine (128 GB) runs
# gpu1 on one of its GPUs. Host memory: the asynchronous save's buffer (26 GB a rank) and page cache.
# CKPT_CPU=1 runs every part on the CPU at a tiny size with build-cpu/ (ctest bench/ckpt_round_cpu);
# CKPT_MODEL overrides the model's arguments; CKPT_DATA is the dataset (a byte-vocabulary prefix;
# default data/bible_kjv when carried, else bench/ckpt_corpus.lua's).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out}; mkdir -p "$out"
cd "$root" || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
parts=("$@"); [ ${#parts[@]} -eq 0 ] && { echo "usage: bench/ckpt_round.sh gpu1|gpu2|restart|report ..."; exit 2; }
if [ "${CKPT_CPU:-0}" = 1 ]; then
  ml=${ML:-$root/build-cpu/moe-lua}; dev=cpu; need_gb=${CKPT_NEED_GB:-0}
  model=${CKPT_MODEL:-d_model=32 layers=2 heads=2 experts=4 top_k=1 ffn=64 seq_len=32 batch_size=2 dtype=f32}
elif [ "${parts[*]}" = report ]; then
  ml=${ML:-$root/build-cpu/moe-lua}; dev=cuda; need_gb=0; model=""
else
  keep_out=$out; . "$root/bench/gpu_env.sh"; out=$keep_out # its links and Lua paths
  ml=${ML:-/work/main/build-gpu/moe-lua}; dev=cuda; need_gb=${CKPT_NEED_GB:-52}
  model=${CKPT_MODEL:-d_model=768 layers=12 heads=12 experts=64 top_k=1 ffn=3072 seq_len=1024 batch_size=8 dtype=bf16}
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$out/gpus.txt"
fi
[ "$dev" = cuda ] && export MASTER_PORT=${MASTER_PORT:-29541} # on the CPU launch picks a free port
scratch=${CKPT_SCRATCH:-/tmp/moe-ckpt-round}
tmo=${CKPT_TIMEOUT:-300}
"$ml" --version > "$out/version.txt" 2>&1
summary=(); failed=0
note() { summary+=("$1"); echo "$1"; }
check() { [ "$1" -eq 0 ] || failed=1; }
# the data: CKPT_DATA, else data/bible_kjv when carried, else a word corpus made here
dataset() {
  local data=${CKPT_DATA:-}
  if [ -z "$data" ] && [ -f data/bible_kjv.bin ] && [ "$dev" = cuda ]; then data=data/bible_kjv; fi
  if [ -z "$data" ]; then
    data=${CKPT_CORPUS:-/tmp/moe-ckpt-corpus}/words
    [ -f "$data.bin" ] || "$ml" bench/ckpt_corpus.lua prefix="$data" > "$out/corpus.log" 2>&1
  fi
  echo "$data"
}
# room for one checkpoint in the scratch folder's file system, or stop before building anything
disk_ok() {
  mkdir -p "$scratch"
  df -h "$scratch" > "$out/disk.txt" 2>&1
  local avail; avail=$(df -B1 --output=avail "$scratch" 2>/dev/null | tail -1 | tr -d ' ')
  if [ -n "$avail" ] && [ "$need_gb" -gt 0 ] && [ "$avail" -lt $((need_gb * 1000000000)) ]; then
    note "$1: $((avail / 1000000000)) GB free in $scratch, a checkpoint needs about $need_gb GB (CKPT_SCRATCH, CKPT_NEED_GB): not run"
    failed=1; return 1
  fi
}
for s in "${parts[@]}"; do
  t0=$(date +%s)
  case $s in
    gpu1|gpu2)
      disk_ok "$s" || continue
      data=$(dataset); rm -rf "$scratch"
      if [ "$s" = gpu1 ]; then
        run=("$ml" bench/ckpt_stall.lua layout=single async_saves="${CKPT_ASYNC_SAVES:-1}"
          sync="$([ "${CKPT_SYNC:-1}" = 0 ] && echo false || echo true)")
        what="1 GPU, single-file checkpoints (asynchronous: one shard)"
      else
        run=("$ml" launch -n 2 bench/ckpt_stall.lua layout=zero_ep async_saves="${CKPT_ASYNC_SAVES:-1}"
          sync="$([ "${CKPT_SYNC:-1}" = 0 ] && echo false || echo true)")
        what="2 GPUs, sharded (dp 2, dp_shard 2, ep 2)"
      fi
      # shellcheck disable=SC2086 # $model: key=value words
      timeout -k 20 "$tmo" "${run[@]}" device=$dev $model data="$data" init="${CKPT_INIT:-device}" \
        scratch="$scratch/$s" json="$out/ckpt_$s.json" > "$out/ckpt_$s.log" 2>&1
      rc=$?; check $rc
      note "$what: rc=$rc ($(($(date +%s) - t0)) s)"
      grep -E "^ckpt_stall: " "$out/ckpt_$s.log"
      rm -rf "$scratch" ;;
    restart)
      disk_ok restart || continue
      data=$(dataset); rm -rf "$scratch"; mkdir -p "$scratch"
      # shellcheck disable=SC2206 # $model: key=value words
      ra=(device=$dev $model data=$data steps=5 save_every=3 kill_step=5 keep_last=0 async=false ep=2 dp_shard=2
        timeout=${CKPT_COLLECTIVE_TIMEOUT:-300})
      timeout -k 20 "$tmo" "$ml" launch -n 2 --max-restarts 1 --timeline "$out/restart_timeline.jsonl" \
        tests/dist/ckpt_restart.lua "${ra[@]}" dir="$scratch/k" kill=true > "$out/restart.log" 2>&1
      rc=$?; check $rc; echo $rc > "$out/restart_rc"
      cp "$scratch/k/losses-1.txt" "$out/restart_losses_restarted.txt" 2>/dev/null
      note "restart (kill -9 of rank 1 in step 5, --max-restarts 1): rc=$rc ($(($(date +%s) - t0)) s)"
      grep -E "restart|died" "$out/restart.log" | head -4
      rm -rf "$scratch/k"
      if [ "${CKPT_REF:-0}" = 1 ]; then
        timeout -k 20 "$tmo" "$ml" launch -n 2 tests/dist/ckpt_restart.lua "${ra[@]}" dir="$scratch/u" kill=false \
          > "$out/restart_ref.log" 2>&1
        note "uninterrupted reference: rc=$?"
        cp "$scratch/u/losses-0.txt" "$out/restart_losses_uninterrupted.txt" 2>/dev/null
      fi
      rm -rf "$scratch" ;;
    report)
      res=${CKPT_RESULTS:-$out}
      rn=""
      [ -f "$res/restart_losses_restarted.txt" ] &&
        rn="the restarted run trained steps $(awk '{printf "%s ", $1}' "$res/restart_losses_restarted.txt")"
      if [ -f "$res/restart_losses_uninterrupted.txt" ] && [ -f "$res/restart_losses_restarted.txt" ]; then
        same=0; n=0
        while read -r st v; do
          w=$(awk -v s="$st" '$1 == s { print $2 }' "$res/restart_losses_uninterrupted.txt")
          [ -n "$w" ] && { n=$((n + 1)); [ "$w" = "$v" ] && same=$((same + 1)); }
        done < "$res/restart_losses_restarted.txt"
        rn="$rn; losses after the restart equal to the uninterrupted run's: $same/$n steps"
      fi
      "$ml" bench/ckpt_report.lua single="$res/ckpt_gpu1.json" sharded="$res/ckpt_gpu2.json" \
        timeline="$res/restart_timeline.jsonl" restart_rc="$(cat "$res/restart_rc" 2>/dev/null || echo -1)" \
        restart_note="$rn" json="$out/ckpt_125m.json" > "$out/report.log" 2>&1
      rc=$?; check $rc
      note "report: rc=$rc"
      if [ "${CKPT_CPU:-0}" != 1 ] && grep -q '"on_gpu": true' "$out/ckpt_125m.json" 2>/dev/null; then
        mkdir -p bench/results/dist && cp "$out/ckpt_125m.json" "$out/ckpt_125m.md" bench/results/dist/
      fi ;;
    signals)
      # SIGTERM and Ctrl-C (SIGINT) on one GPU, SIGTERM to `moe-lua launch -n 2`: each run
      # (tests/dist/launch_stop_train.lua, a tiny dMoE) saves ckpt-<n> at the next step boundary
      # and exits 143 / 130; the checkpoint must verify
      data=$(dataset); d=$scratch/signals; rm -rf "$d"; mkdir -p "$d"
      printf '%s\n' 'local ok, why = require("moe.checkpoint").verify(arg[1])' \
        'print(ok and "verified" or tostring(why)); os.exit(ok and 0 or 1)' > "$d/verify.lua"
      : > "$out/signals.txt"
      for c in "1 TERM 143" "1 INT 130" "2 TERM 143"; do
        read -r n sig want <<< "$c"; o=$d/run-$n-$sig; err=$o.err
        if [ "$n" = 1 ]; then "$ml" tests/dist/launch_stop_train.lua "$data" "$o" $dev 2> "$err" &
        else "$ml" launch -n 2 tests/dist/launch_stop_train.lua "$data" "$o" $dev 2> "$err" & fi
        p=$!; i=0
        until [ "$(grep -c '^ready ' "$err" 2>/dev/null)" -ge "$n" ]; do
          i=$((i + 1)); { [ $i -gt 1200 ] || ! kill -0 $p 2>/dev/null; } && break; sleep 0.1
        done
        kill -"$sig" $p; wait $p; rc=$?
        st=$(grep -oE 'stop seen by [^ ]+ at step [0-9]+' "$err" | head -1 | grep -oE '[0-9]+$')
        v=$([ -n "$st" ] && "$ml" "$d/verify.lua" "$o/ckpt-$st" 2>&1 | tail -1 || echo "no stop seen")
        ok=$([ $rc = "$want" ] && [ "$v" = verified ] && echo passed || echo FAILED)
        [ $ok = passed ] || failed=1
        line="$([ "$n" = 1 ] && echo "one process" || echo "moe-lua launch -n 2") on $dev, SIG$sig: rc=$rc (want $want), stopped at step ${st:-?}, ckpt-${st:-?}: $v: $ok"
        echo "$line" >> "$out/signals.txt"; note "$line"
        [ $ok = passed ] || tail -5 "$err"
      done
      rm -rf "$d" ;;
    *) echo "unknown part $s (gpu1, gpu2, restart, signals, report)"; exit 2 ;;
  esac
done
echo "== summary =="
printf '%s\n' "${summary[@]}"
[ -f "$out/report.log" ] && sed -n '/^== checkpoints/,$p' "$out/report.log"
exit $failed
