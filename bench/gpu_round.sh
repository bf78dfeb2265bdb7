#!/usr/bin/env bash
# One call on the GPU machine for the checks and benchmarks of the MoE work,
# over a build made here and packed with `bash .ci/gpu --pack` (carry .deps
# and data). Each step writes its logs and JSON under $OUT; the last lines of
# the output are a short summary.
#
#   bash bench/gpu_round.sh [tests] [quickstart] [glu_check] [moe_mlp] [matmul] [train125] [blocksparse]
#                           [quantize] [curves] [attention] [sanitize] [ops] [checks] [gather] [auto]
#                           [determinism] [kinds]
#
# Scripts ending in _check.lua validate (no timing); the other bench/*.lua time,
# through bench/lib.lua: key=value arguments (json=FILE, repeats=N, cooldown=S, ...).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/gpu_env.sh"
ml=/work/main/build-gpu/moe-lua
summary=()
note() { summary+=("$1"); }
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests quickstart glu_check moe_mlp)
for s in "${steps[@]}"; do
  t0=$(date +%s)
  case $s in
    tests)
      # .ci/gpu's ctest (it leaves out the tests whose tools this machine lacks, and says so)
      bash "$root/.ci/gpu" -j4 > "$out/ctest_run.log" 2>&1
      note "tests: rc=$? $(grep -E 'tests passed' "$out/ctest.log") ($(($(date +%s) - t0)) s)"
      grep -E "Failed|\*\*\*Timeout" "$out/ctest.log" | head -20 ;;
    quickstart)
      $ml experiments/quickstart.lua device=cuda out_dir="$out/quickstart" > "$out/quickstart.log" 2>&1
      note "quickstart(cuda): rc=$? $(grep -E 'validation loss' "$out/quickstart.log" | tail -1) ($(($(date +%s) - t0)) s)"
      tail -5 "$out/quickstart.log" ;;
    glu_check)
      mkdir -p "$out/glu" && $ml bench/moe_glu_check.lua dir="$out/glu" > "$out/glu_check.log" 2>&1 &&
        python3 bench/moe_glu_check.py "$out/glu" >> "$out/glu_check.log" 2>&1
      note "glu_check: rc=$? $(grep -E 'PASS|FAIL' "$out/glu_check.log" | tail -1)" ;;
    moe_mlp)
      $ml bench/moe_mlp.lua json="$out/moe_mlp_moe.json" > "$out/moe_mlp_moe.log" 2>&1
      python3 bench/moe_mlp_torch.py --json "$out/moe_mlp_torch.json" > "$out/moe_mlp_torch.log" 2>&1
      python3 bench/moe_mlp_report.py "$out/moe_mlp_moe.json" "$out/moe_mlp_torch.json" "$out" \
        --command "bash bench/gpu_round.sh moe_mlp" > "$out/moe_mlp_report.log" 2>&1
      note "moe_mlp: rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "\| (grouped|sparse|torch_grouped_mm) \||NOT met|: met" "$out/moe_mlp.md" ;;
    attention)
      # moe's fused attention (both kernel families: MOE_ATTN_WG=0 is the mma.sync one; the
      # TMA kernels without ping-pong, without the persistent grid and in block-major tile
      # order too) beside torch's SDPA backends, and one problem checked against float64 by
      # the torch script.
      mkdir -p "$out/attn_dump"
      MOE_ATTN_WG=0 $ml bench/attention.lua json="$out/attention_moe_mma.json" > "$out/attention_moe_mma.log" 2>&1
      MOE_ATTN_PINGPONG=0 $ml bench/attention.lua json="$out/attention_moe_nopp.json" > "$out/attention_moe_nopp.log" 2>&1
      MOE_ATTN_PERSISTENT=0 $ml bench/attention.lua json="$out/attention_moe_grid.json" > "$out/attention_moe_grid.log" 2>&1
      MOE_ATTN_ORDER=block $ml bench/attention.lua json="$out/attention_moe_block.json" > "$out/attention_moe_block.log" 2>&1
      python3 -c 'import json,sys
