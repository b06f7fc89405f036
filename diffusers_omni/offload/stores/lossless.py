"""The lossless store (``compression="lossless"``): streamed bfloat16 blocks kept coded in host memory
(``offload.codec``: about 0.75 of their bytes), moved coded, decoded on the device into the block's buffers.

A block's coded parts and its tensors of other dtypes (float32 norms, say, which pass through as they are) live in
one host buffer (page-locked with the rest of the offload's host memory). A load copies the buffer's parts to the
device on the copy stream and decodes them there, on the same stream, so the decode of the next block overlaps the
running block's compute as its copy does; the block's ``ready`` event is recorded after the decode.
"""

from __future__ import annotations

import torch

from ...utils.journal import Journal
from ..codec import CODED_DTYPES, Encoded, decode, decode_into, encode
from ..memory import PackedWeights, Transfers
from .base import BlockStore, StoreContext, register_store

LOSSLESS = "lossless"
_PART_ALIGN = 64  # bytes between the start of two parts in the host buffer


@register_store
class LosslessStore(BlockStore):
    """Claims the streamed blocks holding bfloat16 tensors when the offload's ``compression`` is ``"lossless"``."""

    name = LOSSLESS
    priority = 50

    def __init__(self, weights: PackedWeights, context: StoreContext) -> None:
        super().__init__(weights, context)
        self.coded: dict[torch.dtype, Encoded] = {}
        self.raw: dict[torch.dtype, torch.Tensor] = {}
        self.buffer: torch.Tensor | None = None

    @classmethod
    def claims(cls, weights: PackedWeights, context: StoreContext) -> bool:
        return context.compression == LOSSLESS and any(dtype in CODED_DTYPES for dtype in weights.numel)

    @property
    def host_nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def take(self, journal: Journal) -> None:
        weights = self.weights
        originals = weights.tensors.current()
        journal.record(f"restore {weights.path}", lambda: weights.park(originals))
        flat = weights.current_flat()
        coded = {dtype: encode(tensor) for dtype, tensor in flat.items() if dtype in CODED_DTYPES}
        raw = {dtype: tensor for dtype, tensor in flat.items() if dtype not in CODED_DTYPES}
        parts = [part for encoded in coded.values() for part in encoded.parts()] + list(raw.values())
        offsets, total = [], 0
        for part in parts:
            offsets.append(total)
            total += -(-part.numel() * part.element_size() // _PART_ALIGN) * _PART_ALIGN
        host_memory = self.context.host_memory
        buffer = host_memory.allocate(max(total, 1), torch.uint8)
        views = []
        for part, offset in zip(parts, offsets):
            view = buffer.narrow(0, offset, part.numel() * part.element_size()).view(part.dtype)
            view.copy_(part)
            views.append(view)
        host_memory.pin(buffer)
        self.buffer = buffer
        index = 0
        for dtype, encoded in coded.items():
            self.coded[dtype] = encoded.with_parts(views[index:index + 5])
            index += 5
        for dtype in raw:
            self.raw[dtype] = views[index]
            index += 1

    def fill(self, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for, done) -> None:
        def copy_and_decode() -> None:
            for dtype, raw in self.raw.items():
                buffers[dtype].narrow(0, 0, raw.numel()).copy_(raw, non_blocking=True)
            for dtype, encoded in self.coded.items():
                device = buffers[dtype].device
                parts = [part.to(device, non_blocking=True) for part in encoded.parts()]
                decode_into(encoded.with_parts(parts), buffers[dtype])

        transfers.run(copy_and_decode, wait_for=wait_for, done=done)

    def host_views(self) -> list[torch.Tensor]:
        flat = {dtype: decode(encoded) for dtype, encoded in self.coded.items()}
        flat.update(self.raw)
        return self.weights.views_into(flat)

    def give_back(self) -> None:
        flat = {dtype: decode(encoded) for dtype, encoded in self.coded.items()}
        clone = self.context.clone_on_release  # the raw parts are in the offload's host memory, released next
        flat.update({dtype: raw.clone() if clone else raw for dtype, raw in self.raw.items()})
        self.weights.park(self.weights.views_into(flat), final=True)
