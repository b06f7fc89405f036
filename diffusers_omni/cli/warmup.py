"""``diffusers-omni warmup``: compile the just-in-time kernels of the Hopper lossy paths ahead of the first call.

FlashInfer compiles its paged FA3 prefill (``RAINFUSION_ATTN`` on CUDA) on first use, about 90 s per (dtype, head
dim) on a fresh machine, and caches it on disk (``~/.cache/flashinfer``, or ``FLASHINFER_WORKSPACE_BASE``); Triton
compiles the FP8 quantisation kernels (``FLASH_ATTN`` with ``quant``) and the block-sparse pooling and selection
kernels (each launch configuration they time on a first call) in seconds, and caches them too; later shapes only
re-time the cached variants. Running this
once per machine (or image build) moves that cost out of the first generation.
"""

from __future__ import annotations

import time

_DTYPES = ("bfloat16", "float16")


def add_parser(sub):
    warmup = sub.add_parser("warmup", help="compile the FlashInfer block-sparse and FP8 quantisation kernels once")
    warmup.add_argument("--head-dims", default="128", help="comma-separated head dims (default: 128)")
    warmup.add_argument("--dtypes", default="bfloat16", help=f"comma-separated, of {', '.join(_DTYPES)}")
    warmup.add_argument("--only", choices=["sparse", "fp8"], help="compile one family only")
    return warmup


def _parse(args) -> tuple[list[int], list[str]]:
    try:
        dims = [int(x) for x in args.head_dims.split(",")]
    except ValueError:
        raise ValueError(f"--head-dims={args.head_dims!r}: expected comma-separated ints, e.g. 64,128") from None
    bad = [d for d in dims if d not in (64, 128, 256)]
    if bad:
        raise ValueError(f"--head-dims={args.head_dims!r}: {bad} not allowed; allowed: 64, 128, 256")
    dtypes = [x.strip() for x in args.dtypes.split(",")]
    unknown = [x for x in dtypes if x not in _DTYPES]
    if unknown:
        raise ValueError(f"--dtypes={args.dtypes!r}: {unknown} not allowed; allowed: {', '.join(_DTYPES)}")
    return dims, dtypes


def run(args) -> int:
    import torch

    from .common import configure_logging

    configure_logging(False)
    dims, dtypes = _parse(args)
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device here (warmup compiles CUDA kernels)")
    from ..attention.backends.rainfusion.block_sparse import BlockSparseRunner, SparseLayout
    from ..attention.backends.flash.fp8_quant import quantize_qkv

    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for dim in dims:
            q = torch.randn(1, 4096, 1, dim, device="cuda", dtype=dtype)
            if args.only in (None, "sparse"):
                start = time.perf_counter()
                BlockSparseRunner()(q, q, q, SparseLayout(4096), 0.5)
                torch.cuda.synchronize()
                print(f"block-sparse (FlashInfer paged FA3) {dtype_name} head_dim={dim}: "
                      f"ready in {time.perf_counter() - start:.1f} s")
            if args.only in (None, "fp8"):
                start = time.perf_counter()
                quantize_qkv(q, q, q)
                torch.cuda.synchronize()
                print(f"FP8 quantisation (Triton) {dtype_name} head_dim={dim}: ready in "
                      f"{time.perf_counter() - start:.1f} s")
    return 0