for f in sys.argv[1:]:
    for r in json.load(open(f))["results"]: print(f.split("/")[-1], r["B"], r["H"], r["T"], r["D"], "fwd %.3f f+b %.3f" % (r["fwd_ms"], r["fwdbwd_ms"]))' \
        "$out/attention_moe_mma.json" "$out/attention_moe_nopp.json" "$out/attention_moe_grid.json" \
        "$out/attention_moe_block.json"
      $ml bench/attention.lua json="$out/attention_moe.json" > "$out/attention_moe.log" 2>&1
      $ml bench/attention_check.lua dir="$out/attn_dump" > "$out/attention_check.log" 2>&1
      python3 bench/attention_torch.py --dump "$out/attn_dump" --moe "$out/attention_moe.json" \
        --moe-alt "$out/attention_moe_mma.json" --out "$out" > "$out/attention_torch.log" 2>&1
      note "attention: rc=$? ($(($(date +%s) - t0)) s)"; rm -rf "$out/attn_dump"
      grep -E "^\| [0-9]|validation" "$out/attention.md" ;;
    kinds)
      # Each block-sparse product's kernel time inside the MoE MLP (sparse path), per step, under
      # Nsight Systems, for the grid and epilogue settings in K_ENVS (default: one CTA per tile
      # staged, the same with direct stores, the persistent default); K_CONFIGS picks the
      # configs. Needs the importer's libraries carried at out/dw (../shared/GPU.md).
      ns=/opt/nvidia/nsight-compute/2025.3.1/host/target-linux-x64/nsys
      imp=/opt/nvidia/nsight-compute/2025.3.1/host/linux-desktop-glibc_2_11_3-x64/QdstrmImporter
      for c in ${K_CONFIGS:-mixtral olmoe qwen3 qwen3_t4k qwen3_t64k}; do
        while IFS= read -r env; do
          p=/tmp/kinds_${c}_$(echo "$env" | tr -c 'A-Za-z0-9' _)
          env $env $ns profile -o $p -t cuda --sample=none --cpuctxsw=none -f true \
            $ml bench/moe_mlp.lua configs=$c impls=sparse json=/tmp/kinds.json > /tmp/kinds.log 2>&1
          LD_LIBRARY_PATH=$root/out/dw/usr/lib/x86_64-linux-gnu $imp -i $p.qdstrm > /dev/null 2>&1
          $ns stats -r cuda_gpu_kern_sum -f csv -o $p $p.nsys-rep > /dev/null 2>&1
          python3 bench/bsmm_kinds.py ${p}_cuda_gpu_kern_sum.csv $c "$env" \
            "$(grep -E "^$c " /tmp/kinds.log | awk '{print $3}')" >> "$out/bsmm_kinds.jsonl"
        done <<< "${K_ENVS:-MOE_BSMM_PERSIST=0
