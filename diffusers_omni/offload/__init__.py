"""CPU offload strategies: model-level (whole DiTs/encoders take turns) and layerwise (blocks stream)."""

from .api import apply_offload as apply_offload
from .api import disable_offload as disable_offload
from .base import OffloadBackend as OffloadBackend
from .discovery import OffloadConflictError as OffloadConflictError
from .factory import get_offload_backend as get_offload_backend
from .guards import OffloadActiveError as OffloadActiveError
