"""Shared builders and probes for the offload tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from diffusers import FluxTransformer2DModel, WanTransformer3DModel

from diffusers_omni.offload.hooks import hook_names
from diffusers_omni.pipelines.flux import OmniFluxPipeline
from diffusers_omni.pipelines.wan import OmniWanPipeline
from diffusers_omni.testing.tiny import tiny_flux_pipeline, tiny_wan_components

FLUX_CALL = {"height": 32, "width": 32}
WAN_CALL = {"height": 32, "width": 32, "num_frames": 5}


def flux_pipe() -> OmniFluxPipeline:
    return tiny_flux_pipeline(pipeline_cls=OmniFluxPipeline)


def wan22_pipe() -> OmniWanPipeline:
    """Tiny Wan 2.2-style pipeline with two experts (high-noise ``transformer``, low-noise ``transformer_2``)."""
    components = tiny_wan_components(seed=0)
    second = tiny_wan_components(seed=1)["transformer"]
    return OmniWanPipeline(**{**components, "transformer_2": second}, boundary_ratio=0.5)


def generate(pipe: Any, steps: int = 3, **call: Any) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    kwargs = FLUX_CALL if isinstance(pipe, OmniFluxPipeline) else WAN_CALL
    output = pipe(
        prompt="a red fox in the snow",
        num_inference_steps=steps,
        generator=generator,
        output_type="latent",
        max_sequence_length=32,
        **{**kwargs, **call},
    )
    return output[0]


def bare_flux(num_layers: int = 3, num_single_layers: int = 4) -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    ).eval()


def flux_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([3.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
        "return_dict": False,
    }


def bare_wan() -> WanTransformer3DModel:
    return tiny_wan_components(seed=0)["transformer"]


def block_bytes(block: nn.Module) -> int:
    """Bytes materialised in a block's own parameters and buffers."""
    tensors = list(block.parameters()) + [b for b in block.buffers() if b is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def snapshot(*modules: nn.Module) -> dict[str, Any]:
    """Every tensor's id, device, dtype and values, plus every hook name, under ``modules``."""
    state: dict[str, Any] = {}
    for index, module in enumerate(modules):
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            state[f"{index}.{name}"] = (id(tensor), tensor.device, tensor.dtype, tensor.detach().clone())
        for name, sub in module.named_modules():
            state[f"{index}.{name}#hooks"] = hook_names(sub)
            state[f"{index}.{name}#registry"] = "_diffusers_hook" in sub.__dict__
    return state


def assert_same_snapshot(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        other = after[key]
        if isinstance(value, tuple) and len(value) == 4:
            assert value[:3] == other[:3], key
            assert torch.equal(value[3], other[3]), key
        else:
            assert value == other, key


def pipeline_modules(pipe: Any) -> list[nn.Module]:
    return [m for m in pipe.components.values() if isinstance(m, nn.Module)]


def file_mappings() -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of every file-backed mapping of this process (Linux ``/proc/self/maps``)."""
    mappings = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mappings.append((start, end, fields[5].strip()))
    return mappings


def mapped_file(tensor: torch.Tensor, mappings=None) -> str | None:
    """The file whose mapping holds ``tensor``'s bytes (a zero-copy view of it), or ``None`` (anonymous memory)."""
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    for start, stop, path in mappings if mappings is not None else file_mappings():
        if start <= begin and end <= stop:
            return path
    return None
