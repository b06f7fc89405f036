#!/usr/bin/env bash
# One device call that installs the carried wheels and runs every pending H200 measurement, writing under $OUT.
# Budget: FlashInfer JIT-compiles ~90 s per kernel variant on a fresh machine; the offload runs take ~4 min per model.
#   device run: bash benchmarks/h200/run_all.sh attention|sage|offload-budget|offload-distributed|offload-lifecycle|alignment|hopper|quant-offload|quant-offload-wan|quant-offload-check|quant-offload-budget|peak-diff
# offload-lifecycle: 20 delete-and-rebuild cycles per strategy + 100 denoising steps, ~6-7 min on an H200.
# quant-offload (FLUX size) and quant-offload-wan (Wan-14B size): 5 formats each, one device call each; a format
# starts only within the time budget and results are written after every format, so a call stays under 10 min.
# Both also time each block (--per-block: the 2-block cyclic bound) and probe the allocator (--cache-probe: one more
# from-device omni pass on a fresh model with torch.cuda.empty_cache() around apply_offload).
# quant-offload-check: every format x strategy on tiny models + the quantized pipelines (correctness only).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-benchmarks/results}
for job in "$@"; do
  case "$job" in
    attention) for d in 128 64; do python3 -m benchmarks.h200.prewarm_flashinfer $d & done; wait
               python3 -m benchmarks.attention_bench --out "$out/attention_h200" ;;
    sage) python3 -m benchmarks.sage_bench --out "$out/sage_h200" ;;
    offload-budget) python3 -m benchmarks.offload_bench --models flux --variants layerwise,budget \
                      --out "$out/offload_h200_flux_budget" ;;
    offload-budget-rerun) python3 -m benchmarks.offload_bench --models flux --variants layerwise,budget \
                            --out "$out/offload_h200_flux_budget_run_cap" ;;
    offload-distributed) for m in flux wan; do
                           python3 -m benchmarks.offload_bench --models $m --variants layerwise,distributed,mmap \
                             --skip-model-level --out "$out/offload_h200_distributed_$m"
                         done ;;
    offload-multigpu) python3 -m torch.distributed.run --nproc-per-node "$(python3 -c 'import torch;print(torch.cuda.device_count())')" \
                        -m benchmarks.distributed_offload_bench --models flux,wan --out "$out/offload_multigpu_h200" ;;
    offload-lifecycle) python3 -m benchmarks.offload_lifecycle_bench --out "$out/offload_lifecycle_h200" ;;
    alignment) python3 -m benchmarks.alignment_gpu --out "$out/alignment_h200" ;;
    hopper) # FlashInfer paged FA3 bf16 d128 (~90 s on a fresh machine) while Triton compiles the benchmark's kernels
            python3 -m benchmarks.h200.prewarm_block_sparse & python3 -m benchmarks.h200.prewarm_triton & wait
            python3 -m benchmarks.hopper_bench --out "$out/hopper_fp8_sparse_h200" --e2e "$out/e2e_attention_h200.json" ;;
    quant-offload) python3 -m benchmarks.quant_offload_bench --models flux --warmup 1 --repeats 2 --time-budget 400 \
                     --per-block --cache-probe --deeper 3 --out "$out/quant_offload_h200" ;;
    quant-offload-wan) python3 -m benchmarks.quant_offload_bench --models wan --warmup 1 --repeats 2 --time-budget 380 \
                         --per-block --cache-probe --deeper 3 --out "$out/quant_offload_h200_wan" ;;
    quant-offload-check) # its LoRA scenarios need peft (and accelerate): installed for this job only
                         python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                           --target /tmp/site-lora .whl/lora/*.whl
                         PYTHONPATH=/tmp/site-lora:$PYTHONPATH python3 -m benchmarks.quant_offload_check \
                           --out "$out/quant_offload_h200_check" ;;
    quant-offload-budget) python3 -m benchmarks.quant_offload_bench --models flux --formats torchao-int8,gguf-q8_0 \
                            --warmup 1 --repeats 3 --budget 2.5,3 --per-block --no-peak-trace \
                            --out "$out/quant_offload_h200_budget_largest_first" ;;
    quant-offload-budget-more) python3 -m benchmarks.quant_offload_bench --models flux --formats gguf-q8_0,torchao-int8 \
                                 --warmup 1 --repeats 5 --budget 3.5,4,5 --no-peak-trace \
                                 --out "$out/quant_offload_h200_budget_more" ;;
    quant-offload-tail) python3 -m benchmarks.quant_offload_bench --models flux \
                          --formats gguf-q4_k,gguf-q8_0,torchao-float8,bnb-nf4,torchao-int8 --warmup 1 --repeats 3 \
                          --time-budget 200 --out "$out/quant_offload_h200_tail" ;;
    quant-offload-tail2) python3 -m benchmarks.quant_offload_bench --models flux \
                           --formats torchao-float8,bnb-nf4,gguf-q4_k --warmup 1 --repeats 3 \
                           --time-budget 150 --out "$out/quant_offload_h200_tail_overlap" ;;
    offload-flux-tail) python3 -m benchmarks.offload_bench --models flux --variants layerwise,diffusers \
                         --out "$out/offload_h200_flux_tail" ;;
    quant-offload-wan-final) python3 -m benchmarks.quant_offload_bench --models wan \
                               --formats torchao-float8,torchao-int8,gguf-q8_0 --warmup 1 --repeats 2 \
                               --time-budget 230 --out "$out/quant_offload_h200_wan_final" ;;
    quant-offload-wan-final2) python3 -m benchmarks.quant_offload_bench --models wan --formats gguf-q4_k,bnb-nf4 \
                                --warmup 1 --repeats 2 --time-budget 200 --out "$out/quant_offload_h200_wan_final2" ;;
    quant-offload-final) python3 -m benchmarks.quant_offload_bench --models flux \
                           --formats torchao-float8,bnb-nf4,torchao-int8,gguf-q8_0,gguf-q4_k --warmup 1 --repeats 5 \
                           --per-block --time-budget 260 --out "$out/quant_offload_h200_final" ;;
    quant-offload-traffic) python3 -m benchmarks.quant_offload_bench --models flux \
                             --formats torchao-float8,bnb-nf4,torchao-int8,gguf-q8_0,gguf-q4_k --warmup 1 --repeats 5 \
                             --copy-traffic --no-peak-trace --time-budget 330 --out "$out/quant_offload_h200_traffic" ;;
    quant-offload-deeper) python3 -m benchmarks.quant_offload_bench --models flux --formats torchao-int8,gguf-q8_0 \
                            --warmup 1 --repeats 3 --deeper 3 --no-peak-trace --time-budget 150 \
                            --out "$out/quant_offload_h200_deeper" ;;
    peak-diff) python3 -m benchmarks.peak_probe --diff --format gguf-q4_k --out "$out/peak_diff_h200" ;;
    quant-offload-rerun) python3 -m benchmarks.quant_offload_bench --models flux --warmup 1 --repeats 3 --time-budget 300 \
                           --out "$out/quant_offload_h200_views_once" ;;
    offload-timeline) python3 -m benchmarks.offload_timeline --time-budget 300 --out "$out/offload_timeline_h200" ;;
    sparse-probe) python3 -m benchmarks.h200.prewarm_block_sparse && python3 -m benchmarks.sparse_schedule_probe --out "$out/sparse_schedule_probe_h200" ;;
    tune) # FlashInfer's dense and paged prefill JIT (~90 s each on a fresh machine, cached on disk) and the Triton kernels
          # compile in parallel first, as `diffusers-omni warmup` would on a user's machine; tune_bench reports tune's own time
          python3 -m benchmarks.h200.prewarm_flashinfer 128 & python3 -m benchmarks.h200.prewarm_block_sparse &
          python3 -m benchmarks.h200.prewarm_triton & wait
          python3 -m benchmarks.tune_bench --models flux,wan,qwen --out "$out/tune_h200" ;;
    tune-lossy) python3 -m benchmarks.tune_bench --models flux,wan,qwen --lossy --out "$out/tune_h200_lossy" ;;
    tune-no-fa3) # FA3 hidden (stands in for an Ampere/Ada user: no FA3/FA4 there): the same wheels without fa3-fwd
                 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                   --target /tmp/site-nofa3 $(ls .whl/*.whl | grep -v fa3_fwd) || exit 1
                 python3 -m benchmarks.h200.prewarm_flashinfer 128
                 PYTHONPATH=/tmp/site-nofa3 python3 -m benchmarks.tune_bench --models flux,wan,qwen \
                   --label "FA3 hidden (fa3-fwd not installed): stands in for an Ampere/Ada user" \
                   --out "$out/tune_h200_no_fa3" ;;
    *) echo "unknown job $job" >&2; exit 2 ;;
  esac
done
