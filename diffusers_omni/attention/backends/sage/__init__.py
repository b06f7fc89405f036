"""The SageAttention family: ``SAGE_ATTN`` (``sageattention``, INT8 Q·K) and ``SAGE_ATTN_3`` (``sageattn3``, FP4 on
Blackwell), both lossy and forward only (``backend.py``). Never a platform default.
"""

from __future__ import annotations

from ..family import Alias, BackendFamily, backend_module_getattr

FAMILY = BackendFamily(
    "sage",
    backends={
        "SAGE_ATTN": f"{__name__}.backend:SageAttentionBackend",
        "SAGE_ATTN_3": f"{__name__}.backend:SageAttention3Backend",
    },
    aliases=(
        Alias("sage", "SAGE_ATTN", "sageattention package (lossy INT8 QK); masked roles are refused at enable time"),
        Alias("sage_varlen", "SAGE_ATTN", "SAGE_ATTN takes no mask: masked roles are refused at enable time with the "
              "reason"),
    ),
)


__getattr__ = backend_module_getattr(__name__)
