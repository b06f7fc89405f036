"""The FlashInfer family: ``FLASHINFER_ATTN``, FlashInfer's ragged batch prefill planned once per call signature, with
QK16/V8 mixed-dtype attention through ``quant`` (``backend.py``).
"""

from __future__ import annotations

from ..family import BackendFamily, Route, backend_module_getattr, choice

QK_DTYPES = ("float16", "bfloat16")
VO_DTYPES = ("float16", "bfloat16", "fp8_e4m3")


def check_quant(backend: str, quant) -> None:
    """``quant`` with FLASHINFER_ATTN: Q/K in 16 bit, V in 16 bit or fp8_e4m3 (QK16/V8)."""
    if quant.dtype_qk is not None:
        choice("quant", "dtype_qk", quant.dtype_qk, QK_DTYPES, f"with {backend}")
    if quant.dtype_vo is not None:
        choice("quant", "dtype_vo", quant.dtype_vo, VO_DTYPES, f"with {backend}")
    if quant.dtype_qk is None and quant.dtype_vo is None:
        raise ValueError(
            f"quant with {backend} needs dtype_qk and/or dtype_vo; allowed dtype_qk: {QK_DTYPES}, dtype_vo: {VO_DTYPES}"
        )


FAMILY = BackendFamily(
    "flashinfer",
    backends={"FLASHINFER_ATTN": f"{__name__}.backend:FlashInferBackend"},
    options={"quant": check_quant},
    routes=(Route("FLASHINFER_ATTN", platforms=("blackwell_datacenter", "blackwell_workstation"), priority=30),),
)


__getattr__ = backend_module_getattr(__name__)