MOE_BSMM_PERSIST=0 MOE_BSMM_EPI=direct
MOE_BSMM_PERSIST=1}"
      done
      note "kinds: $(wc -l < "$out/bsmm_kinds.jsonl") rows in \$OUT/bsmm_kinds.jsonl ($(($(date +%s) - t0)) s)" ;;
    sanitize)
      # compute-sanitizer over the attention kernels on odd shapes, the persistent grid cut
      # to 3 blocks so that each block runs many tiles
      for order in block head; do
        for tool in memcheck racecheck synccheck; do
          MOE_ATTN_ORDER=$order MOE_ATTN_PERSISTENT=3 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 \
            $ml bench/attention_sanitize_check.lua > "$out/sanitize_${tool}_$order.log" 2>&1
          note "sanitize $tool ($order order): rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_${tool}_$order.log" | tail -1)"
        done
      done ;;
    ops)
      # the list of ops forward and backward against PyTorch on the same GPU
      rm -rf /tmp/moe_cmp && $ml bench/torch_compare_check.lua device=cuda dir=/tmp/moe_cmp > "$out/torch_compare_moe.log" 2>&1 &&
        python3 bench/torch_compare.py /tmp/moe_cmp --json "$out/torch_compare.json" \
          --md "$out/torch_compare_table.md" > "$out/torch_compare.log" 2>&1
      note "ops vs torch: rc=$? $(tail -1 "$out/torch_compare.log")" ;;
    matmul)
      $ml bench/matmul_check.lua json="$out/matmul_check.json" > "$out/matmul_check.log" 2>&1
      note "matmul_check: rc=$?"
      $ml bench/matmul.lua cooldown=2 json="$out/matmul_moe.json" > "$out/matmul_moe.log" 2>&1
      python3 bench/matmul_torch.py --cooldown 2 --json "$out/matmul_torch.json" > "$out/matmul_torch.log" 2>&1
      python3 bench/matmul_report.py "$out/matmul_moe.json" "$out/matmul_torch.json" "$out" \
        --check "$out/matmul_check.json" --command "bash bench/gpu_round.sh matmul" > "$out/matmul_report.log" 2>&1
      note "matmul: rc=$? ($(($(date +%s) - t0)) s)" ;;
    train125)
      # The 125M dMoE (64 experts top-1) for 300 steps and the dense GPT of the same active
      # size for 100, each beside bench/train_torch.py on the weights and batch it exported.
      t=/tmp/t125; rm -rf $t; mkdir -p $t
      $ml bench/train_125m.lua experts=64 steps=300 batch_size=8 log_every=10 data=data/bible_kjv \
        export=$t/big out_dir=$t/out_big json="$out/big_moe.json" > "$out/big_moe.log" 2>&1
      python3 bench/train_torch.py --export $t/big --config "$out/big_moe.json" \
        --json "$out/big_torch.json" > "$out/big_torch.log" 2>&1
      $ml bench/train_125m.lua kind=dense steps=100 batch_size=8 log_every=10 data=data/bible_kjv \
        export=$t/dense out_dir=$t/out_dense json="$out/dense_moe.json" > "$out/dense_moe.log" 2>&1
      python3 bench/train_torch.py --export $t/dense --config "$out/dense_moe.json" \
        --json "$out/dense_torch.json" > "$out/dense_torch.log" 2>&1
      python3 bench/train_report.py "$out/big_moe.json" "$out/big_torch.json" "$out/train_125m" \
        --dense-moe "$out/dense_moe.json" --dense-torch "$out/dense_torch.json" \
        --command "bash bench/gpu_round.sh train125" > "$out/train_report.log" 2>&1
      note "train125: rc=$? ($(($(date +%s) - t0)) s)"
      grep -E "^\| (moe-lua|PyTorch)|First step" "$out/train_125m.md" ;;
    gather)
      # The fused gather of the block-sparse products (token rows read inside the wgmma kernel;
      # the GLU experts use it with MOE_BSMM_GATHER=1) against the default permuted copy: the
      # CUDA tests, compute-sanitizer over the tiny shapes of moe_mlp's smoke run with the gather
      # on (persistent grid of 3 CTAs), the products alone at the mixtral shapes
      # (bench/blocksparse.lua), then the MoE MLP benchmark (every implementation; grouped and
      # sparse also with MOE_BSMM_GATHER=1 and =wgrad, the weight gradients' products alone
      # gathering) with the torch references in the same call, ScatterMoE among them when a
      # checkout is carried at out/scattermoe (G_SCATTERMOE=DIR elsewhere) (G_CONFIGS, default
      # mixtral,olmoe,qwen3; also qwen3_t4k, qwen3_t64k, deepseek).
      for env in "" "MOE_BSMM_PERSIST=0"; do
        env $env build-gpu/tests/test_blocksparse_cuda > "$out/t_bs.log" 2>&1
        note "test_blocksparse_cuda ${env:-default}: rc=$? $(tail -1 "$out/t_bs.log")"
        grep -E "differ|gather|FAIL" "$out/t_bs.log" | head -5
      done
      build-gpu/tests/test_experts_cuda > "$out/t_ex.log" 2>&1
      note "test_experts_cuda: rc=$? $(tail -1 "$out/t_ex.log")"
      grep -E "differ|FAIL|error" "$out/t_ex.log" | head -5
      for tool in ${G_SANITIZE-memcheck racecheck synccheck}; do
        MOE_BSMM_GATHER=1 MOE_BSMM_PERSIST=3 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 \
          $ml bench/moe_mlp.lua smoke=true impls=sparse,grouped json=/tmp/sanitize.json > "$out/sanitize_$tool.log" 2>&1
        note "sanitize $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.log" | tail -1)"
      done
      $ml bench/blocksparse.lua json="$out/blocksparse_gather.json" > "$out/blocksparse_gather.log" 2>&1
      note "blocksparse: rc=$?"; grep -E "^(dense|sdd|dsd|dds)" "$out/blocksparse_gather.log"
      cf=${G_CONFIGS:-mixtral,olmoe,qwen3}
      $ml bench/moe_mlp.lua configs=$cf budget=400 json="$out/moe_mlp_moe.json" > "$out/moe_mlp_moe.log" 2>&1
      note "moe_mlp: rc=$?"; grep -E "grouped|sparse" "$out/moe_mlp_moe.log"
      MOE_BSMM_GATHER=1 $ml bench/moe_mlp.lua configs=$cf impls=grouped,sparse budget=300 \
        json="$out/moe_mlp_gathered.json" > "$out/moe_mlp_gathered.log" 2>&1
      note "moe_mlp (MOE_BSMM_GATHER=1): rc=$?"; grep -E "grouped|sparse" "$out/moe_mlp_gathered.log"
      MOE_BSMM_GATHER=wgrad $ml bench/moe_mlp.lua configs=$cf impls=grouped,sparse budget=300 \
        json="$out/moe_mlp_gathered_wgrad.json" > "$out/moe_mlp_gathered_wgrad.log" 2>&1
      note "moe_mlp (MOE_BSMM_GATHER=wgrad): rc=$?"; grep -E "grouped|sparse" "$out/moe_mlp_gathered_wgrad.log"
      sm=${G_SCATTERMOE:-$root/out/scattermoe}; smarg=(); [ -d "$sm/scattermoe" ] && smarg=(--scattermoe "$sm")
      python3 bench/moe_mlp_torch.py --configs $cf --budget 400 --compile "${smarg[@]}" \
        --json "$out/moe_mlp_torch.json" > "$out/moe_mlp_torch.log" 2>&1
      note "moe_mlp_torch: rc=$? ${smarg[*]}"; grep -E "torch_grouped_mm|scattermoe|Error" "$out/moe_mlp_torch.log" | head -12
      python3 bench/moe_mlp_report.py "$out/moe_mlp_moe.json" "$out/moe_mlp_torch.json" "$out" \
        --gathered "$out/moe_mlp_gathered.json" --gathered "$out/moe_mlp_gathered_wgrad.json" \
        --command "bash bench/gpu_round.sh gather" > "$out/moe_mlp_report.log" 2>&1
      note "moe_mlp_report: rc=$? ($(($(date +%s) - t0)) s)" ;;
    auto)
      # mlp_impl auto: the MoE MLP benchmark with the auto row (the autotuner's pick, timed) beside
      # the grouped and sparse rows, and the torch references in the same call: eager and compiled
      # torch._grouped_mm, ScatterMoE when a checkout of shawntan/scattermoe is carried at
      # out/scattermoe (A_SCATTERMOE=DIR elsewhere), and the dense bound (the same FLOPs as one dense
      # MLP, and its GEMMs alone: --dense-bound); then the 125M dMoE trained a few steps with
      # mlp_impl auto, whose log names the pick (A_CONFIGS, default mixtral,olmoe,qwen3). A_COOLDOWN=S
      # idles the GPU S seconds before each side's dense rate and every row (the order of the rows
      # moves them by up to 6 % under the power cap; docs/EXPERTS.md).
      cf=${A_CONFIGS:-mixtral,olmoe,qwen3}
      cd_s=${A_COOLDOWN:-0}
      $ml bench/moe_mlp.lua configs=$cf impls=grouped,grouped_cublas,sparse,auto budget=400 cooldown=$cd_s \
        json="$out/moe_mlp_moe.json" > "$out/moe_mlp_moe.log" 2>&1
      note "moe_mlp: rc=$?"; grep -E "grouped|sparse|auto" "$out/moe_mlp_moe.log" | grep -v "^|"
      sm=${A_SCATTERMOE:-$root/out/scattermoe}; smarg=(); [ -d "$sm/scattermoe" ] && smarg=(--scattermoe "$sm")
      python3 bench/moe_mlp_torch.py --configs $cf --budget 500 --compile --dense-bound --cooldown $cd_s "${smarg[@]}" \
        --json "$out/moe_mlp_torch.json" > "$out/moe_mlp_torch.log" 2>&1
      note "moe_mlp_torch: rc=$? ${smarg[*]}"; grep -E "torch_grouped_mm|scattermoe|Error" "$out/moe_mlp_torch.log" | head -12
      python3 bench/moe_mlp_report.py "$out/moe_mlp_moe.json" "$out/moe_mlp_torch.json" "$out" \
        --command "bash bench/gpu_round.sh auto" > "$out/moe_mlp_report.log" 2>&1
      note "moe_mlp_report: rc=$?"; grep -E "auto on|ScatterMoE|time targets" "$out/moe_mlp.md"
      $ml train device=cuda dtype=bf16 steps=3 warmup=0 eval_every=0 sample_tokens=0 tensorboard=false \
        out_dir=/tmp/auto125 overwrite=true model.d_model=768 model.n_layers=12 model.n_heads=12 \
        model.moe.num_experts=64 model.moe.top_k=1 model.moe.ffn_hidden_size=3072 > "$out/auto_train.log" 2>&1
      note "train (mlp_impl auto): rc=$? $(grep -E 'mlp_impl auto' "$out/auto_train.log" | tr '\n' ';')"
      note "auto: $(($(date +%s) - t0)) s" ;;
    determinism)
      # deterministic = true on the GPU: the same short bf16 run twice, losses compared bit for
      # bit (and twice without it, to show what it changes), then data + expert parallelism on
      # two GPUs when there are two (EP=2, the same comparison).
      run() { $ml train device=cuda dtype=bf16 steps=20 warmup=0 eval_every=0 sample_tokens=0 tensorboard=false \
        log_every=1 overwrite=true model.d_model=256 model.n_layers=4 model.n_heads=4 model.moe.num_experts=16 \
        model.moe.top_k=2 model.moe.ffn_hidden_size=512 "$@"; }
      losses() { python3 -c 'import json,sys; print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1]) if "\"loss\"" in l))' "$1"; }
      for det in true false; do
        for n in 1 2; do run deterministic=$det out_dir=/tmp/det_${det}_$n > "$out/det_${det}_$n.log" 2>&1; done
        a=$(losses /tmp/det_${det}_1/metrics.jsonl); b=$(losses /tmp/det_${det}_2/metrics.jsonl)
        note "deterministic=$det, two runs: $([ -n "$a" ] && [ "$a" = "$b" ] && echo bit-identical || echo DIFFER) (last: ${a##* } / ${b##* })"
      done
      if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
        for n in 1 2; do
          OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 $ml launch -n 2 train device=cuda dtype=bf16 \
            steps=20 warmup=0 eval_every=0 sample_tokens=0 tensorboard=false log_every=1 overwrite=true \
            deterministic=true parallel.ep=2 model.moe.num_experts=16 out_dir=/tmp/det_ep_$n > "$out/det_ep_$n.log" 2>&1
        done
        a=$(losses /tmp/det_ep_1/metrics.jsonl); b=$(losses /tmp/det_ep_2/metrics.jsonl)
        note "deterministic=true ep=2, two runs: $([ -n "$a" ] && [ "$a" = "$b" ] && echo bit-identical || echo DIFFER)"
      fi
      note "determinism: $(($(date +%s) - t0)) s" ;;
    blocksparse)
      # The block-sparse kernels with the staged epilogue (default) and the direct one
      # (MOE_BSMM_EPI=direct): tests of both, then each timed twice, alternating
      # (BS_EPIS="default smem direct", BS_ROUNDS="1 2" choose).
      for env in "" "MOE_BSMM_EPI=direct" "MOE_BSMM_EPI=smem" "MOE_BSMM_PERSIST=3" "MOE_BSMM_PERSIST=0"; do
        env $env build-gpu/tests/test_blocksparse_cuda > "$out/t_bs.log" 2>&1
        note "test_blocksparse_cuda ${env:-default}: rc=$? $(tail -1 "$out/t_bs.log")"
      done
      build-gpu/tests/test_experts_cuda > "$out/t_ex.log" 2>&1
      note "test_experts_cuda: rc=$? $(tail -1 "$out/t_ex.log")"
      $ml bench/blocksparse_check.lua json="$out/bs_check.json" > "$out/bs_check.log" 2>&1
      note "blocksparse_check: rc=$?"
      for n in ${BS_ROUNDS:-1 2}; do
        for epi in ${BS_EPIS:-smem direct}; do
          ev=MOE_BSMM_EPI=$epi; [ "$epi" = default ] && ev=MOE_BSMM_EPI=
          env $ev $ml bench/blocksparse.lua json="$out/bs_${epi}_$n.json" > "$out/bs_${epi}_$n.log" 2>&1
          note "bsmm $epi #$n: $(python3 -c "import json,sys;j=json.load(open(sys.argv[1]));print(' '.join('%s %.1f' % (r.get('name', r.get('product')), r.get('tflops', 0)) for r in j.get('results', [])))" "$out/bs_${epi}_$n.json" 2>&1 | head -c 300)"
          env $ev $ml bench/moe_mlp.lua configs=mixtral impls=grouped,sparse \
            json="$out/mlp_${epi}_$n.json" > "$out/mlp_${epi}_$n.log" 2>&1
          note "moe_mlp mixtral $epi #$n: $(grep -E "grouped|sparse" "$out/mlp_${epi}_$n.log" | tr -s ' ' | tail -2 | tr '\n' ';')"
        done
      done ;;
    quantize)
      # Issue 6: the dMoE layer at the benchmark shapes with its saved pre-activations off / 8 / 4
      # bits (the fused CUDA passes), the same with the unfused passes (MOE_GLU_QFUSED=0) as an
      # A/B, the block-sparse experts, and the quantize kernels alone.
      $ml bench/quantize.lua layer=dmoe configs=mixtral,qwen3 repeats=${Q_REPEATS:-10} \
        json="$out/quantize.json" > "$out/quantize.log" 2>&1
      note "quantize (fused): rc=$?"; grep -E "bits=" "$out/quantize.log"
      MOE_GLU_QFUSED=0 $ml bench/quantize.lua layer=dmoe configs=mixtral,qwen3 repeats=${Q_REPEATS:-10} \
        json="$out/quantize_unfused.json" > "$out/quantize_unfused.log" 2>&1
      note "quantize (unfused): rc=$?"; grep -E "bits=" "$out/quantize_unfused.log"
      $ml bench/quantize.lua layer=dmoe impl=sparse configs=qwen3,olmoe repeats=${Q_REPEATS:-10} \
        json="$out/quantize_sparse.json" > "$out/quantize_sparse.log" 2>&1
      note "quantize (sparse): rc=$?"; grep -E "bits=" "$out/quantize_sparse.log"
      $ml bench/quantize.lua kernels=true configs=mixtral,qwen3 json="$out/quantize_kernels.json" \
        > "$out/quantize_kernels.log" 2>&1
      note "quantize kernels: rc=$? ($(($(date +%s) - t0)) s)" ;;
    curves)
      # Issue 6: the 46M dMoE's loss in modes Q_MODES (off,8,4) for each seed in Q_SEEDS,
      # Q_STEPS steps (the preset's 300 when unset), into Q_NAME.json; Q_MLP=glu: SwiGLU experts.
      name=${Q_NAME:-quantize_curves_dmoe46m}
      $ml bench/quantize_curves.lua run preset=dmoe46m device=cuda seeds=${Q_SEEDS:-1234,1,2} \
        modes=${Q_MODES:-off,8,4} ${Q_STEPS:+steps=$Q_STEPS} ${Q_MLP:+mlp=$Q_MLP} out=/tmp/qc json="$out/$name.json" \
        > "$out/$name.log" 2>&1
      note "curves $name: rc=$? ($(($(date +%s) - t0)) s)"; grep -E "mode=" "$out/$name.log" ;;
    checks)
      # every bench/*_check.lua that checks on its own (the others feed a PyTorch script: glu_check,
      # attention, ops)
      for c in matmul grouped blocksparse pointwise; do
        $ml bench/${c}_check.lua json="$out/${c}_check.json" > "$out/${c}_check.log" 2>&1
        note "${c}_check: rc=$? $(grep -c FAILED "$out/${c}_check.log") failed"
      done ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
# The machine hands back only a few files: everything small goes into one archive.
(cd "$out" && tar czf /tmp/round.tgz --exclude='*.safetensors' --exclude='tb' . &&
  find . -mindepth 1 -maxdepth 1 -exec rm -rf {} + && mv /tmp/round.tgz .)
echo "== summary =="
printf '%s\n' "${summary[@]}"
