"""Quantized weights for tests and benchmarks: GGUF blocks built in torch (on any device), GGUF files written with
the ``gguf`` package, and models whose ``nn.Linear`` layers become Diffusers ``GGUFLinear`` layers.

GGUF ``Q8_0`` blocks are quantized exactly as gguf-py (and ggml) do: 32 values, an fp16 scale ``amax / 127`` and
int8 values rounded half away from zero (``q8_0_blocks`` on a GPU is byte-identical to ``gguf.quants.quantize``; a
test checks it). gguf-py has no ``Q4_K`` quantizer, so ``q4_k_random_blocks`` builds *random valid* blocks (fp16
super-block scale and min drawn small, random 6-bit sub-scales and 4-bit values): the bytes and kernels are those
of a real ``Q4_K`` checkpoint, the values are not a quantization of anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

Q8_0_BLOCK, Q8_0_BYTES = 32, 34
Q4_K_BLOCK, Q4_K_BYTES = 256, 144


def q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (rows × cols, cols a multiple of 32) as GGUF ``Q8_0`` bytes, rows × (cols / 32 · 34) ``uint8``."""
    rows, cols = weight.shape
    if cols % Q8_0_BLOCK:
        raise ValueError(f"Q8_0 needs a multiple of {Q8_0_BLOCK} columns; got {cols}")
    blocks = weight.detach().float().reshape(-1, Q8_0_BLOCK)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    qs = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # ggml's roundf: half away from zero
    out = torch.cat([d.half().view(torch.uint8), qs.to(torch.int8).view(torch.uint8)], dim=1)
    return out.reshape(rows, cols // Q8_0_BLOCK * Q8_0_BYTES)


def q4_k_random_blocks(rows: int, cols: int, generator: torch.Generator | None = None,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """Random valid GGUF ``Q4_K`` bytes for a rows × cols weight (cols a multiple of 256)."""
    if cols % Q4_K_BLOCK:
        raise ValueError(f"Q4_K needs a multiple of {Q4_K_BLOCK} columns; got {cols}")
    count = rows * cols // Q4_K_BLOCK
    scale = (torch.rand(count, 2, generator=generator, device=device) * 2e-4 + 1e-4).half().view(torch.uint8)
    rest = torch.randint(0, 256, (count, Q4_K_BYTES - 4), generator=generator, device=device, dtype=torch.uint8)
    return torch.cat([scale.reshape(count, 4), rest], dim=1).reshape(rows, cols // Q4_K_BLOCK * Q4_K_BYTES)


def default_gguf_type(name: str, weight: torch.Tensor, prefer: str = "Q8_0") -> str | None:
    """The GGUF type a 2-D linear weight gets: ``prefer`` when its columns allow it, else ``Q8_0`` when they
    allow that, else ``None`` (kept unquantized, as GGUF files keep odd-sized and 1-D tensors)."""
    if weight.dim() != 2:
        return None
    cols = weight.shape[1]
    if prefer == "Q4_K" and cols % Q4_K_BLOCK == 0:
        return "Q4_K"
    return "Q8_0" if cols % Q8_0_BLOCK == 0 else None


def gguf_bytes(name: str, weight: torch.Tensor, quant: str, generator: torch.Generator | None = None) -> torch.Tensor:
    if quant == "Q8_0":
        return q8_0_blocks(weight)
    if quant == "Q4_K":
        return q4_k_random_blocks(*weight.shape, generator=generator, device=weight.device)
    raise ValueError(f"quant={quant!r} is not supported here; allowed: 'Q8_0', 'Q4_K'")


def write_gguf_checkpoint(model: nn.Module, path: str | Path, prefer: str = "Q8_0",
                          choose: Callable[[str, torch.Tensor, str], str | None] = default_gguf_type,
                          seed: int = 0) -> dict[str, str]:
    """Write ``model``'s state dict (Diffusers key names) to a GGUF file with the ``gguf`` package: linear weights
    as ``Q8_0``/``Q4_K`` blocks (``choose``), everything else as F32. Returns ``{name: type}`` of what was
    quantized. Load it with ``Model.from_single_file(path, config=<folder with config.json>,
    quantization_config=GGUFQuantizationConfig(compute_dtype=...))``."""
    import gguf

    generator = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(str(path), arch="diffusers-omni-test")
    linear_weights = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen: dict[str, str] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float().cpu()
        quant = choose(name, tensor, prefer) if name in linear_weights else None
        if quant is None:
            writer.add_tensor(name, tensor.numpy())
            continue
        data = gguf_bytes(name, tensor, quant, generator)
        writer.add_tensor(name, data.numpy(), raw_dtype=gguf.GGMLQuantizationType[quant])
        chosen[name] = quant
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return chosen


def gguf_quantize_(model: nn.Module, prefer: str = "Q8_0", compute_dtype: torch.dtype = torch.bfloat16,
                   choose: Callable[[str, torch.Tensor, str], str | None] = default_gguf_type,
                   seed: int = 0) -> dict[str, str]:
    """Replace ``model``'s ``nn.Linear`` layers in place by Diffusers ``GGUFLinear`` layers holding
    ``GGUFParameter`` weights built on the weights' device (what ``from_single_file`` with a GGUF file produces,
    without a file). Returns ``{name: type}`` of the quantized weights."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    chosen: dict[str, str] = {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            name = f"{parent_name}.{child_name}.weight" if parent_name else f"{child_name}.weight"
            if _kept_in_fp32(model, name):
                continue
            quant = choose(name, child.weight, prefer)
            if quant is None:
                continue
            device = child.weight.device
            generator = torch.Generator(device=device).manual_seed(seed + len(chosen))
            data = gguf_bytes(name, child.weight, quant, generator)
            layer = GGUFLinear(child.in_features, child.out_features, child.bias is not None,
                               compute_dtype=compute_dtype, device=device)
            layer.weight = GGUFParameter(data, quant_type=gguf.GGMLQuantizationType[quant])
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
            layer.source_cls = nn.Linear
            layer.requires_grad_(False)
            setattr(parent, child_name, layer)
            chosen[name] = quant
    return chosen


def _kept_in_fp32(model: nn.Module, name: str) -> bool:
    """Diffusers' quantizers leave ``_keep_in_fp32_modules`` (e.g. Wan's ``time_embedder``) unquantized."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    return any(part in keep for part in name.split("."))


def bnb_quantize_(model: nn.Module, bits: int = 4, quant_type: str = "nf4", double_quant: bool = True,
                  compute_dtype: torch.dtype = torch.bfloat16,
                  skip: Callable[[str, nn.Linear], bool] = lambda name, layer: False) -> int:
    """Replace ``model``'s ``nn.Linear`` layers in place by bitsandbytes ``Linear4bit`` (``quant_type``, double
    quantization of the absmax with ``double_quant``) or ``Linear8bitLt`` layers, quantized on the weights' device
    (what Diffusers' ``BitsAndBytesConfig`` loading produces). Returns the number of layers replaced."""
    import bitsandbytes as bnb

    count = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is not nn.Linear or skip(name, child) or _kept_in_fp32(model, name):
                continue
            device = child.weight.device
            weight = child.weight.detach()
            if bits == 4:
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, child.bias is not None,
                                          compute_dtype=compute_dtype, compress_statistics=double_quant,
                                          quant_type=quant_type, device="meta")
                layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=quant_type,
                                                 compress_statistics=double_quant, module=layer)._quantize(device)
            elif bits == 8:
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, child.bias is not None,
                                            has_fp16_weights=False, threshold=0.0, device="meta")
                layer.weight = bnb.nn.Int8Params(weight.to(torch.float16), requires_grad=False,
                                                 has_fp16_weights=False)._quantize(device)
            else:
                raise ValueError(f"bits={bits!r}; allowed: 4, 8")
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
            setattr(parent, child_name, layer.train(child.training))
            count += 1
    return count
