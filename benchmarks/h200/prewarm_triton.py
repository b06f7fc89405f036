"""Compile the Triton kernels ``hopper_bench`` runs, at its exact shapes (Triton specialises on argument values:
divisibility by 16, the value 1), in a process of its own, so that it overlaps FlashInfer's JIT in
``prewarm_block_sparse`` instead of adding to the run. Both caches are on disk; the benchmark then loads them.

Block-sparse: the pooling and selection kernels (top-k at each benchmarked sparsity, cumulative mass), without the
attention itself. FP8: the quantisation kernels at every FP8 benchmark shape.

    python -m benchmarks.h200.prewarm_triton & python -m benchmarks.h200.prewarm_block_sparse & wait
"""

import time

import torch

from benchmarks.hopper_bench import MASS_THRESHOLDS, SHAPES, SPARSE_SHAPES, SPARSITIES, wan_layout
from diffusers_omni.attention import block_sparse as bs
from diffusers_omni.attention import fp8_quant as fq

start = time.perf_counter()


def selections(tokens: int, heads: int, grid, mass: bool) -> None:
    q, k, v = (torch.randn(1, tokens, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    layouts = [bs.SparseLayout(tokens)] + ([wan_layout(tokens, grid)] if grid is not None else [])
    chosen = [{"sparsity": x} for x in SPARSITIES] + ([{"mass_threshold": x} for x in MASS_THRESHOLDS] if mass else [])
    for layout in layouts:
        for selection in chosen:
            runner = bs.BlockSparseRunner(lambda device: bs.ReferencePagedPrefill())
            runner.select(runner.prepare(q, k, v, layout, **selection))
    bs.pool_and_gather(q, k, layouts[0], None, gather_q=False)
    torch.cuda.synchronize()


for label, heads, tokens, grid in SPARSE_SHAPES:
    selections(tokens, heads, grid, mass=tokens > 10000)
selections(8192, 4, (8, 32, 32), mass=True)  # hopper_bench's correctness checks
q = torch.randn(1, 8192, 4, 128, device="cuda", dtype=torch.bfloat16)
runner = bs.BlockSparseRunner(lambda device: bs.ReferencePagedPrefill())
runner.select(runner.prepare(q, q, q, bs.SparseLayout(8192), mass_threshold=0.5))
print(f"triton block-sparse kernels ready in {time.perf_counter() - start:.1f} s", flush=True)

for label, b, h, sq, skv, d, masked in SHAPES:
    if not masked:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(b, skv, h, d, device="cuda", dtype=torch.bfloat16)
        fq.quantize_qkv(q, kv, kv)
torch.cuda.synchronize()
print(f"triton block-sparse and FP8 kernels ready in {time.perf_counter() - start:.1f} s", flush=True)
