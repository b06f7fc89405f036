"""Shared by the BAGEL tests: the deterministic weights the golden tensors were made with."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = DATA / "bagel_golden.safetensors"
MANIFEST = DATA / "bagel_7b_mot_manifest.json"


def fill_golden_weights(model: torch.nn.Module) -> None:
    """Every state-dict tensor becomes ``randn(shape) * 0.2`` (``+ 1`` for norm weights) from a generator seeded
    with ``zlib.crc32(name)``: the weights ``golden_gen_bagel.py`` gave the reference model."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            value = torch.randn(tensor.shape, generator=generator) * 0.2
            if "norm" in name and name.endswith("weight"):
                value += 1.0
            tensor.copy_(value)
