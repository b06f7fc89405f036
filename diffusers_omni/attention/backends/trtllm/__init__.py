"""The TensorRT-LLM family: ``TRTLLM_ATTN``, FlashInfer's trtllm-gen FMHA on datacenter Blackwell (``backend.py``), with
Skip-Softmax sparsity (``skip_softmax``: its calibration, ``calibration.py``, and its timestep gate,
``timestep_gate.py``) and SAGE quantisation (``quant``).
"""

from __future__ import annotations

from ..family import BackendFamily, Route, backend_module_getattr, choice

QK_DTYPES = ("int8", "fp8_e4m3")
BLOCK_SIZES = (1, 4, 16)


def check_quant(backend: str, quant) -> None:
    """``quant`` with TRTLLM_ATTN: SAGE quantisation of Q and K (V stays unquantised) in blocks of 1, 4 or 16."""
    if quant.dtype_qk is None:
        raise ValueError(f"quant.dtype_qk is required with {backend}; allowed: {QK_DTYPES}")
    choice("quant", "dtype_qk", quant.dtype_qk, QK_DTYPES, f"with {backend}")
    if quant.dtype_vo is not None:
        raise ValueError(
            f"quant.dtype_vo={quant.dtype_vo!r} is not allowed with {backend} (V stays unquantised); allowed: None"
        )
    choice("quant", "q_block_size", quant.q_block_size, BLOCK_SIZES, f"with {backend}")
    choice("quant", "k_block_size", quant.k_block_size, BLOCK_SIZES, f"with {backend}")


FAMILY = BackendFamily(
    "trtllm",
    backends={"TRTLLM_ATTN": f"{__name__}.backend:TrtllmAttentionBackend"},
    options={"quant": check_quant, "skip_softmax": None},  # SkipSoftmaxSpec's values are checked by the spec itself
    routes=(
        Route(
            "TRTLLM_ATTN",
            when=("model_declares_mask_free_path", "head_dim_128"),
            why="trtllm-gen FMHA on datacenter Blackwell for mask-free head_dim 128 paths",
            platforms=("blackwell_datacenter",),
            priority=10,
        ),
    ),
)


__getattr__ = backend_module_getattr(__name__)
