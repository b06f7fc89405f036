"""The default store: the block's host copy in the offload's (pinned) host memory, copied to the device."""

from __future__ import annotations

import torch

from ...utils.journal import Journal
from ..memory import PackedWeights, Transfers
from .base import BlockStore, StoreContext, register_store


@register_store
class PinnedStore(BlockStore):
    """The block's tensors packed into flat per-dtype host buffers (page-locked in place where the device allows,
    see ``memory.HostMemory``); a load is one copy per dtype on the copy stream. Claims every block: it is what
    the planner falls back to."""

    name = "pinned"
    priority = -100
    uses_offload_host_memory = True
    can_stay = True

    def __init__(self, weights: PackedWeights, context: StoreContext) -> None:
        super().__init__(weights, context)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._buffers: dict[torch.dtype, torch.Tensor] | None = None

    @classmethod
    def claims(cls, weights: PackedWeights, context: StoreContext) -> bool:
        return True

    def take(self, journal: Journal) -> None:
        weights, clone = self.weights, self.context.clone_on_release
        # Recorded first: a pack that fails part-way has already rebound some tensors.
        journal.record(f"restore {weights.path}", lambda: weights.undo_pack(clone))
        weights.pack(self.context.host_memory, self.context.release)

    def fill(self, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for, done) -> None:
        if self._buffers is not buffers:  # made once: a block's device buffers are the same objects every load
            self._pairs = [(host, buffers[dtype].narrow(0, 0, host.numel()))
                           for dtype, host in self.weights.host.items()]
            self._buffers = buffers
        transfers.copy(self._pairs, wait_for=wait_for, done=done)

    def host_views(self) -> list[torch.Tensor]:
        return self.weights.host_views

    def give_back(self) -> None:
        self.weights.restore(clone=self.context.clone_on_release, to_original_device=False)
