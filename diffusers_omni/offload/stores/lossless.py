"""The lossless store (``compression="lossless"``): streamed bfloat16 blocks kept coded in host memory
(``offload.codec``: about 0.70 of their bytes on random weights), moved coded, decoded on the device into the
block's buffers.

A block's coded parts and its tensors of other dtypes (float32 norms, say, which pass through as they are) live in
one host buffer (page-locked with the rest of the offload's host memory); on an accelerator the block is coded
there at enable (one block at a time). A load copies the whole buffer in one copy on the copy stream into one of the
offload's code buffers on the device (``CodeRing``: a few buffers as large as its largest code, made on the first
load and reused in turn) and decodes it into the block's buffers on a second side stream (``offload.decode_kernel``),
so the copy stream moves the next block while this one decodes, and both overlap the running block's compute; the
block's ``ready`` event is recorded after the decode. With ``compression_cache_dir`` the code is read from the folder
when it holds the code of these very weights (``offload.coded_cache``), and written there otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from ...utils.journal import Journal
from ..codec import CODED_DTYPES
from ..coded_block import CodedBlock, code_block, coding_device
from ..memory import PackedWeights, Transfers
from .base import BlockStore, StoreContext, register_store

LOSSLESS = "lossless"


def codes(weights: PackedWeights) -> bool:
    """Whether the lossless code serves the block (it holds bfloat16 tensors)."""
    return any(dtype in CODED_DTYPES for dtype in weights.numel)


def coded_copy(weights: PackedWeights, context: StoreContext, allocate) -> CodedBlock:
    """The block's code in a buffer from ``allocate(nbytes)``: read from ``compression_cache_dir`` when the folder
    holds the code of these very weights (``coded_cache``), else coded now (on the accelerator when there is one) and
    written there for the next enable (unless a host budget keeps the folder for the blocks it reads from disk,
    ``CodedCache.writes``: then only a file of the block already there is brought up to date)."""
    cache = context.cache
    existed = cache is not None and cache.path_of(weights.path).exists()
    spare: list[torch.Tensor] = []  # a buffer a damaged file was read into: the code of the same weights fits it
    if existed:
        entry = cache.entry_for(weights)
        if entry is not None:
            buffer = allocate(max(entry.nbytes, 1))
            block = cache.read(entry, buffer, weights.path)
            if block is not None:
                return block
            spare.append(buffer)
    block = code_block(weights.current_flat(coding_device(context.device)), context.device,
                       lambda nbytes: spare.pop() if spare and spare[0].numel() == nbytes else allocate(nbytes))
    if cache is not None and (existed or cache.writes(weights.path)):
        cache.store(weights.path, cache.digest(weights), block)
    return block


class CodeRing:
    """The code's device buffers of one offload: ``count`` buffers, each as large as the largest code of its
    blocks (``want``), made on the first load and reused in turn. Each load writes the next buffer once the decode
    that last read it is done, so the code never goes through the caching allocator per load. (A fresh device
    buffer per load, in a different size for almost every block, left the allocator holding several times what was
    allocated: ``benchmarks/results/lossless-pool-probe``.) On the CPU nothing is made: the code decodes from the
    host buffer."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"CodeRing count={count!r} is not allowed: at least one buffer")
        self.count = count
        self.nbytes = 0  # the largest code it must hold
        self.buffers: list[torch.Tensor] = []
        self.freed: list[Any] = [None] * count  # per buffer: recorded after the last decode that read it
        self.next = 0

    @property
    def device_nbytes(self) -> int:
        """Device bytes the ring holds (0 until the first load)."""
        return sum(buffer.numel() for buffer in self.buffers)

    def want(self, nbytes: int) -> None:
        """A block whose code takes ``nbytes`` will load through the ring."""
        self.nbytes = max(self.nbytes, nbytes)

    def _make(self, nbytes: int, device: torch.device, transfers: Transfers) -> None:
        if self.buffers:  # a code larger than planned (nothing plans one): nothing may still read the old buffers
            transfers.synchronize()
        self.buffers = []
        with torch.inference_mode(False):  # written outside inference mode too (a state_dict() or a backward)
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(self.count)]
        made = transfers.new_event()  # the compute stream may have used that memory until now
        transfers.record_on_compute(made)
        self.freed = [made] * self.count

    def upload(self, block: CodedBlock, flat: torch.Tensor, buffers: dict[torch.dtype, torch.Tensor],
               transfers: Transfers, wait_for: Any, done: Any) -> None:
        """Queue ``flat`` (a host buffer holding ``block``'s code) into the block's device ``buffers``: the copy
        into the next ring buffer on the copy stream, once the decode that last read that buffer is done; the
        decode on the decode stream once the copy is done and ``buffers`` are free (``wait_for``). ``done`` is
        recorded after the decode."""
        device = next(iter(buffers.values())).device
        if not self.buffers or self.buffers[0].numel() < flat.numel():
            self._make(max(self.nbytes, flat.numel()), device, transfers)
        index, self.next = self.next, (self.next + 1) % self.count
        staged, previous = self.buffers[index].narrow(0, 0, flat.numel()), self.freed[index]
        copied = transfers.new_event()
        finished = self.freed[index] = transfers.new_event()
        module = torch.get_device_module(device) if device.type != "cpu" else None

        def copy() -> None:
            if module is not None:
                stream = module.current_stream(device)
                if previous is not None:
                    stream.wait_event(previous)
                self.buffers[index].record_stream(stream)  # freed on disable only after what reads it
            staged.copy_(flat, non_blocking=True)

        def decode() -> None:
            block.decode_into(staged, buffers)
            if module is not None:
                stream = module.current_stream(device)
                self.buffers[index].record_stream(stream)
                finished.record(stream)

        transfers.run(copy, done=copied)
        transfers.run_decode(decode, wait_for=(copied, wait_for), done=done)


