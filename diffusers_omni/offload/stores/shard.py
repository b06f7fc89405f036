"""The shard store (distributed AllGather): this rank's 1/N of each streamed block, rebuilt by an all-gather.

Every block's per-dtype flat buffer (the ``PackedWeights`` layout) is ceil-padded to a multiple of the group size N
and cut into N equal shards; rank ``r`` keeps only shard ``r`` in the offload's host memory (pinned), so host
weights per rank are ≈ model ÷ N. A load copies the shard into this rank's part of the block's device buffers
(sized for the padded layout, ``device_numel``) and all-gathers the rest in place: the all-gather transport
(``transports.AllGatherTransfers``) does both. The full weights exist on no rank, so ``host_views`` (``state_dict``)
is refused (``host_views_refusal``: the offload refuses ``state_dict()`` and ``save_pretrained`` before anything is
written); disable gathers each block once more into ordinary host tensors (collective: every rank disables).

Chosen by the planner like any store: it is registered with the highest priority and claims every streamed block
when the offload's ``StoreContext`` carries a ``ShardGroup``, which only the AllGather mode of distributed layerwise
offload sets (``use_allgather=True``). No other store may then hold a block whole; no other strategy ever sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...utils.journal import Journal
from ..memory import PackedWeights, Transfers
from ..transports import all_gather_bytes
from .base import BlockStore, StoreContext, register_store

__all__ = ["ShardGroup", "ShardStore", "host_bytes_per_rank", "shard_numel", "shard_range"]


def shard_numel(numel: int, world_size: int) -> int:
    """Elements in each rank's shard of a flat buffer of ``numel`` elements (ceil-padded: ``10, 4`` → ``3``)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} is out of range; allowed: an int >= 1")
    return -(-numel // world_size)


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s shard in the padded flat buffer (may reach past ``numel``: padding)."""
    size = shard_numel(numel, world_size)
    return rank * size, (rank + 1) * size


def host_bytes_per_rank(numel: dict[torch.dtype, int], world_size: int) -> dict[torch.dtype, int]:
    """Bytes one rank pins for a block with ``numel`` elements per dtype: ``ceil(numel / N)`` elements each."""
    return {d: shard_numel(n, world_size) * torch.empty(0, dtype=d).element_size() for d, n in numel.items()}


@dataclass(frozen=True)
class ShardGroup:
    """The process group the blocks are sharded over, and this rank's place in it."""

    group: Any
    rank: int
    world_size: int


@register_store
class ShardStore(BlockStore):
    """This rank's shard of a streamed block; ``fill`` needs the all-gather transport."""

    name = "shard"
    priority = 1000  # above every other store: under AllGather no block may be held whole
    uses_offload_host_memory = True
    host_views_refusal = (
        "distributed layerwise offload (AllGather) keeps only this rank's 1/N shard of every streamed block, so "
        "the full weights exist nowhere to read (disabling gathers them back into full host copies, on every rank)"
    )
    give_back_progress = "distributed offload: gathering blocks to host"

    def __init__(self, weights: PackedWeights, context: StoreContext) -> None:
        super().__init__(weights, context)
        shards: ShardGroup = context.shards
        self.group, self.rank, self.world_size = shards.group, shards.rank, shards.world_size
        self.shard = {d: shard_numel(n, self.world_size) for d, n in weights.numel.items()}
        self.host: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def claims(cls, weights: PackedWeights, context: StoreContext) -> bool:
        return context.shards is not None

    @property
    def device_numel(self) -> dict[torch.dtype, int]:
        return {d: n * self.world_size for d, n in self.shard.items()}

    @property
    def host_bytes_per_dtype(self) -> dict[torch.dtype, int]:
        return {d: n * d.itemsize for d, n in self.shard.items()}  # what ``take`` allocates

    @property
    def host_nbytes(self) -> int:
        return sum(self.host_bytes_per_dtype.values())

    def held_leaf_bytes(self) -> int:
        total = 0
        for slot in self.weights.slots:
            start, end = shard_range(self.weights.numel[slot.dtype], self.world_size, self.rank)
            low, high = max(slot.offset, start), min(slot.offset + slot.numel, end)
            total += max(high - low, 0) * slot.dtype.itemsize
        return total

    def take(self, journal: Journal) -> None:
        """Copy this rank's slice of every tensor into its shard buffers (zero padding elsewhere); the tensors
        themselves are left as they are (the caller parks them)."""
        weights, host_memory = self.weights, self.context.host_memory
        originals = weights.tensors.current()
        journal.record(f"restore {weights.path}", lambda: weights.park(originals))
        self.host = {d: host_memory.allocate(n, d) for d, n in self.shard.items()}
        for buffer in self.host.values():
            buffer.zero_()
        # As in ``PackedWeights.pack``: slices on an accelerator go by DMA into buffers page-locked first.
        devices = {s.leaf.data().device for s in weights.slots} - {torch.device("cpu"), torch.device("meta")}
        direct = bool(devices) and host_memory.page_locked
        if direct:
            for buffer in self.host.values():
                host_memory.pin(buffer)
        sources = []
        for slot in weights.slots:
            start, end = shard_range(weights.numel[slot.dtype], self.world_size, self.rank)
            lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
            if lo < hi:
                source = slot.flat_source()[lo - slot.offset : hi - slot.offset]
                self.host[slot.dtype][lo - start : hi - start].copy_(source, non_blocking=direct)
                sources.append(source)
        if direct:  # ``sources`` keeps the device memory (and reshaped copies) alive until the copies are done
            for device in devices:
                torch.get_device_module(device).current_stream(device).synchronize()
        else:
            for buffer in self.host.values():
                host_memory.pin(buffer)

    def fill(self, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for, done) -> None:
        gather = getattr(transfers, "gather", None)
        if gather is None:
            raise TypeError(f"the shard store of {self.weights.path!r} needs the all-gather transport "
                            f"(transports.AllGatherTransfers), got {type(transfers).__name__}")
        gather([(shard, buffers[d].narrow(0, 0, shard.numel() * self.world_size)) for d, shard in self.host.items()],
               wait_for=wait_for, done=done)

    def host_views(self) -> list[torch.Tensor]:
        raise RuntimeError(self.host_views_refusal)

    def give_back(self) -> None:
        """Collective: every rank gathers the block (in the same block order) into full, ordinary host tensors."""
        device = self.context.device
        gathered = {}
        for dtype, shard in self.host.items():
            output = torch.empty(shard.numel() * self.world_size, dtype=dtype, device=device)
            own = output.narrow(0, self.rank * shard.numel(), shard.numel())
            own.copy_(shard)
            all_gather_bytes(output, own, self.group)
            gathered[dtype] = output
        self.weights.park([view.to("cpu", copy=True) for view in self.weights.views_into(gathered)], final=True)
        self.host = {}
