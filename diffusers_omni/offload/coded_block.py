"""One streamed block in the lossless code: its coded parts and its uncoded tensors in one flat byte buffer.

``code_block`` codes a block's flat per-dtype tensors (``PackedWeights.current_flat``): each bfloat16 buffer becomes
the five parts of ``codec.Encoded``, other dtypes (float32 norms, say) pass through as they are, and every part is
laid out ``PART_ALIGN``-aligned in one uint8 buffer. That buffer is what the lossless store keeps in host memory,
what ``coded_cache`` writes to disk, and what a load copies to the device in one copy; ``decode_into`` decodes it
(or a copy of it anywhere) into the block's device buffers. ``metadata``/``from_metadata`` carry the layout
through a file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .codec import CODED_DTYPES, Encoded, decode, decode_into, encode, part_nbytes

PART_ALIGN = 64  # bytes between the starts of two parts in the buffer


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class CodedBlock:
    """A block's code: ``buffer`` (uint8, host) holds the parts at ``layout`` ((byte offset, numel, dtype) each):
    first the five parts of each coded dtype's ``Encoded`` (in ``coded`` order), then one raw tensor per dtype of
    ``raw_dtypes``. ``coded`` are the ``Encoded`` of each coded dtype, their parts views of ``buffer``."""

    buffer: torch.Tensor
    layout: list[tuple[int, int, torch.dtype]]
    coded: dict[torch.dtype, Encoded]
    raw_dtypes: list[torch.dtype]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parts as views of ``flat``: the buffer or a copy of it (on the device, a staging buffer)."""
        return [flat.narrow(0, offset, numel * dtype.itemsize).view(dtype) for offset, numel, dtype in self.layout]

    def arrange(self, flat: torch.Tensor) -> tuple[dict[torch.dtype, Encoded], dict[torch.dtype, torch.Tensor]]:
        """The coded dtypes' ``Encoded`` and the raw tensors, as views of ``flat`` (a copy of ``buffer``)."""
        views = self.views(flat)
        arranged, index = {}, 0
        for dtype, encoded in self.coded.items():
            count = len(encoded.parts())
            arranged[dtype] = encoded.with_parts(views[index:index + count])
            index += count
        return arranged, {dtype: views[index + i] for i, dtype in enumerate(self.raw_dtypes)}

    def decode_into(self, flat: torch.Tensor, buffers: dict[torch.dtype, torch.Tensor]) -> None:
        """Decode ``flat`` (``buffer`` or a copy of it, on ``buffers``' device) into the block's flat per-dtype
        ``buffers``, on the current stream."""
        coded, raw = self.arrange(flat)
        for dtype, part in raw.items():
            buffers[dtype].narrow(0, 0, part.numel()).copy_(part, non_blocking=True)
        for dtype, encoded in coded.items():
            decode_into(encoded, buffers[dtype])

    def decoded(self, flat: torch.Tensor | None = None, clone_raw: bool = True) -> dict[torch.dtype, torch.Tensor]:
        """The block's flat per-dtype tensors decoded from ``flat`` (default ``buffer``) on its device;
        ``clone_raw``: the uncoded dtypes copied out of it (else views of it)."""
        coded, raw = self.arrange(self.buffer if flat is None else flat)
        out = {dtype: decode(encoded) for dtype, encoded in coded.items()}
        out.update({dtype: part.clone() if clone_raw else part for dtype, part in raw.items()})
        return out

    def counters(self) -> dict[str, int]:
        """What the report sums per component: coded, logical and passed-through bytes, escapes, buffers per
        code width."""
        raw = self.layout[len(self.layout) - len(self.raw_dtypes):]  # the raw tensors come last
        counts = {"coded bytes": sum(encoded.nbytes for encoded in self.coded.values()),
                  "logical bytes": sum(2 * encoded.numel for encoded in self.coded.values()),
                  "passed bytes": sum(numel * dtype.itemsize for _, numel, dtype in raw),
                  "escapes": sum(encoded.escapes.numel() for encoded in self.coded.values())}
        for encoded in self.coded.values():
            counts[f"{encoded.width}-bit buffers"] = counts.get(f"{encoded.width}-bit buffers", 0) + 1
        return counts

    def metadata(self) -> dict:
        """The layout as plain data (``from_metadata`` rebuilds the block around a buffer read from a file)."""
        return {"layout": [[offset, numel, dtype_name(dtype)] for offset, numel, dtype in self.layout],
                "coded": [[dtype_name(dtype), encoded.numel, encoded.width] for dtype, encoded in self.coded.items()],
                "raw": [dtype_name(dtype) for dtype in self.raw_dtypes]}

    @classmethod
    def from_metadata(cls, meta: dict, buffer: torch.Tensor) -> "CodedBlock":
        layout = [(int(offset), int(numel), dtype_named(name)) for offset, numel, name in meta["layout"]]
        end = max((offset + numel * dtype.itemsize for offset, numel, dtype in layout), default=0)
        if end > buffer.numel():
            raise ValueError(f"the layout ends at byte {end}, the buffer holds {buffer.numel()}")
        skeleton = cls(buffer, layout, {}, [dtype_named(name) for name in meta["raw"]])
        views, index = skeleton.views(buffer), 0
        for name, numel, width in meta["coded"]:
            dtype = dtype_named(name)
            skeleton.coded[dtype] = Encoded(dtype, int(numel), int(width), *views[index:index + 5])
            index += 5
        if index + len(skeleton.raw_dtypes) != len(layout):
            raise ValueError(f"the layout has {len(layout)} parts, the code needs {index + len(skeleton.raw_dtypes)}")
        return skeleton