def ring_buffers(window_blocks: int) -> int:
    """Buffers of the code ring: one per block the window holds, so each block in flight has its code's buffer; a
    copy into a buffer waits for the decode that last read it, always one queued before it (never a deadlock, at
    most a wait where more, smaller blocks than that are in flight under a budget)."""
    return window_blocks


def ring_bytes_planned(block_bytes: list[int], window_blocks: int) -> int:
    """What the device plan reserves for the code ring before anything is coded: its buffers at the largest coded
    block's bf16 size (a code is about 0.7 of it; its size is known only once coded)."""
    return ring_buffers(window_blocks) * max(block_bytes, default=0)


def code_ring(context: StoreContext) -> CodeRing:
    """The offload's ``CodeRing`` (made with the first coded store)."""
    if context.code_ring is None:
        context.code_ring = CodeRing(ring_buffers(context.window_blocks))
    return context.code_ring


def upload_and_decode(block: CodedBlock, flat: torch.Tensor, buffers: dict[torch.dtype, torch.Tensor],
                      transfers: Transfers, wait_for: Any, done: Any, ring: CodeRing) -> None:
    """Queue ``flat`` (a host buffer holding ``block``'s code) into the block's device ``buffers``: through
    ``ring`` on an accelerator (``CodeRing.upload``); on the CPU the code is decoded straight from ``flat``."""
    device = next(iter(buffers.values())).device
    if device.type == "cpu":
        transfers.run(lambda: block.decode_into(flat, buffers), wait_for=wait_for, done=done)
        return
    ring.upload(block, flat, buffers, transfers, wait_for, done)


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
        code_ring(self.context).want(block.nbytes)
        journal.record(f"restore {weights.path}", lambda: weights.park(
            [view if device.type == "cpu" else view.to(device)
             for view, device in zip(weights.views_into(block.decoded()), devices)]))

    def counters(self) -> dict[str, int]:
        return self.block.counters() if self.block is not None else {}

    def fill(self, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for, done) -> None:
        upload_and_decode(self.block, self.block.buffer, buffers, transfers, wait_for, done,
                          code_ring(self.context))

    def host_views(self) -> list[torch.Tensor]:
        return self.weights.views_into(self.block.decoded(clone_raw=False))

    def give_back(self) -> None:
        # The raw parts are in the offload's host memory, released next where it cannot be kept.
        self.weights.park(self.weights.views_into(self.block.decoded(clone_raw=self.context.clone_on_release)),
                          final=True)
