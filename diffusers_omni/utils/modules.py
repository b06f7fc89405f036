"""Small questions about ``torch.nn`` modules and the objects that hold them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def get_submodule_path(root: Any, path: str) -> Any:
    """Follow a dotted attribute path (``"transformer"``, ``"text_encoder.encoder"``); ``None`` if absent."""
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def model_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the first floating-point parameter of ``model`` (``None`` when it has none)."""
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return None
