"""The PyTorch SDPA family: ``TORCH_SDPA`` (PyTorch's dispatcher, the reference and last resort on every platform)
and ``CUDNN_ATTN`` (cuDNN's fused attention, pinned). Kernels: ``backend.py``.
"""

from __future__ import annotations

from ..family import Alias, BackendFamily, Route, backend_module_getattr

_BLACKWELL = ("blackwell_datacenter", "blackwell_workstation")
# Hopper's route is TORCH_SDPA (unpinned SDPA lands on cuDNN: benchmarks/results/attention/latest.md), and no single
# kernel wins every shape there: FlashAttention-3 leads on long unmasked self-attention, FlashInfer on short masked
# sequences, SDPA at head_dim 64. Those per-shape choices come from routing_table.json (routing.ShapeRouter).
_HOPPER_WHY = "the reference kernel; measured shape classes are routed per routing_table.json"


def _cudnn_at_least_9_5(platform, call) -> bool:
    return (platform.cudnn_version or 0) >= 90500


FAMILY = BackendFamily(
    "sdpa",
    backends={
        "TORCH_SDPA": f"{__name__}.backend:TorchSDPABackend",
        "CUDNN_ATTN": f"{__name__}.backend:CudnnAttentionBackend",
    },
    aliases=(
        Alias("native", "TORCH_SDPA", "torch SDPA; on CUDA pinned to flash → memory-efficient → math"),
        Alias("_native_cudnn", "CUDNN_ATTN", "torch's cuDNN attention kernel"),
    ),
    routes=(
        Route("CUDNN_ATTN", when=("cudnn_at_least_9_5",), platforms=_BLACKWELL, priority=20),
        Route("TORCH_SDPA", why=_HOPPER_WHY, platforms=("hopper",), priority=100),
        Route("TORCH_SDPA", platforms=(*_BLACKWELL, "ada", "ampere", "cuda", "cpu", "mps"), priority=100),
    ),
    conditions={"cudnn_at_least_9_5": _cudnn_at_least_9_5},
)


__getattr__ = backend_module_getattr(__name__)
