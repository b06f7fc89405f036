"""The DFloat11 file store: under ``max_host_memory``, the blocks of a model loaded by ``load_dfloat11`` that keep no
host copy are read from the DFloat11 checkpoint itself, coded (its Huffman-coded exponents, about 0.68 of the bf16
bytes), and decoded on the device (``offload.dfloat11_kernel`` on a CUDA GPU), so the model's one copy on disk is
the one it was downloaded as: no bf16 checkpoint, no ``compression_cache_dir`` needed.

``DFloat11Sources`` is what the host planner (``stores.file.plan_disk_blocks``) asks about each streamed block: it
takes a block every tensor of which the checkpoint holds (coded in a unit whose weights are all in the block, or
stored as is), unchanged since it was loaded (the SHA-256 ``load_dfloat11`` recorded; the files' identities) and
hands every other block to the lossless cache's sources (``coded_file.CodedSources``) when there is a cache. A
block it takes counts at its bf16 size in the host plan (the store that holds it when it keeps a host copy, plain or
``compression="lossless"``, takes no more), and on disk is the pieces of the checkpoint's files it needs, read by
the reader thread into the staging ring, copied to the device coded and decoded there into the block's buffers
(``lossless.upload_and_decode``, through the offload's code ring).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..coded_block import PART_ALIGN
from ..coded_cache import tensor_digests
from ..dfloat11 import DFloat11Record, checkpoint_of, decode_words
from ..dfloat11_kernel import max_codes
from ..disk import BlockSource, DiskReader, Piece, TensorEntry, checkpoint_names, take_checksum
from ..memory import PackedWeights
from .base import register_store
from .coded_file import CodedFileStore

logger = logging.getLogger("diffusers_omni")

DECODED = ("encoded_exponent", "sign_mantissa", "luts", "gaps", "output_positions")  # what decoding reads


@dataclass
class _Unit:
    parts: dict[str, tuple[int, int]]  # tensor → (byte offset in the staged bytes, bytes)
    numel: int  # weights in the unit
    weights: list[tuple[int, int, int]]  # (offset in the unit's output, offset in the bf16 buffer, numel)
    contiguous: int | None  # the bf16 buffer offset the whole output decodes to in one piece (None: scattered)
    max_codes: int  # the most codes one chunk holds (from the tables, read once: no device sync per load)


class DFloat11Block:
    """A disk-backed block's DFloat11 code as the staging ring holds it: each unit's tensors and each uncoded tensor
    at an aligned offset of ``nbytes`` bytes. ``decode_into`` decodes a copy of them (on the device) into the
    block's buffers; ``decoded`` gives the block's flat tensors back on the host (decoded on ``device``)."""

    def __init__(self, units: list[_Unit], plain: list[tuple[int, torch.dtype, int, int]], nbytes: int,
                 numel: dict[torch.dtype, int], device: torch.device, bytes_per_thread: int,
                 threads_per_block: int) -> None:
        self.units = units
        self.plain = plain  # (byte offset in the staged bytes, dtype, offset in that dtype's buffer, numel)
        self.nbytes = nbytes
        self.numel = numel
        self.device = device
        self.bytes_per_thread = bytes_per_thread
        self.threads_per_block = threads_per_block

    def decode_into(self, flat: torch.Tensor, buffers: dict[torch.dtype, torch.Tensor]) -> None:
        for offset, dtype, start, numel in self.plain:
            buffers[dtype].narrow(0, start, numel).copy_(
                flat.narrow(0, offset, numel * dtype.itemsize).view(dtype), non_blocking=True)
        words = buffers[torch.bfloat16].view(torch.int16) if self.units else None
        for unit in self.units:
            tensors = {name: flat.narrow(0, offset, size) for name, (offset, size) in unit.parts.items()}
            tensors["luts"] = tensors["luts"].view(-1, 256)
            if unit.contiguous is not None:
                decode_words(tensors, words.narrow(0, unit.contiguous, unit.numel), self.bytes_per_thread,
                             self.threads_per_block, unit.max_codes)
                continue
            out = torch.empty(unit.numel, dtype=torch.int16, device=flat.device)
            decode_words(tensors, out, self.bytes_per_thread, self.threads_per_block, unit.max_codes)
            for source, target, numel in unit.weights:
                words.narrow(0, target, numel).copy_(out.narrow(0, source, numel))

    def decoded(self, flat: torch.Tensor) -> dict[torch.dtype, torch.Tensor]:
        device = self.device if self.device.type == "cuda" else torch.device("cpu")  # the kernel's device
        buffers = {dtype: torch.zeros(numel, dtype=dtype, device=device) for dtype, numel in self.numel.items()}
        self.decode_into(flat.to(device), buffers)
        return {dtype: buffer.cpu() for dtype, buffer in buffers.items()}

    def counters(self) -> dict[str, int]:
        coded = sum(size for unit in self.units for _, size in unit.parts.values())
        return {"coded bytes": coded, "logical bytes": 2 * sum(unit.numel for unit in self.units),
                "passed bytes": sum(numel * dtype.itemsize for _, dtype, _, numel in self.plain),
                "DFloat11 units": len(self.units)}


class DFloat11Sources:
    """The host planner's view of the blocks of models loaded by ``load_dfloat11`` (see the module); ``fallback``
    (``coded_file.CodedSources`` or ``None``) answers for every other block."""

    progress_label = ("layerwise offload: blocks checked against their DFloat11 checkpoint (or their lossless code "
                      "sized)")
    materialize_label = ("layerwise offload: disk-backed blocks (in their DFloat11 checkpoint, or their lossless code "
                         "in compression_cache_dir)")

    def __init__(self, modules: list[torch.nn.Module], device: torch.device, fallback: Any = None) -> None:
        self.device = device
        self.fallback = fallback
        self._names: dict[int, tuple[DFloat11Record, list[str]]] = {}  # id(tensor) → its record, its names
        for module in modules:
            record = checkpoint_of(module)
            if record is None:
                continue
            if not record.unchanged_files():
                logger.warning("layerwise offload: the DFloat11 checkpoint %s changed since the model was loaded "
                               "from it: its blocks are not read from it", record.folder)
                continue
            names, _ = checkpoint_names(module)
            for tensor_id, aliases in names.items():
                self._names[tensor_id] = (record, aliases)
        self._plans: dict[int, tuple[DFloat11Record, dict[str, Any]] | None] = {}  # id(PackedWeights) → plan

    def _plan(self, weights: PackedWeights) -> tuple[DFloat11Record, dict[str, Any]] | None:
        """Which of the record's tensors make up this block (``None``: not all of them are there, as loaded)."""
        if id(weights) in self._plans:
            return self._plans[id(weights)]
        plan = self._plans[id(weights)] = self._make_plan(weights)
        return plan

    def _make_plan(self, weights: PackedWeights) -> tuple[DFloat11Record, dict[str, Any]] | None:
        record, coded, plain, names = None, {}, [], []
        for slot in weights.slots:
            found = self._names.get(id(slot.tensor))
            if found is None or (record is not None and found[0] is not record) or slot.stride is not None:
                return None
            record = found[0]
            name = next((n for n in found[1] if n in record.coded or n in record.plain), None)
            if name is None:
                return None
            names.append(name)
            if name in record.coded:
                if slot.dtype != torch.bfloat16:
                    return None
                unit, index = record.coded[name]
                coded.setdefault(unit, {})[index] = slot
            else:
                entry = record.plain[name]
                if entry.dtype != slot.dtype or tuple(entry.shape) != tuple(slot.shape):
                    return None
                plain.append((entry, slot))
        if record is None or not coded:
            return None
        for unit, slots in coded.items():  # every weight of a unit in this block: each unit decodes whole here
            splits = record.units[unit]["split_positions"].shape
            if len(slots) != (splits[0] if splits else 0) + 1:
                return None
        digests = tensor_digests([slot.flat_source() for slot in weights.slots])
        changed = [name for name, digest in zip(names, digests) if record.digests.get(name) != digest]
        if changed:
            logger.warning("layerwise offload: block %r is not read from its DFloat11 checkpoint: %s changed since "
                           "it was loaded (a fused LoRA?)", weights.path, ", ".join(changed[:4]))
            return None
        return record, {"coded": coded, "plain": plain}

    def claims(self, weights: PackedWeights) -> bool:
        if self._plan(weights) is not None:
            return True
        return self.fallback is not None and self.fallback.claims(weights)

    def prepare(self, weights: PackedWeights) -> int:
        """Bytes the block counts at in the host plan: its own (a host copy, if the plan keeps one, is held plain or
        in the lossless code: no more than that)."""
        if self._plan(weights) is None:
            return self.fallback.prepare(weights)
        return weights.nbytes

    def materialize(self, blocks: list[PackedWeights], progress: Any = None) -> None:
        """The plan reads ``blocks`` from disk: those of the DFloat11 checkpoint need nothing more (``progress``
        counts them at once); the fallback's get their code in its cache folder."""
        others = [weights for weights in blocks if self._plan(weights) is None]
        if progress is not None:
            progress(sum(weights.nbytes for weights in blocks) - sum(weights.nbytes for weights in others))
        if self.fallback is not None:
            self.fallback.materialize(others, progress)

    def source(self, weights: PackedWeights, component: str, files: list[Path]) -> BlockSource:
        """The block's source: the pieces of the checkpoint's files it needs, at aligned offsets of its bytes."""
        plan = self._plan(weights)
        if plan is None:
            return self.fallback.source(weights, component, files)
        record, parts = plan
        pieces: list[Piece] = []
        offset = 0

        def place(entry: TensorEntry, label: str) -> int:
            nonlocal offset
            if entry.file not in files:
                files.append(entry.file)
            start = offset
            pieces.append(Piece(files.index(entry.file), entry.offset, start, entry.nbytes, label))
            offset += -(-entry.nbytes // PART_ALIGN) * PART_ALIGN
            return start

        units = []
        for unit, slots in parts["coded"].items():
            entries = record.units[unit]
            placed = {name: (place(entries[name], f"{unit}.{name}"), entries[name].nbytes) for name in DECODED}
            numel = entries["sign_mantissa"].nbytes
            ordered = [slots[i] for i in range(len(slots))]
            weights_at, position = [], 0
            for slot in ordered:
                weights_at.append((position, slot.offset, slot.numel))
                position += slot.numel
            if position != numel:
                raise RuntimeError(f"DFloat11 unit {unit!r} holds {numel} weights, the block's slots {position}")
            contiguous = all(weights_at[i][1] + weights_at[i][2] == weights_at[i + 1][1]
                             for i in range(len(weights_at) - 1))
            units.append(_Unit(placed, numel, weights_at, weights_at[0][1] if contiguous else None,
                               max_codes(_read(entries["luts"]))))
        plain = [(place(entry, _label(entry, slot)), slot.dtype, slot.offset, slot.numel)
                 for entry, slot in parts["plain"]]
        source = BlockSource(weights.path, component, {torch.uint8: max(offset, 1)}, pieces)
        source.coded = DFloat11Block(units, plain, max(offset, 1), dict(weights.numel), self.device,
                                     record.bytes_per_thread, record.threads_per_block)
        return source

    @staticmethod
    def verify(source: BlockSource, reader: DiskReader) -> None:
        """The block was checked against what ``load_dfloat11`` read (digests, file identities): the checksum later
        reads are compared with is taken now."""
        take_checksum(source, reader)


def _label(entry: TensorEntry, slot: Any) -> str:
    return f"{entry.file.name}:{entry.offset} ({list(slot.shape)})"


def _read(entry: TensorEntry) -> torch.Tensor:
    """One (small) tensor's bytes from its file, as uint8."""
    with open(entry.file, "rb") as handle:
        handle.seek(entry.offset)
        return torch.frombuffer(bytearray(handle.read(entry.nbytes)), dtype=torch.uint8)


def reads_dfloat11(modules: list[torch.nn.Module]) -> bool:
    """Whether one of ``modules`` was loaded by ``load_dfloat11`` (under a host budget its blocks may be read from
    that checkpoint)."""
    return any(checkpoint_of(module) is not None for module in modules)


def dfloat11_sources(modules: list[torch.nn.Module], device: torch.device, fallback: Any) -> Any:
    """``DFloat11Sources`` when one of ``modules`` was loaded by ``load_dfloat11``, else ``fallback`` as it is."""
    if not reads_dfloat11(modules):
        return fallback
    return DFloat11Sources(modules, device, fallback)


@register_store
class DFloat11FileStore(CodedFileStore):
    """A disk-backed block whose bytes are its DFloat11 code in the checkpoint it was loaded from: staged by the
    reader thread, copied to the device coded, decoded there into the block's buffers (as the coded file store's
    blocks are, through their ``DFloat11Block``)."""

    name = "disk (DFloat11)"
    priority = 120
    coded_type = DFloat11Block