def coding_device(device: torch.device) -> torch.device | None:
    """Where ``code_block`` codes for an offload to ``device``: the accelerator itself, ``None`` (the host) for the
    CPU; ``PackedWeights.current_flat(coding_device(...))`` gathers the block there directly."""
    return None if device.type == "cpu" else device


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` where ``code_block`` codes it: on ``device`` when that is an accelerator, else where it is."""
    return tensor if device.type == "cpu" else tensor.to(device)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // PART_ALIGN) * PART_ALIGN


def coded_nbytes(flat: dict[torch.dtype, torch.Tensor], device: torch.device) -> int:
    """The bytes of ``code_block(flat, device, ...)``'s buffer, without coding: from the keys' counts of each coded
    dtype (counted on ``device`` when it is an accelerator) and the sizes of the others. A host budget plans with it
    before it decides which blocks are coded where."""
    total = 0
    for dtype, tensor in flat.items():
        if dtype in CODED_DTYPES:
            total += sum(_aligned(n) for n in part_nbytes(_on(tensor, device)))
        else:
            total += _aligned(tensor.numel() * tensor.element_size())
    return max(total, 1)


def code_block(flat: dict[torch.dtype, torch.Tensor], device: torch.device,
               allocate: Callable[[int], torch.Tensor]) -> CodedBlock:
    """Code ``flat`` (a block's per-dtype flat tensors, on the host or already on ``device``) into one buffer from
    ``allocate(nbytes)`` (uint8, host). The coding runs on ``device`` when it is an accelerator (fast), else on the
    host; each coded part is copied from there into its place in the buffer (one copy, no intermediate host
    tensor)."""
    # The parts stay where they were coded and are copied once, straight into their place in the buffer.
    coded = {dtype: encode(_on(tensor, device))
             for dtype, tensor in flat.items() if dtype in CODED_DTYPES}
    raw = {dtype: tensor for dtype, tensor in flat.items() if dtype not in CODED_DTYPES}
    parts = [part for encoded in coded.values() for part in encoded.parts()] + list(raw.values())
    layout, total = [], 0
    for part in parts:
        layout.append((total, part.numel(), part.dtype))
        total += _aligned(part.numel() * part.element_size())
    buffer = allocate(max(total, 1))
    block = CodedBlock(buffer, layout, coded, list(raw))
    for part, view in zip(parts, block.views(buffer)):
        view.copy_(part)
    block.coded, _ = block.arrange(buffer)
    return block
