"""Phases: weights that are on the device only while their component runs (encoders' non-block weights, VAEs).

A ``PhaseUnit`` is one component's packed weights outside any streamed block. ``Phases`` moves them: a phase starts
when a component (or a DiT's stack) is entered, parks the other phases' units, frees other stacks' prefetched
blocks, and brings the unit in; an encoder's unit leaves when its forward returns, a VAE's when another phase
starts or the pipeline call ends.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
import torch.nn as nn

from .hooks import EAGER_ONLY
from .memory import PackedWeights
from .stats import LayerwiseStats
from .residents import ResidentBlocks
from .streamer import StreamedBlock, Streamer


class PhaseUnit:
    """Weights of one component that are on the device only for its phase: an encoder's weights outside its blocks
    (embeddings, final norm, LM head) while the encoder runs, or a whole VAE (or an encoder without blocks) from its
    first use until another phase starts or the pipeline call ends. Onloading copies the packed host copy into one
    fresh device buffer per dtype on the compute stream (no event needed) and rebinds the tensors to views of it;
    parking rebinds them to their host views and drops the device buffers (weights do not change while offload is
    enabled)."""

    def __init__(self, label: str, module: nn.Module, weights: PackedWeights, per_call: bool) -> None:
        self.label = label
        self.module = module
        self.weights = weights
        self.per_call = per_call  # parked when its component's forward returns (an encoder), else when replaced
        self.onloaded = False
        self.resident = False  # the budget keeps it on the device for good
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def onload(self, device: torch.device) -> None:
        with torch.inference_mode(False):
            self._buffers, views = self.weights.device_buffers(device)
            for dtype, host in self.weights.host.items():
                self._buffers[dtype].narrow(0, 0, host.numel()).copy_(host, non_blocking=True)
            self.weights.bind(views)
        self.onloaded = True

    def park(self) -> None:
        with torch.inference_mode(False):
            self.weights.park(self.weights.host_views)
        self._buffers = {}
        self.onloaded = False


class Phases:
    """Moves the phase units of one enabled offload; every method runs under the offload's forward lock."""

    def __init__(self, units: list[PhaseUnit], streamer: Streamer | None, device: torch.device,
                 stats: LayerwiseStats, lock: Any, residents: ResidentBlocks | None = None) -> None:
        self.units = units
        self.streamer = streamer
        self.device = device
        self.stats = stats
        self.lock = lock
        self.residents = residents  # resident DiT blocks that may leave for a phase that needs their room
        self.room_needed: set[str] = set()  # encoders that ran out of memory beside them (``oom_retry.PhaseRetry``)
        # headroom.Headroom under "auto", by weak reference (it refers to the offload's state, which refers to this
        # object): an encoder that runs out of memory lowers its ceiling
        self.headroom: Callable[[], Any] | None = None
        self.lowered_for: set[str] = set()  # encoders that did so (warned once)
        self.active = True  # False once disabled: a late call of a guard's on-use callback does nothing

    def make_room(self) -> int:
        """The resident DiT blocks leave the device (under the forward lock: no DiT is running on them); the bytes
        freed, 0 when there are none or they are away already. They come back when a DiT runs."""
        if self.residents is None or not self.active:
            return 0
        with self.lock:
            freed = self.residents.leave()
        if freed:
            self.stats.residents_left += 1
            self.stats.residents_left_bytes = freed
        return freed

    @torch.compiler.disable(reason=EAGER_ONLY)
    def enter(self, unit: PhaseUnit | None, own: frozenset[int] = frozenset()) -> None:
        """A phase starts: units of other phases go back to the host, in-flight blocks of other stacks are freed,
        and ``unit`` (``None``: a DiT's phase) comes onto the device."""
        for other in self.units:
            if other is not unit and other.onloaded and not other.resident:
                other.park()
        if self.streamer is not None:
            self.streamer.release_idle(own)
        if unit is not None and not unit.onloaded:
            unit.onload(self.device)
            self.stats.phase_onloads += 1
            self.stats.phase_onloaded_bytes += unit.weights.nbytes

    @torch.compiler.disable(reason=EAGER_ONLY)
    def leave(self, unit: PhaseUnit | None) -> None:
        if unit is not None and unit.onloaded and not unit.resident:
            unit.park()

    def enter_stack(self, ring: list[StreamedBlock], first: tuple[StreamedBlock, ...], own: frozenset[int]) -> None:
        """A DiT's forward starts. Blocks another stack prefetched and did not run are freed (with or without
        phase units): left in the window, they would keep its room until evicted, and every block of this stack
        would load on demand. Resident blocks that left for another phase come back first."""
        if self.residents is not None:
            self.residents.come_back()
        if self.units:
            self.enter(None, own)
        self.streamer.enter_stack(ring, first, own)

    def enter_resident_stack(self, unit: PhaseUnit | None) -> None:
        """A DiT whose every block is resident starts: its blocks come back if they left, its non-block unit
        (``None``: resident too) comes in."""
        if self.residents is not None:
            self.residents.come_back()
        if unit is not None:
            self.enter(unit)

    def enter_encoder(self, unit: PhaseUnit | None, ring: list[StreamedBlock], first: tuple[StreamedBlock, ...],
                      own: frozenset[int]) -> None:
        """An encoder with streamed blocks starts: its non-block unit comes in with its first blocks."""
        self.enter(None if unit is None or unit.resident else unit, own)
        self.streamer.enter_stack(ring, first)

    def on_use(self, module: nn.Module) -> Callable[[], None] | None:
        """What must run before a method of component ``module`` other than ``forward`` computes (a VAE's
        ``encode``/``decode``): its unit comes in. ``None``: nothing."""
        for unit in self.units:
            if unit.module is module and not unit.per_call and not unit.resident:
                return partial(self.use, unit)
        return None

    def use(self, unit: PhaseUnit) -> None:
        if not self.active:
            return
        with self.lock:
            self.enter(unit)

    def end_of_call(self) -> None:
        """The pipeline call returned: the last phase's unit (the VAE) and prefetched blocks leave the device."""
        if not self.active or not self.units:
            return
        with self.lock:
            self.enter(None)

    def park_all(self) -> None:
        """Disable: every unit back to its host copy."""
        self.active = False
        for unit in self.units:
            if unit.onloaded:
                unit.park()
