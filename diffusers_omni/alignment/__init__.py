"""Training/rollout alignment: record transformer inputs, replay them under two configurations, compare per layer,
and fingerprint the attention kernels of each role.

See ``docs/user_guide/alignment.md``.
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
from .record import RecordedInputs as RecordedInputs, record_transformer_inputs as record_transformer_inputs

__all__ = [
    "STOCK",
    "AlignmentReport",
    "AlignmentSide",
    "FingerprintComparison",
    "LayerComparison",
    "LayerOutputs",
    "RecordedInputs",
    "RoleComparison",
    "capture_layers",
    "check_alignment",
    "compare_fingerprints",
    "compare_layer_outputs",
    "environment",
    "kernel_fingerprint",
    "load_fingerprint",
    "record_transformer_inputs",
    "save_fingerprint",
]
