"""Tiny FLUX and Wan transformers quantized with torchao (int8 / float8 weight-only) or loaded from a GGUF file
through ``from_single_file``, and probes of what offload does to their weights."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig, WanTransformer3DModel

from diffusers_omni.testing import tiny_flux_inputs
from diffusers_omni.testing.quantized import bnb_quantize_, write_gguf_checkpoint

FORMATS = ("torchao-int8", "torchao-float8", "gguf", "bnb-nf4", "bnb-int8")
MODELS = ("flux", "wan")


def _flux() -> FluxTransformer2DModel:
    # attention_head_dim 32 × 2 heads: the feed-forward down-projections have 256 columns, so GGUF gets Q4_K too.
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(8, 12, 12),
    ).eval()


def _wan() -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=256, num_layers=4, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()


def inputs(model_name: str, seed: int) -> dict[str, Any]:
    if model_name == "flux":
        return {**tiny_flux_inputs(seed), "return_dict": False}
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 16, 2, 8, 8, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
        "return_dict": False,
    }


def unquantized(model_name: str) -> nn.Module:
    """The tiny ``model_name`` transformer ``quantized`` starts from (seeded: the same weights every call)."""
    return _flux() if model_name == "flux" else _wan()


def quantized(model_name: str, fmt: str, folder: str | Path | None = None) -> nn.Module:
    """A tiny ``model_name`` transformer in format ``fmt`` (GGUF: written to ``folder`` and read back)."""
    model = unquantized(model_name)
    if fmt.startswith("torchao"):
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig() if fmt == "torchao-int8" else Float8WeightOnlyConfig())
        return model.eval()
    if fmt.startswith("bnb"):
        # bitsandbytes' CPU kernels repack 4-bit weights on the first eval forward and need both dimensions to be
        # multiples of 64; the embedders and the output projection stay unquantized here.
        bnb_quantize_(model, bits=4 if fmt == "bnb-nf4" else 8, compute_dtype=torch.float32,
                      skip=lambda name, layer: bool(layer.in_features % 64 or layer.out_features % 64))
        return model.eval()
    if fmt != "gguf":
        raise ValueError(f"fmt={fmt!r}; allowed: {FORMATS}")
    folder = Path(folder or tempfile.mkdtemp())
    model.save_config(folder)
    path = folder / f"{model_name}.gguf"
    write_gguf_checkpoint(model, path, prefer="Q4_K")
    loaded = type(model).from_single_file(
        str(path), config=str(folder), torch_dtype=torch.float32,
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
    )
    return loaded.eval()


def run(model: nn.Module, model_name: str, seeds=(0, 1, 2)) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(**inputs(model_name, seed))[0] for seed in seeds]


def weight_kinds(model: nn.Module) -> set[str]:
    return {type(p).__name__ for p in model.parameters()} - {"Parameter", "Tensor"}


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(getattr(m, "weight", None)).__name__ != "Parameter"
            and isinstance(getattr(m, "weight", None), torch.Tensor)]


def packed_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the plain tensors holding a weight (inner tensors of a wrapper subclass)."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(packed_nbytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()


def inner_values(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the plain tensors holding a weight's bytes, for exact comparisons."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return [v for n in names for v in inner_values(getattr(tensor, n))]
    with torch._C.DisableTorchFunctionSubclass():
        return [tensor.data.clone()]


def weights_state(model: nn.Module) -> dict[str, tuple]:
    """Per parameter and buffer: the object, its class, requires_grad, non-tensor attributes and byte values."""
    state = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        attrs = {k: v for k, v in vars(tensor).items() if not isinstance(v, torch.Tensor)}
        state[name] = (tensor, type(tensor), tensor.requires_grad, attrs, inner_values(tensor))
    return state


def assert_same_weights(before: dict[str, tuple], model: nn.Module) -> None:
    after = weights_state(model)
    assert before.keys() == after.keys()
    for name, (obj, cls, grad, attrs, values) in before.items():
        o2, c2, g2, a2, v2 = after[name]
        assert o2 is obj and c2 is cls and g2 == grad, name
        assert a2.keys() == attrs.keys() and all(a2[k] is attrs[k] or a2[k] == attrs[k] for k in attrs), name
        assert len(values) == len(v2) and all(same_bytes(a, b) for a, b in zip(values, v2)), name


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def capture_during_forward(model: nn.Module, names: list[str]) -> tuple[dict[str, list], Callable[[], None]]:
    """Record, when each named module runs, its weight object's id and class and its byte count."""
    seen: dict[str, list] = {n: [] for n in names}
    handles = []
    modules = dict(model.named_modules())
    for name in names:
        def hook(module, args, name=name):
            w = module.weight
            seen[name].append((id(w), type(w), packed_nbytes(w), getattr(w, "marker", None)))
        handles.append(modules[name].register_forward_pre_hook(hook))
    return seen, lambda: [h.remove() for h in handles]


class OpaqueTensor(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper subclass without ``__tensor_flatten__``: nothing tells offload which tensors
    hold its bytes, so every strategy must refuse it."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(t):
            return t.inner if isinstance(t, OpaqueTensor) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def make_opaque(model: nn.Module, module_name: str) -> nn.Module:
    """Replace ``module_name``'s weight by an ``OpaqueTensor`` of the same shape."""
    module = model.get_submodule(module_name)
    module._parameters["weight"] = OpaqueTensor(torch.randn(module.weight.shape))
    return module


def distributed_parity(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Every format × model under distributed layerwise offload (AllGather and not): bitwise equal to resident,
    packed bytes sharded, the same weight objects after disable; and a rank holding an unstreamable weight makes
    every rank refuse with nothing changed."""
    from diffusers_omni import OffloadConfig, apply_offload
    from diffusers_omni.offload.tensors import UnsupportedTensorError

    results: dict[str, Any] = {}
    for fmt in FORMATS:
        for model_name in MODELS:
            for allgather in (True, False):
                model = quantized(model_name, fmt, Path(folder) / f"{fmt}-{model_name}-{rank}")
                reference = run(model, model_name)
                before = weights_state(model)
                backend = apply_offload(model, OffloadConfig("distributed_layerwise", device="cpu",
                                                             use_allgather=allgather))
                out = run(model, model_name)
                stats = backend.stats
                backend.disable()
                try:
                    assert_same_weights(before, model)
                    same = True
                except AssertionError:
                    same = False
                results[f"{fmt}/{model_name}/{allgather}"] = {
                    "equal": all(torch.equal(a, b) for a, b in zip(reference, out)),
                    "equal_after": all(torch.equal(a, b) for a, b in zip(reference, run(model, model_name))),
                    "same_weights": same,
                    "host_bytes": stats.host_bytes,
                    "streamed": stats.streamed_bytes_per_pass,
                    "on_demand": stats.on_demand_loads,
                }
    model = quantized("flux", "torchao-int8")
    if rank == world - 1:
        make_opaque(model, "transformer_blocks.1.ff.net.2")
    before = {n: (id(p), type(p)) for n, p in model.named_parameters()}
    try:
        apply_offload(model, OffloadConfig("distributed_layerwise", device="cpu"))
        refusal = None
    except (UnsupportedTensorError, RuntimeError) as error:
        refusal = f"{type(error).__name__}: {error}"
    results["refusal"] = refusal
    results["refusal_unchanged"] = before == {n: (id(p), type(p)) for n, p in model.named_parameters()}
    return results
