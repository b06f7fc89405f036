"""The lossless store (``compression="lossless"``): streamed bfloat16 blocks kept coded in host memory
(``offload.codec``: about 0.70 of their bytes on random weights), moved coded, decoded on the device into the block's buffers.

A block's coded parts and its tensors of other dtypes (float32 norms, say, which pass through as they are) live in
one host buffer (page-locked with the rest of the offload's host memory); on an accelerator the block is coded
there at enable (one block at a time). A load copies the whole buffer to a fresh device buffer in one copy on the copy stream
and decodes it into the block's buffers on a second side stream (``offload.decode_kernel``), so the copy stream moves
the next block while this one decodes, and both overlap the running block's compute; the block's ``ready`` event is
recorded after the decode. With ``compression_cache_dir`` the code is read from the folder when it holds the code of
these very weights (``offload.coded_cache``), and written there otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from ...utils.journal import Journal
from ..codec import CODED_DTYPES
from ..coded_block import CodedBlock, code_block
from ..memory import PackedWeights, Transfers
from .base import BlockStore, StoreContext, register_store

LOSSLESS = "lossless"


def codes(weights: PackedWeights) -> bool:
    """Whether the lossless code serves the block (it holds bfloat16 tensors)."""
    return any(dtype in CODED_DTYPES for dtype in weights.numel)


def coded_copy(weights: PackedWeights, context: StoreContext, allocate) -> CodedBlock:
    """The block's code in a buffer from ``allocate(nbytes)``: read from ``compression_cache_dir`` when the folder
    holds the code of these very weights (``coded_cache``), else coded now (on the accelerator when there is one) and
    written there for the next enable."""
    cache = context.cache
    digest = None
    spare: list[torch.Tensor] = []  # a buffer a damaged file was read into: the code of the same weights fits it
    if cache is not None:
        digest = cache.digest(weights)
        entry = cache.lookup(weights.path, digest)
        if entry is not None:
            buffer = allocate(max(entry.nbytes, 1))
            block = cache.read(entry, buffer, weights.path)
            if block is not None:
                return block
            spare.append(buffer)
    block = code_block(weights.current_flat(), context.device,
                       lambda nbytes: spare.pop() if spare and spare[0].numel() == nbytes else allocate(nbytes))
    if cache is not None:
        cache.store(weights.path, digest, block)
    return block


def upload_and_decode(block: CodedBlock, flat: torch.Tensor, buffers: dict[torch.dtype, torch.Tensor],
                      transfers: Transfers, wait_for: Any, done: Any, copied: Any = None) -> None:
    """Queue ``flat`` (a host buffer holding ``block``'s code) into the block's device ``buffers``: one copy to a
    fresh device buffer on the copy stream (it overwrites nothing, so it waits for nothing), then the decode on the
    decode stream once the copy is done and ``buffers`` are free (``wait_for``); ``done`` is recorded after the
    decode, ``copied`` (made here when ``None``) after the copy — the copy stream moves the next block while this one
    decodes. On the CPU the code is decoded straight from ``flat``."""
    device = next(iter(buffers.values())).device
    if device.type == "cpu":
        transfers.run(lambda: block.decode_into(flat, buffers), wait_for=wait_for, done=done)
        return
    staged, copied = [], copied if copied is not None else transfers.new_event()

    def copy() -> None:
        staged.append(flat.to(device, non_blocking=True))

    def decode() -> None:
        buffer = staged.pop()
        buffer.record_stream(torch.get_device_module(device).current_stream(device))  # freed after the decode
        block.decode_into(buffer, buffers)

    transfers.run(copy, done=copied)
    transfers.run_decode(decode, wait_for=(copied, wait_for), done=done)


@register_store
class LosslessStore(BlockStore):
    """Claims the streamed blocks holding bfloat16 tensors when the offload's ``compression`` is ``"lossless"``."""

    name = LOSSLESS
    priority = 50
    can_stay = True

    def __init__(self, weights: PackedWeights, context: StoreContext) -> None:
        super().__init__(weights, context)
        self.block: CodedBlock | None = None

    @classmethod
    def claims(cls, weights: PackedWeights, context: StoreContext) -> bool:
        return context.compression == LOSSLESS and codes(weights)

    @property
    def host_nbytes(self) -> int:
        return 0 if self.block is None else self.block.nbytes

    def take(self, journal: Journal) -> None:
        weights = self.weights
        # Nothing here rebinds the block's tensors (the caller parks them once this returns), so a failure before
        # the end needs no undo; the undo recorded at the end decodes the coded copy rather than keeping the
        # original tensors alive until the enable ends (a second full copy of the model in RAM while coding).
        devices = [tensor.device for tensor in weights.tensors.current()]
        host_memory = self.context.host_memory
        block = coded_copy(weights, self.context, lambda nbytes: host_memory.allocate(nbytes, torch.uint8))
        host_memory.pin(block.buffer)
        self.block = block
        journal.record(f"restore {weights.path}", lambda: weights.park(
            [view if device.type == "cpu" else view.to(device)
             for view, device in zip(weights.views_into(block.decoded()), devices)]))

    def counters(self) -> dict[str, int]:
        return self.block.counters() if self.block is not None else {}

    def fill(self, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for, done) -> None:
        upload_and_decode(self.block, self.block.buffer, buffers, transfers, wait_for, done)

    def host_views(self) -> list[torch.Tensor]:
        return self.weights.views_into(self.block.decoded(clone_raw=False))

    def give_back(self) -> None:
        # The raw parts are in the offload's host memory, released next where it cannot be kept.
        self.weights.park(self.weights.views_into(self.block.decoded(clone_raw=self.context.clone_on_release)),
                          final=True)
