"""Training/rollout alignment: record transformer inputs, replay them under two configurations, compare per layer,
and fingerprint the attention kernels of each role; and the quality of a lossy configuration on a whole generation
(``compare_pipelines``: side-by-side image, PSNR, SSIM, per-layer attention error).

See ``docs/user_guide/alignment.md`` and ``docs/user_guide/quality.md``.
"""

from .compare import (
    STOCK as STOCK,
    AlignmentReport as AlignmentReport,
    AlignmentSide as AlignmentSide,
    LayerComparison as LayerComparison,
    LayerOutputs as LayerOutputs,
    capture_layers as capture_layers,
    check_alignment as check_alignment,
    compare_layer_outputs as compare_layer_outputs,
)
from .fingerprint import (
    FingerprintComparison as FingerprintComparison,
    RoleComparison as RoleComparison,
    compare_fingerprints as compare_fingerprints,
    environment as environment,
    kernel_fingerprint as kernel_fingerprint,
    load_fingerprint as load_fingerprint,
    save_fingerprint as save_fingerprint,
)
from .quality import (
    AttentionLayerError as AttentionLayerError,
    QualityReport as QualityReport,
    TransformerCallReport as TransformerCallReport,
    compare_pipelines as compare_pipelines,
    compare_transformer_call as compare_transformer_call,
    psnr as psnr,
    ssim as ssim,
)
from .record import RecordedInputs as RecordedInputs, record_transformer_inputs as record_transformer_inputs

__all__ = [
    "STOCK",
    "AlignmentReport",
    "AlignmentSide",
    "AttentionLayerError",
    "FingerprintComparison",
    "LayerComparison",
    "LayerOutputs",
    "QualityReport",
    "RecordedInputs",
    "RoleComparison",
    "TransformerCallReport",
    "capture_layers",
    "check_alignment",
    "compare_fingerprints",
    "compare_layer_outputs",
    "compare_pipelines",
    "compare_transformer_call",
    "environment",
    "kernel_fingerprint",
    "load_fingerprint",
    "psnr",
    "record_transformer_inputs",
    "save_fingerprint",
    "ssim",
]
