"""The RainFusion family: ``RAINFUSION_ATTN``, block-sparse attention (``block_sparse`` option): MindIE-SD rf_v2 on
Ascend and FlashInfer's paged FA3 prefill on Hopper (``backend.py``), the block selection and its kernels
(``block_sparse.py``) and the video geometry planner (``plan.py``). Chosen explicitly only.
"""

from __future__ import annotations

from ..family import BackendFamily, backend_module_getattr

FAMILY = BackendFamily(
    "rainfusion",
    backends={"RAINFUSION_ATTN": f"{__name__}.backend:RainFusionBackend"},
    options={"block_sparse": None},  # BlockSparseSpec's values are checked by the spec itself
)


__getattr__ = backend_module_getattr(__name__)
