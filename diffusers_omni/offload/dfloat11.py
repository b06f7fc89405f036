"""Reading DFloat11 checkpoints (arXiv 2504.11651; PyPI ``dfloat11``): their bfloat16 weights decoded bit for bit.

A DFloat11 checkpoint stores the model's bfloat16 weights unit by unit (a unit is a module whose name matches one of
``dfloat11_config.pattern_dict``'s patterns in the checkpoint's ``config.json``: a ``Linear`` or ``Embedding``, or a
block whose listed sub-modules' weights are coded together, in the listed order). Per unit, six tensors:

- ``encoded_exponent``: the exponent bytes as one Huffman-coded bit stream (most significant bit first);
- ``sign_mantissa``: one byte per weight, its sign bit (``0x80``) and 7 mantissa bits, as they are;
- ``luts``: the decoding tables, one row of 256 per code prefix: a row maps the next 8 bits either to an exponent
  (< 240) or to the row to read the following 8 bits in (``256 - value``, at most four rows deep); the last row holds
  each exponent's code length;
- ``gaps``: 5 bits per 8-byte chunk of the stream, packed most significant bit first: where in that chunk the first
  code starting there starts (each chunk decodes the codes that start in it, as DFloat11's CUDA threads do);
- ``output_positions``: where each block of ``threads_per_block`` chunks (512: 4096 bytes of stream) starts in the
  output (``uint32`` as bytes): the GPU kernel's blocks write from there; the tensor-operation decoder does not need
  them (its chunks decode in stream order);
- ``split_positions``: where each weight of the unit ends in the concatenated output.

The other tensors (biases, norms, anything not coded) are stored under their own names. ``decode_unit`` decodes one
unit, with ``offload.dfloat11_kernel`` (Triton, one launch per unit) on a CUDA GPU, else with tensor operations,
every chunk at once, on any device; ``load_dfloat11`` fills a model (built from its Diffusers config, on the meta
device or not) from such a checkpoint, checking that every tensor of the model is given exactly once, and records
where each tensor came from (``checkpoint_of``): under ``max_host_memory`` the offload reads the blocks it keeps off
the host from the checkpoint again, as DFloat11's code, and decodes them on the device (``stores.dfloat11_file``).
This goes beyond the contract this package follows (vLLM-Omni's docs do not read DFloat11).
"""

from __future__ import annotations

import json
import os
import re
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from . import dfloat11_kernel
from .coded_cache import tensor_digests
from .disk import TensorEntry, safetensors_entries

UNIT_TENSORS = ("encoded_exponent", "sign_mantissa", "luts", "output_positions", "gaps", "split_positions")
POINTER = 240  # a table value at or above this points to another row (256 - value)
MAX_DEPTH = 4  # a code is at most 32 bits: four rows of 8


class DFloat11Error(ValueError):
    """A DFloat11 checkpoint this reader cannot take (what is wrong, and where, in the message)."""


@dataclass
class DFloat11Record:
    """Where a model loaded by ``load_dfloat11`` came from, so an offload can read its blocks' code from the
    checkpoint again (``stores.dfloat11_file``): each unit's coded tensors and each other tensor as entries of the
    checkpoint's files, which unit (and which weight of it) each coded weight is, a SHA-256 of every tensor as it
    was loaded (a weight changed since, by a fused LoRA say, no longer matches its code) and each file's identity
    (inode, size, modification time) then."""

    folder: Path
    bytes_per_thread: int
    threads_per_block: int
    units: dict[str, dict[str, TensorEntry]]  # unit (module name) → its tensors (``UNIT_TENSORS``)
    coded: dict[str, tuple[str, int]]  # weight name → (its unit, its index among the unit's weights)
    plain: dict[str, TensorEntry]  # every tensor that is not coded, as stored
    digests: dict[str, bytes]  # tensor name → SHA-256 of its bytes as loaded
    identities: dict[Path, tuple[int, int, int] | None]

    def unchanged_files(self) -> bool:
        """Whether every file of the checkpoint is still the one read at load."""
        return all(file_identity(path) == identity for path, identity in self.identities.items())


_RECORDS: "weakref.WeakKeyDictionary[nn.Module, DFloat11Record]" = weakref.WeakKeyDictionary()


def checkpoint_of(model: nn.Module) -> DFloat11Record | None:
    """The DFloat11 checkpoint ``model`` was loaded from by ``load_dfloat11`` (``None``: it was not)."""
    return _RECORDS.get(model)


