"""JIT-compile (or load) FlashInfer's paged FA3 prefill that block-sparse ``RAINFUSION_ATTN`` runs (bf16, head_dim
128), about 90 s on a fresh machine, before ``hopper_bench`` times it.

    python -m benchmarks.h200.prewarm_block_sparse
"""

import time

import torch

from diffusers_omni.attention.block_sparse import BlockSparseRunner, SparseLayout

start = time.perf_counter()
q = torch.randn(1, 4096, 2, 128, device="cuda", dtype=torch.bfloat16)
BlockSparseRunner()(q, q, q, SparseLayout(4096), 0.5)
torch.cuda.synchronize()
print(f"flashinfer paged fa3 bf16 d128 ready in {time.perf_counter() - start:.1f} s", flush=True)
