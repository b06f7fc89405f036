#!/usr/bin/env bash
# One device call on an H200: install the carried wheels (benchmarks/h200/fetch_wheels.sh), then run each named
# scenario of benchmarks/registry.py through the runner, which files it under $OUT/<scenario>/latest.json
# (python -m benchmarks --list names them all; a job name is a scenario name).
#   device run: OMNI_COMMIT=<git rev-parse HEAD here> bash benchmarks/h200/run_all.sh SCENARIO [SCENARIO...]
#   back here:  python -m benchmarks adopt <the run's files_at>/   # files them, archiving the runs they replace
#               python -m benchmarks.docs_tables                    # re-renders the docs from the new latest results
# The device gets a copy of the working tree without .git: OMNI_COMMIT records the commit in each result's meta.
# A few scenarios need more than the runner: FlashInfer JIT-compiles ~90 s per kernel variant on a fresh machine and
# Triton its kernels (prewarmed in parallel first), the FA3-hidden tune runs use the wheels without fa3-fwd, and
# quant-offload-check's LoRA scenarios need peft and accelerate, the pipeline-offload-* ones mmgp, optimum-quanto and
# accelerate. Offload runs take ~4 min per model; the quant-offload-* and pipeline-offload-* scenarios each fit one
# 10-minute call (their --time-budget starts no format/strategy after it).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/benchmark-results}
[ -n "${OMNI_COMMIT:-}" ] || echo "OMNI_COMMIT is not set: results will record commit \"unknown\"" >&2
run() { python3 -m benchmarks run "$1" --results-root "$out"; }
no_fa3() {  # FA3 hidden (stands in for an Ampere/Ada user: no FA3/FA4 there): the same wheels without fa3-fwd
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-nofa3 $(ls .whl/*.whl | grep -v fa3_fwd) || return 1
  python3 -m benchmarks.h200.prewarm_flashinfer 128
  PYTHONPATH=/tmp/site-nofa3 run "$1"
}
status=0
for job in "$@"; do
  case "$job" in
    attention) for d in 128 64; do python3 -m benchmarks.h200.prewarm_flashinfer $d & done; wait; run "$job" ;;
    hopper) # FlashInfer paged FA3 bf16 d128 (~90 s on a fresh machine) while Triton compiles the benchmark's kernels
            python3 -m benchmarks.h200.prewarm_block_sparse & python3 -m benchmarks.h200.prewarm_triton & wait
            run "$job" ;;
    sparse-probe) python3 -m benchmarks.h200.prewarm_block_sparse && run "$job" ;;
    tune|tune-lossy) # FlashInfer's dense and paged prefill and the Triton kernels compile in parallel first, as
                     # `diffusers-omni warmup` would on a user's machine; tune_bench reports tune's own time
          python3 -m benchmarks.h200.prewarm_flashinfer 128 & python3 -m benchmarks.h200.prewarm_block_sparse &
          python3 -m benchmarks.h200.prewarm_triton & wait
          run "$job" ;;
    tune-no-fa3|tune-no-fa3-flux) no_fa3 "$job" ;;
    quant-offload-check) # its LoRA scenarios need peft (and accelerate): installed for this job only
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site-lora .whl/lora/*.whl
          PYTHONPATH=/tmp/site-lora:$PYTHONPATH run "$job" ;;
    pipeline-offload-*) # mmgp, optimum-quanto and accelerate (fetch_wheels.sh: .whl/pipeline), for these jobs only
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site-pipeline .whl/pipeline/*.whl
          PYTHONPATH=/tmp/site-pipeline:$PYTHONPATH run "$job" ;;
    *) run "$job" ;;  # every other scenario needs nothing but the runner (an unknown name: the runner lists them)
  esac
  rc=$?; [ $rc -eq 0 ] || { echo "job $job failed (exit $rc)" >&2; status=$rc; }
done
exit $status
