"""Build a Diffusers transformer whose weights are mmap views of its safetensors checkpoint.

Every rank of a distributed layerwise run maps the same files, so the checkpoint sits once in the OS page cache
instead of once per rank in anonymous memory; the AllGather backend then copies only the rank's 1/N slice of each
block into pinned memory and drops the views. Steps:

1. read and validate every safetensors header (single file or a sharded ``*.safetensors.index.json``) before
   anything is built: a corrupt or truncated file raises ``CheckpointError`` and nothing is half-loaded;
2. build the model from its config with parameters on the meta device and buffers real
   (``accelerate.init_empty_weights(include_buffers=False)``), so non-persistent buffers such as RoPE frequency
   tables are computed exactly as a normal construction computes them;
3. map each file once (``torch.from_file``, a private mapping: pages are shared through the page cache until
   written) and assign zero-copy views to the parameters and persistent buffers (``load_state_dict(assign=True)``);
4. apply ``torch_dtype`` as ``from_pretrained`` does (floating tensors converted, ``_keep_in_fp32_modules`` kept in
   float32). A tensor already in its target dtype stays a view; a converted one is a private host copy, so save the
   checkpoint in the dtype you run to keep host RSS at model ÷ N.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

logger = logging.getLogger("diffusers_omni")

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)

_MAX_HEADER = 100 * 2**20


class CheckpointError(ValueError):
    """A safetensors checkpoint that cannot be mapped (missing, truncated, corrupt, or not matching the model)."""


def read_safetensors_header(path: str | os.PathLike) -> tuple[int, dict[str, dict[str, Any]]]:
    """``(data_start, {name: {"dtype", "shape", "data_offsets"}})`` of one safetensors file, fully validated."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            length = int.from_bytes(prefix, "little")
            if length > _MAX_HEADER or 8 + length > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors file (header of {length} bytes, file of {size})"
                )
            raw = handle.read(length)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read safetensors file ({error})") from error
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: corrupt safetensors header ({error})") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_start = 8 + length
    data_size = size - data_start
    for name, info in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: corrupt entry for {name!r} ({info!r}): {error!r}") from error
        expected = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if not 0 <= begin <= end or end - begin != expected:
            raise CheckpointError(f"{path}: corrupt entry for {name!r}: offsets {begin}..{end} for {expected} bytes")
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: {name!r} ends at byte {data_start + end}, file has {size}"
            )
    return data_start, header


def mmap_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file as a zero-copy view of a private mapping of the file."""
    data_start, header = read_safetensors_header(path)
    size = Path(path).stat().st_size
    if not header:
        return {}
    mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    tensors = {}
    for name, info in header.items():
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        raw = mapped[data_start + begin : data_start + end]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if (data_start + begin) % itemsize:
            raw = raw.clone()  # misaligned for this dtype (not written by safetensors): a private copy
        tensors[name] = raw.view(dtype).view(info["shape"])
    return tensors


def checkpoint_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of a Diffusers model folder: the shards named by an index, else the single file."""
    directory = Path(directory)
    if directory.is_file():
        return [directory]
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{indexes[0]}: not a safetensors index ({error!r})") from error
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{indexes[0]} names shards that do not exist: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors file or *.safetensors.index.json found")
    if len(files) > 1:
        raise CheckpointError(f"{directory}: several *.safetensors files {[f.name for f in files]} and no index")
    return files


def load_transformer_mmap(
    model_cls: type,
    path: str | os.PathLike,
    subfolder: str | None = None,
    torch_dtype: torch.dtype | None = None,
) -> nn.Module:
    """A Diffusers model (``model_cls``, e.g. ``FluxTransformer2DModel``) built from the config in ``path`` (or
    ``path/subfolder``) with its weights as mmap views of the checkpoint's safetensors files.

    Args:
        model_cls: a Diffusers ``ModelMixin`` subclass.
        path: a local model folder (``save_pretrained`` output) or pipeline folder with ``subfolder``.
        subfolder: e.g. ``"transformer"`` inside a pipeline folder.
        torch_dtype: convert floating weights as ``from_pretrained(torch_dtype=...)`` does.

    Example:
    ```py
    >>> transformer = load_transformer_mmap(FluxTransformer2DModel, "/models/flux-dev", "transformer", torch.bfloat16)
    >>> pipe = OmniFluxPipeline.from_pretrained("/models/flux-dev", transformer=transformer, torch_dtype=torch.bfloat16)
    >>> pipe.enable_distributed_layerwise_offload()
    ```
    """
    from accelerate import init_empty_weights

    directory = Path(path) / subfolder if subfolder else Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a model folder (expected config.json and *.safetensors)")
    files = checkpoint_files(directory)
    for file in files:  # validate everything before building or mapping anything
        read_safetensors_header(file)
    config = model_cls.load_config(directory)
    with init_empty_weights(include_buffers=False):
        model = model_cls.from_config(config)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(mmap_safetensors(file))
    expected = set(model.state_dict().keys())
    missing = sorted(expected - state.keys())
    if missing:
        raise CheckpointError(
            f"{directory}: checkpoint lacks {len(missing)} tensors of {model_cls.__name__} (e.g. {missing[:3]})"
        )
    unexpected = sorted(state.keys() - expected)
    if unexpected:
        logger.warning("%s: ignoring %d checkpoint tensors %s not in %s", directory, len(unexpected),
                       unexpected[:3], model_cls.__name__)
    for name in expected:
        wanted = _target_dtype(model, name, state[name].dtype, torch_dtype)
        if wanted != state[name].dtype:
            state[name] = state[name].to(wanted)
    model.load_state_dict({k: state[k] for k in expected}, strict=True, assign=True)
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise CheckpointError(f"{directory}: tensors left unloaded on the meta device: {meta[:3]}")
    if torch_dtype is not None:
        _convert_buffers(model, torch_dtype)
    return model.eval()


def _target_dtype(model: nn.Module, name: str, dtype: torch.dtype, torch_dtype: torch.dtype | None) -> torch.dtype:
    if torch_dtype is None or not dtype.is_floating_point or dtype.itemsize == 1:
        return dtype
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    if any(re.search(rf"(^|\.){re.escape(k)}(\.|$)", name) for k in keep):
        return torch.float32
    return torch_dtype


def _convert_buffers(model: nn.Module, torch_dtype: torch.dtype) -> None:
    """Non-persistent floating buffers follow ``torch_dtype`` as ``from_pretrained``'s ``model.to(dtype)`` does."""
    persistent = set(model.state_dict().keys())
    for name, buffer in list(model.named_buffers()):
        if name in persistent or buffer is None or not buffer.dtype.is_floating_point:
            continue
        wanted = _target_dtype(model, name, buffer.dtype, torch_dtype)
        if buffer.dtype != wanted:
            buffer.data = buffer.data.to(wanted)