def file_identity(path: Path) -> tuple[int, int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns


def _bits(stream: torch.Tensor, position: torch.Tensor, width: int) -> torch.Tensor:
    """``width`` (<= 32) bits of ``stream`` (uint8, padded) starting at bit ``position`` (int64), as int64."""
    byte, shift = position // 8, position % 8
    window = torch.zeros_like(position)
    for k in range(5):  # 40 bits hold any 32 starting anywhere in a byte
        window = (window << 8) | stream[byte + k].to(torch.int64)
    return (window >> (40 - shift - width)) & ((1 << width) - 1)


def decode_exponents(encoded: torch.Tensor, gaps: torch.Tensor, luts: torch.Tensor, n_elements: int,
                     bytes_per_thread: int = 8) -> torch.Tensor:
    """The ``n_elements`` exponent bytes (uint8) of a unit's Huffman-coded ``encoded`` stream. Every chunk of
    ``bytes_per_thread`` bytes decodes at once: step by step, each chunk decodes its next code while that code starts
    inside the chunk; the codes of chunk ``c`` come before those of ``c + 1``."""
    if bytes_per_thread != 8:
        raise DFloat11Error(f"bytes_per_thread={bytes_per_thread!r} is not supported; allowed: 8 (what DFloat11's "
                            "kernel decodes)")
    device = encoded.device
    chunk_bits = 8 * bytes_per_thread
    chunks = -(-encoded.numel() // bytes_per_thread)
    if n_elements == 0 or chunks == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    stream = torch.cat([encoded.to(torch.uint8).flatten(), torch.zeros(bytes_per_thread + 8, dtype=torch.uint8,
                                                                       device=device)])
    packed = torch.cat([gaps.to(torch.uint8).flatten(), torch.zeros(8, dtype=torch.uint8, device=device)])
    starts = torch.arange(chunks, device=device, dtype=torch.int64)
    if gaps.numel() * 8 < 5 * chunks:
        raise DFloat11Error(f"gaps holds {gaps.numel() * 8} bits; the stream's {chunks} chunks need {5 * chunks}")
    gap = _bits(packed, starts * 5, 5)
    tables = luts.to(torch.int64).reshape(-1, 256)
    lengths = tables[-1]
    # The 12 bytes a chunk's codes can read (a code starts in the chunk's 8 and is at most 32 bits long) as three
    # 32-bit words, so each step shifts them instead of gathering from the stream.
    spans = stream[(starts * bytes_per_thread).unsqueeze(1) + torch.arange(12, device=device)].to(torch.int64)
    words = [(spans[:, 4 * k] << 24) | (spans[:, 4 * k + 1] << 16) | (spans[:, 4 * k + 2] << 8) | spans[:, 4 * k + 3]
             for k in range(3)]
    del spans
    offset = gap  # where each chunk's next code starts, in bits from the chunk's start
    symbols, valid = [], []
    active = offset < chunk_bits
    while bool(active.any()):
        second = offset >= 32
        shift = torch.where(second, offset - 32, offset)
        high = torch.where(second, words[1], words[0])
        low = torch.where(second, words[2], words[1])
        window = ((high << shift) & 0xFFFFFFFF) | (low >> (32 - shift))
        value = tables[0][window >> 24]
        for depth in range(1, MAX_DEPTH):
            pointer = value >= POINTER
            row = torch.where(pointer, 256 - value, 0).clamp(max=tables.shape[0] - 2)
            value = torch.where(pointer, tables[row, (window >> (24 - 8 * depth)) & 0xFF], value)
        symbols.append(value.to(torch.uint8))
        valid.append(active)
        offset = torch.where(active, offset + lengths[value], offset)  # table values are bytes
        active = active & (offset < chunk_bits)
    decoded = torch.stack(symbols, dim=1)[torch.stack(valid, dim=1)]  # chunk-major: the stream's order
    if decoded.numel() < n_elements:
        raise DFloat11Error(f"the stream decodes to {decoded.numel()} exponents; the unit has {n_elements} weights")
    return decoded[:n_elements]


def kernel_name(device: torch.device) -> str:
    """Which decoder ``decode_words`` uses on ``device`` (for the report)."""
    return "our Triton kernel (offload.dfloat11_kernel)" if dfloat11_kernel.available(device) else "tensor operations"


def kernel_serves(tensors: dict[str, torch.Tensor], bytes_per_thread: int, threads_per_block: int) -> bool:
    """Whether ``dfloat11_kernel`` decodes this unit: Triton on its device, DFloat11's chunk size, a power-of-two
    block, an output position for every block and a gap for every chunk."""
    device = tensors["encoded_exponent"].device
    if not dfloat11_kernel.available(device) or bytes_per_thread != dfloat11_kernel.CHUNK_BYTES:
        return False
    if threads_per_block <= 0 or threads_per_block & (threads_per_block - 1):
        return False
    chunks = -(-tensors["encoded_exponent"].numel() // bytes_per_thread)
    positions = tensors["output_positions"]
    return (positions.numel() % 4 == 0 and positions.numel() // 4 >= -(-chunks // threads_per_block)
            and tensors["gaps"].numel() * 8 >= 5 * chunks)


def decode_words(tensors: dict[str, torch.Tensor], out: torch.Tensor, bytes_per_thread: int = 8,
                 threads_per_block: int = 512, max_codes: int | None = None) -> None:
    """Decode one unit's weights into ``out`` (int16 bit patterns, as many as the unit has weights, on the unit's
    device): with ``dfloat11_kernel`` where Triton runs there (a CUDA GPU), else with tensor operations.
    ``max_codes`` (``dfloat11_kernel.max_codes`` of the tables): given, the kernel does not read the tables back to
    the host (no wait for the device)."""
    sign_mantissa = tensors["sign_mantissa"].to(torch.uint8).flatten()
    if kernel_serves(tensors, bytes_per_thread, threads_per_block):
        positions = tensors["output_positions"].to(torch.uint8).flatten().view(torch.int32)
        dfloat11_kernel.decode(tensors["encoded_exponent"].to(torch.uint8).flatten(),
                               tensors["gaps"].to(torch.uint8).flatten(), tensors["luts"].to(torch.uint8).contiguous(),
                               positions, sign_mantissa, out, threads_per_block, max_codes)
        return
    exponents = decode_exponents(tensors["encoded_exponent"], tensors["gaps"], tensors["luts"],
                                 sign_mantissa.numel(), bytes_per_thread).to(sign_mantissa.device)
    low = sign_mantissa.to(torch.int32)
    bits = ((low & 0x80) << 8) | (exponents.to(torch.int32) << 7) | (low & 0x7F)
    out.copy_(torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16))


def decode_unit(tensors: dict[str, torch.Tensor], bytes_per_thread: int = 8,
                threads_per_block: int = 512) -> list[torch.Tensor]:
    """One DFloat11 unit's weights (flat bfloat16 tensors, split at ``split_positions``), bit for bit: with
    ``dfloat11_kernel`` where Triton runs on the unit's device (a CUDA GPU), else with tensor operations."""
    missing = [name for name in UNIT_TENSORS if name not in tensors]
    if missing:
        raise DFloat11Error(f"a DFloat11 unit needs {', '.join(UNIT_TENSORS)}; missing: {', '.join(missing)}")
    sign_mantissa = tensors["sign_mantissa"]
    words = torch.empty(sign_mantissa.numel(), dtype=torch.int16, device=sign_mantissa.device)
    decode_words(tensors, words, bytes_per_thread, threads_per_block)
    splits = [int(p) for p in tensors["split_positions"].flatten().tolist()]
    return list(torch.tensor_split(words.view(torch.bfloat16), splits))


def read_config(folder: str | Path) -> dict:
    """``dfloat11_config`` of the checkpoint's ``config.json`` (refused, naming the file, when there is none)."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())["dfloat11_config"]
    except (OSError, KeyError, json.JSONDecodeError) as error:
        raise DFloat11Error(f"{path} holds no dfloat11_config ({type(error).__name__}: {error}); a DFloat11 "
                            "checkpoint's folder has one") from None
    if int(config.get("bytes_per_thread", 8)) <= 0 or not isinstance(config.get("pattern_dict"), dict):
        raise DFloat11Error(f"{path}: dfloat11_config needs bytes_per_thread > 0 and a pattern_dict; got {config}")
    return config


def _unit_weights(name: str, module: nn.Module, pattern_dict: dict[str, list[str]]) -> list[str]:
    """The parameter names a unit's decoded weights go to, in order."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return [f"{name}.weight"]
    for pattern, attributes in pattern_dict.items():
        if re.fullmatch(pattern, name):
            return [f"{name}.{attribute}.weight" for attribute in attributes]
    raise DFloat11Error(f"the checkpoint codes {name!r}, which no pattern of its pattern_dict "
                        f"({', '.join(pattern_dict)}) matches")


def load_dfloat11(model: nn.Module, folder: str | Path, device: str | torch.device | None = None) -> nn.Module:
    """Fill ``model`` (a Diffusers model built from the base model's config; its tensors may be on the meta device)
    from the DFloat11 checkpoint in ``folder`` (``config.json`` with ``dfloat11_config`` and ``*.safetensors``):
    every coded unit decoded bit for bit into bfloat16 on ``device`` (default: the current CUDA device when there is
    one, which decodes much faster than the CPU; each weight then goes to where the model's tensor is, the CPU for a
    meta model), every other tensor as stored. Refuses, before changing the model, a checkpoint that leaves a tensor
    of the model unset, names one the model does not have, or gives a shape that differs from the model's. Returns
    the model, in eval mode."""
    from safetensors import safe_open

    folder = Path(folder)
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    config = read_config(folder)
    bytes_per_thread = int(config.get("bytes_per_thread", 8))
    threads_per_block = config.get("threads_per_block", 512)
    threads_per_block = int(threads_per_block[0] if isinstance(threads_per_block, (list, tuple)) else threads_per_block)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DFloat11Error(f"{folder} holds no .safetensors file")
    expected = dict(model.state_dict(keep_vars=True))
    unsaved = sorted(name for name, buffer in model.named_buffers() if buffer.is_meta and name not in expected)
    if unsaved:
        raise DFloat11Error(f"the model's buffers {', '.join(unsaved)} are on the meta device and no checkpoint holds "
                            "them (non-persistent: the model computes them when built); build the model on the CPU")
    handles = [safe_open(str(file), framework="pt") for file in files]  # headers only: tensors are read once below
    units: dict[str, dict[str, tuple[Any, str]]] = {}
    plain: dict[str, tuple[Any, str]] = {}
    for handle in handles:
        for key in handle.keys():
            owner, _, leaf = key.rpartition(".")
            if leaf in UNIT_TENSORS and key not in expected:
                units.setdefault(owner, {})[leaf] = (handle, key)
            else:
                plain[key] = (handle, key)
    modules = dict(model.named_modules())
    targets: dict[str, list[str]] = {}
    for owner in units:
        if owner not in modules:
            raise DFloat11Error(f"the checkpoint codes a unit {owner!r} the model has no module for")
        targets[owner] = _unit_weights(owner, modules[owner], config["pattern_dict"])
    given = [name for names in targets.values() for name in names] + list(plain)
    unknown = sorted(name for name in given if name not in expected)
    twice = sorted(name for name, count in Counter(given).items() if count > 1)
    unset = sorted(name for name in expected if name not in given)
    if unknown or twice or unset:
        parts = [f"{label}: {', '.join(names[:8])}{' …' if len(names) > 8 else ''}"
                 for label, names in (("not in the model", unknown), ("given twice", twice), ("not given", unset))
                 if names]
        raise DFloat11Error(f"{folder} does not match the model ({'; '.join(parts)})")
    # Each weight goes where the model's tensor is (the CPU for a meta model) as soon as it is decoded: a GPU that
    # decodes holds one unit at a time.
    home = {name: (torch.device("cpu") if t.device.type == "meta" else t.device) for name, t in expected.items()}
    values: dict[str, torch.Tensor] = {}
    for key, (handle, stored) in plain.items():
        value = handle.get_tensor(stored)
        if value.shape != expected[key].shape:
            raise DFloat11Error(f"{key}: the checkpoint's shape {tuple(value.shape)} is not the model's "
                                f"{tuple(expected[key].shape)}")
        values[key] = value.to(home[key])
    for owner, parts in units.items():
        tensors = {leaf: handle.get_tensor(stored) for leaf, (handle, stored) in parts.items()}
        if device is not None:
            tensors = {leaf: t.to(device) for leaf, t in tensors.items()}
        decoded = decode_unit(tensors, bytes_per_thread, threads_per_block)
        names = targets[owner]
        if len(decoded) != len(names):
            raise DFloat11Error(f"unit {owner!r} decodes to {len(decoded)} weights; its pattern lists "
                                f"{len(names)} ({', '.join(names)})")
        for name, flat in zip(names, decoded):
            shape = expected[name].shape
            if flat.numel() != shape.numel():
                raise DFloat11Error(f"{name}: the checkpoint holds {flat.numel()} weights, the model's "
                                    f"{tuple(shape)} has {shape.numel()}")
            # Each weight in its own storage: views of the unit's would share it, which safetensors refuses.
            weight = flat.reshape(shape)
            values[name] = weight.clone() if weight.device == home[name] else weight.to(home[name])
    model.load_state_dict(values, assign=True)
    entries: dict[str, TensorEntry] = {}
    for file in files:
        entries.update(safetensors_entries(file))
    names = list(values)
    _RECORDS[model] = DFloat11Record(
        folder, bytes_per_thread, threads_per_block,
        units={owner: {leaf: entries[stored] for leaf, (_, stored) in parts.items()} for owner, parts in units.items()},
        coded={name: (owner, index) for owner, weights in targets.items() for index, name in enumerate(weights)},
        plain={key: entries[stored] for key, (_, stored) in plain.items()},
        digests=dict(zip(names, tensor_digests([values[name] for name in names]))),
        identities={file: file_identity(file) for file in files})
    return model.eval()

