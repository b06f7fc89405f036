"""The lossless store (``compression="lossless"``): streamed bfloat16 blocks kept coded in host memory
(``offload.codec``: about 0.70 of their bytes on random weights), moved coded, decoded on the device into the block's buffers.

A block's coded parts and its tensors of other dtypes (float32 norms, say, which pass through as they are) live in
one host buffer (page-locked with the rest of the offload's host memory); on an accelerator the block is coded
there at enable (one block at a time). A load copies the whole buffer to a fresh device buffer in one copy on the copy stream
and decodes it into the block's buffers on a second side stream (``offload.decode_kernel``), so the copy stream moves
the next block while this one decodes, and both overlap the running block's compute; the block's ``ready`` event is
recorded after the decode.
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
        self.raw_dtypes: list[torch.dtype] = []
        self.layout: list[tuple[int, int, torch.dtype]] = []  # (byte offset, numel, dtype) of each part

    @classmethod
    def claims(cls, weights: PackedWeights, context: StoreContext) -> bool:
        return context.compression == LOSSLESS and any(dtype in CODED_DTYPES for dtype in weights.numel)

    @property
    def host_nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def take(self, journal: Journal) -> None:
        weights = self.weights
        # Nothing here rebinds the block's tensors (the caller parks them once this returns), so a failure before
        # the end needs no undo; the undo recorded at the end decodes the coded copy rather than keeping the
        # original tensors alive until the enable ends (a second full copy of the model in RAM while coding).
        devices = [tensor.device for tensor in weights.tensors.current()]
        flat = weights.current_flat()
        coded = {dtype: self._encode(tensor) for dtype, tensor in flat.items() if dtype in CODED_DTYPES}
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
        self.raw_dtypes = list(raw)
        self.layout = [(offset, part.numel(), part.dtype) for part, offset in zip(parts, offsets)]
        self.coded, self.raw = self._arrange(views, coded)
        journal.record(f"restore {weights.path}", lambda: weights.park(
            [view if device.type == "cpu" else view.to(device) for view, device in zip(self._decoded(True), devices)]))

    def _decoded(self, clone_raw: bool) -> list[torch.Tensor]:
        """The block's tensors decoded from the coded copy, as host tensors (``clone_raw``: the other dtypes copied
        out of the host buffer, which is released with the offload's host memory)."""
        flat = {dtype: decode(encoded) for dtype, encoded in self.coded.items()}
        flat.update({dtype: raw.clone() if clone_raw else raw for dtype, raw in self.raw.items()})
        return self.weights.views_into(flat)

    def counters(self) -> dict[str, int]:
        counts = {"coded bytes": sum(encoded.nbytes for encoded in self.coded.values()),
                  "logical bytes": sum(2 * encoded.numel for encoded in self.coded.values()),
                  "passed bytes": sum(raw.numel() * raw.element_size() for raw in self.raw.values()),
                  "escapes": sum(encoded.escapes.numel() for encoded in self.coded.values())}
        for encoded in self.coded.values():
            counts[f"{encoded.width}-bit buffers"] = counts.get(f"{encoded.width}-bit buffers", 0) + 1
        return counts

    def _arrange(self, views: list[torch.Tensor], coded: dict[torch.dtype, Encoded]):
        """The coded parts and the raw tensors as ``views`` (of the host buffer or its device copy)."""
        arranged, index = {}, 0
        for dtype, encoded in coded.items():
            count = len(encoded.parts())
            arranged[dtype] = encoded.with_parts(views[index:index + count])
            index += count
        return arranged, {dtype: views[index + i] for i, dtype in enumerate(self.raw_dtypes)}

    def _encode(self, flat: torch.Tensor) -> Encoded:
        """Code on the offload's device when it is an accelerator (fast), else on the host; parts on the host."""
        device = self.context.device
        if device.type == "cpu":
            return encode(flat)
        encoded = encode(flat.to(device))
        return encoded.with_parts([part.cpu() for part in encoded.parts()])

    def _cut(self, staged: torch.Tensor) -> list[torch.Tensor]:
        """The parts' views of ``staged``, a copy of the whole host buffer (on the device)."""
        return [staged.narrow(0, offset, numel * dtype.itemsize).view(dtype) for offset, numel, dtype in self.layout]

    def fill(self, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for, done) -> None:
        device = next(iter(buffers.values())).device
        if device.type == "cpu":  # the host buffer is readable as it is: decode straight from it
            transfers.run(lambda: self._decode(self.coded, self.raw, buffers), wait_for=wait_for, done=done)
            return
        # The coded bytes go to a fresh device buffer on the copy stream at once (they overwrite nothing), and are
        # decoded into the block's buffers on the decode stream once they are there and the buffers are free: the
        # copy stream moves the next block while this one decodes.
        staged, copied = [], transfers.new_event()

        def copy() -> None:
            staged.append(self.buffer.to(device, non_blocking=True))

        def decode() -> None:
            buffer = staged.pop()
            buffer.record_stream(torch.get_device_module(device).current_stream(device))  # freed after the decode
            coded, raw = self._arrange(self._cut(buffer), self.coded)
            self._decode(coded, raw, buffers)

        transfers.run(copy, done=copied)
        transfers.run_decode(decode, wait_for=(copied, wait_for), done=done)

    @staticmethod
    def _decode(coded: dict[torch.dtype, Encoded], raw: dict[torch.dtype, torch.Tensor],
                buffers: dict[torch.dtype, torch.Tensor]) -> None:
        for dtype, part in raw.items():
            buffers[dtype].narrow(0, 0, part.numel()).copy_(part, non_blocking=True)
        for dtype, encoded in coded.items():
            decode_into(encoded, buffers[dtype])

    def host_views(self) -> list[torch.Tensor]:
        return self._decoded(False)

    def give_back(self) -> None:
        # The raw parts are in the offload's host memory, released next where it cannot be kept.
        self.weights.park(self._decoded(self.context.clone_on_release), final=True)
