"""JIT-compile FlashInfer's prefill for one head dim on a tiny input, so that several head dims compile in parallel
processes (~90 s each on a fresh machine) before ``attention_bench.py`` times them.

    python -m benchmarks.h200.prewarm_flashinfer 128 & python -m benchmarks.h200.prewarm_flashinfer 64 & wait
"""

import sys
import time

import torch


from diffusers_omni.attention.backends.flashinfer import FlashInferBackend

head_dim = int(sys.argv[1])
start = time.perf_counter()
q, k, v = (torch.randn(1, 256, 4, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
try:
    FlashInferBackend(None)(q, k, v)
    torch.cuda.synchronize()
    print(f"flashinfer head_dim={head_dim}: compiled in {time.perf_counter() - start:.0f} s", flush=True)
except Exception as exc:  # the benchmark records the failure per shape; this only warms the cache
    print(f"flashinfer head_dim={head_dim}: {type(exc).__name__}: {exc}", flush=True)
