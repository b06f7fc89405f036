"""Resident DiT blocks that make room: the blocks a ``max_device_memory`` budget keeps on the device leave it for a
phase that does not fit beside them, and come back when their DiT runs again.

A budget sizes the resident set for the denoising loop. The VAE's phase comes after it, with the DiT's resident
blocks still on the device; at a large resolution the VAE's activations may not fit beside them (measured on an
H200: ``max_device_memory="auto"`` on a 12 GiB card). Every resident block keeps its packed host copy, so leaving is
exact and cheap: its tensors are rebound to the host copy and the device buffers are freed. Each DiT's entry hook
(``Phases.enter_stack``, or ``enter_resident_stack`` for a DiT whose every block is resident) copies them back
before its first block runs.
"""

from __future__ import annotations

from typing import Any

import torch

from .memory import PackedWeights, release_freed_device_memory


class ResidentBlocks:
    """The resident DiT blocks that may leave the device for a while (see the module's docstring)."""

    def __init__(self, weights: list[PackedWeights], device: torch.device, transfers: Any = None) -> None:
        self.weights = weights
        self.device = device
        self.transfers = transfers  # how kept blocks come back (their store fills them)
        # Streamed blocks that stay on the device (``headroom``): they leave and come back through their store.
        self.kept: list[Any] = []  # streamer.StreamedBlock
        self.away = False
        self.departures = 0  # how many times they left

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights) + sum(b.weights.nbytes for b in self.kept)

    def empty(self) -> bool:
        return not self.weights and not self.kept

    def leave(self) -> int:
        """Rebind every resident block to its host copy and free its device buffers; the bytes freed (0 when there
        is nothing to free: none resident, or away already)."""
        if self.away or self.empty():
            return 0
        for weights in self.weights:
            weights.park(weights.host_views)
        for block in self.kept:
            block.leave_device()
        self.away = True
        self.departures += 1
        release_freed_device_memory(self.device)
        return self.nbytes

    def drop(self, weights: list[PackedWeights]) -> None:
        """``weights`` are resident no more (they stream: ``oom_retry``); the others stay in this set."""
        gone = {id(w) for w in weights}
        self.weights = [w for w in self.weights if id(w) not in gone]
        self.kept = [b for b in self.kept if id(b.weights) not in gone]

    def come_back(self) -> None:
        """Copy the blocks back to fresh device buffers (on the current stream, ordered before the blocks run) and
        compute on them again. Nothing when they are on the device."""
        if not self.away:
            return
        # The segments the phase left cached go back first: the blocks get fresh ones, not pieces of the VAE's
        # (split segments are what leaves memory reserved but unusable near a card's size).
        release_freed_device_memory(self.device)
        for weights in self.weights:
            _, views = weights.device_buffers(self.device)
            for host, view in zip(weights.host_views, views):
                view.copy_(host, non_blocking=True)
            weights.bind(views)
        for block in self.kept:
            block.stay(self.transfers)
        self.away = False
