"""Our ``BagelModel`` at the published BAGEL-7B-MoT config has exactly the reference's parameter names and shapes
(``data/bagel_7b_mot_manifest.json``, made from the reference implementation; see ``data/README.md``)."""

from __future__ import annotations

import json

import torch

from diffusers_omni.architectures.bagel import BagelModel, Qwen2MoTModel

from .bagel_helpers import MANIFEST


def _shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    return {name: list(tensor.shape) for name, tensor in module.state_dict().items()}


def test_published_config_has_the_checkpoints_names_and_shapes():
    manifest = json.loads(MANIFEST.read_text())
    with torch.device("meta"):
        model = BagelModel()
    ours = _shapes(model)
    assert sorted(set(manifest) - set(ours)) == []
    assert sorted(set(ours) - set(manifest)) == []
    assert {name: shape for name, shape in ours.items() if manifest[name] != shape} == {}
    assert sum(tensor.numel() for tensor in model.state_dict().values()) == 14_607_260_128


def test_backbone_is_the_language_models_model_with_layerwise_blocks():
    with torch.device("meta"):
        model = BagelModel()
    assert isinstance(model.language_model.model, Qwen2MoTModel)
    assert model.backbone is model.language_model.model
    assert Qwen2MoTModel._layerwise_offload_blocks_attrs == ("layers",)
    assert len(model.backbone.layers) == 28
    manifest = json.loads(MANIFEST.read_text())
    prefix = "language_model.model."
    assert _shapes(model.backbone) == {k[len(prefix):]: v for k, v in manifest.items() if k.startswith(prefix)}
