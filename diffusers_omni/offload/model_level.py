"""Model-level offload: only the running DiT or encoder group is on the device; VAEs stay resident.

Before an encoder runs, every DiT goes to the host; before a DiT runs, every encoder and every other DiT does
(Wan 2.2's two experts included). Each component's weights are packed once into flat (pinned) host buffers per
dtype. Onloading copies them into one fresh device buffer per dtype and rebinds the tensors to views of it;
offloading only rebinds the tensors to their host views, since weights do not change while offload is enabled.
Inputs and outputs are never moved, so Diffusers' ``_skip_keys`` do not apply.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..config.offload import OffloadStrategy, format_bytes
from ..utils.progress import byte_progress
from ..utils.journal import Journal
from .base import EnableStep, OffloadBackend
from .discovery import (
    DIT,
    ENCODER,
    Component,
    Topology,
    check_no_foreign_offload,
    check_no_self_rewriting_weights,
    check_topology,
    discover_components,
    named_tensors,
)
from .hooks import (
    EAGER_ONLY,
    MODEL_LEVEL_HOOK,
    ForwardLock,
    InstalledHooks,
    LockedCallbackHook,
    refresh_registry_caches,
    refuse_pickling,
)
from .memory import HostMemory, PackedWeights, release_freed_host_memory
from .tensors import move_tensors

logger = logging.getLogger("diffusers_omni")


class _Exclusive:
    """A DiT or encoder that is on the device only while it (or its group) runs."""

    def __init__(self, component: Component) -> None:
        self.component = component
        self.weights = PackedWeights(component.path, component.module)
        self.onloaded = False
        self._device_buffers: dict[torch.dtype, torch.Tensor] = {}

    @property
    def role(self) -> str:
        return self.component.role

    @torch.compiler.disable(reason=EAGER_ONLY)
    def onload(self, device: torch.device) -> None:
        with torch.inference_mode(False):
            self._device_buffers, views = self.weights.device_buffers(device)
        # Same stream as the compute that follows, so no event or host synchronisation is needed.
        for dtype, host in self.weights.host.items():
            self._device_buffers[dtype].copy_(host, non_blocking=True)
        self.weights.bind(views)
        self.onloaded = True

    @torch.compiler.disable(reason=EAGER_ONLY)
    def offload(self) -> None:
        self.weights.park(self.weights.host_views)
        self._device_buffers = {}
        self.onloaded = False


@dataclass
class ModelLevelStats:
    onloads: int = 0
    offloads: int = 0
    onloaded_bytes: int = 0
    host_memory_mode: str = ""


@dataclass
class _State:
    target: Any
    topology: Topology | None = None
    exclusives: list[_Exclusive] = field(default_factory=list)
    host_memory: HostMemory | None = None
    hooks: InstalledHooks = field(default_factory=InstalledHooks)
    stats: ModelLevelStats = field(default_factory=ModelLevelStats)
    # Held for each DiT's and encoder's whole forward: callers in several threads take turns (one would otherwise
    # offload the component another is computing with).
    lock: ForwardLock = field(default_factory=lambda: ForwardLock("model-level offload"))


class ModelLevelOffloadBackend(OffloadBackend):
    """Mutual exclusion between DiTs and encoders; VAEs and declared resident modules stay on the device."""

    strategy = OffloadStrategy.MODEL_LEVEL
    def __init__(self, config) -> None:
        super().__init__(config)
        self._state: _State | None = None

    def _enable_steps(self) -> Sequence[EnableStep]:
        return (self._discover, self._move_residents, self._pack_components, self._install_hooks,
                self._install_guards)

    @property
    def stats(self) -> ModelLevelStats:
        if self._state is None:
            raise RuntimeError("model-level offload is not enabled")
        return self._state.stats

    def onloaded(self) -> tuple[str, ...]:
        """Labels of the DiTs and encoders currently on the device."""
        if self._state is None:
            return ()
        return tuple(e.component.label for e in self._state.exclusives if e.onloaded)

    @contextlib.contextmanager
    def use(self, path: str) -> Iterator[nn.Module]:
        """Onload component ``path`` (and offload what conflicts with it) for code that is not its ``forward``,
        e.g. a method reading its weights directly."""
        if self._state is None:
            raise RuntimeError("model-level offload is not enabled")
        for exclusive in self._state.exclusives:
            if exclusive.component.path == path or exclusive.component.label == path:
                with self._state.lock:
                    self._activate(exclusive)
                    yield exclusive.component.module
                return
        resident = [c.label for c in self._state.topology.components if c.role not in (DIT, ENCODER)]
        if path in resident:
            yield next(c.module for c in self._state.topology.components if c.label == path)
            return
        known = [e.component.label for e in self._state.exclusives] + resident
        raise ValueError(f"use({path!r}): not a component of this offload; allowed: {known}")

    def _new_state(self, target: Any) -> _State:
        self._state = _State(target)
        return self._state

    def _forget(self) -> None:
        self._state = None

    def _managed_modules(self, state: _State) -> list[tuple[str, nn.Module]]:
        return [(e.component.label, e.component.module) for e in state.exclusives]

    def _install_guards(self, state: _State, journal: Journal) -> None:
        # Parked weights are host tensors; pipelines must still put these modules' inputs on the device: the base
        # class gives every component an OffloadSlotHint, an ExecutionDeviceHint (guards.py).
        super()._install_guards(state, journal)
        # Pickling or deep-copying the pipeline or a component raises a clear TypeError (see hooks.NO_PICKLE).
        refuse_pickling([state.target] + [c.module for c in state.topology.components], self._guards.set)

    def _discover(self, state: _State, journal: Journal) -> None:
        state.topology = discover_components(state.target, self.config.plan)
        check_topology(state.topology, allow_residents_inside=())
        check_no_foreign_offload(state.topology, "model-level")
        check_no_self_rewriting_weights(state.topology, self.device)
        state.exclusives = [_Exclusive(c) for c in state.topology.dits + state.topology.encoders]
        logger.info(
            "model-level offload: DiTs %s and encoders %s take turns on %s; %s stay resident",
            [c.label for c in state.topology.dits],
            [c.label for c in state.topology.encoders],
            self.device,
            [c.label for c in state.topology.vaes + state.topology.residents],
        )

    def _move_residents(self, state: _State, journal: Journal) -> None:
        for component in state.topology.vaes + state.topology.residents:
            journal.record(f"move {component.label}", move_tensors(component.module, self.device))

    def _pack_components(self, state: _State, journal: Journal) -> None:
        state.host_memory = host_memory = HostMemory(self.device, self.config.pin_memory)
        state.stats.host_memory_mode = host_memory.mode
        journal.record("release host memory", lambda: host_memory.release(self.device))
        clone = host_memory.needs_clone_on_release
        total = sum(exclusive.weights.nbytes for exclusive in state.exclusives)
        with byte_progress(total, "model-level offload: packing components", self.config.show_progress,
                           state.target) as bar:
            for exclusive in state.exclusives:
                weights = exclusive.weights
                # Recorded first: a pack that fails part-way has already rebound some tensors.
                journal.record(f"restore {weights.path}", lambda w=weights: w.undo_pack(clone))
                weights.pack(host_memory)
                bar.update(weights.nbytes)
                logger.info("model-level offload: %s packed on host (%s)", exclusive.component.label, format_bytes(weights.nbytes))
        release_freed_host_memory()

    def _install_hooks(self, state: _State, journal: Journal) -> None:
        journal.record("remove hooks", state.hooks.remove_all)
        for exclusive in state.exclusives:
            state.hooks.install(
                exclusive.component.module,
                LockedCallbackHook(state.lock, exclusive.component.label, before=partial(self._activate, exclusive)),
                MODEL_LEVEL_HOOK,
            )
        refresh_registry_caches([e.component.module for e in state.exclusives])

    @torch.compiler.disable(reason=EAGER_ONLY)
    def _activate(self, active: _Exclusive) -> None:
        state = self._state
        for other in state.exclusives:
            conflicts = other.role == DIT or active.role == DIT
            if other is not active and other.onloaded and conflicts:
                other.offload()
                state.stats.offloads += 1
        if not active.onloaded:
            active.onload(self.device)
            state.stats.onloads += 1
            state.stats.onloaded_bytes += active.weights.nbytes

    def _disable(self) -> None:
        state = self._state
        with state.lock:  # a forward running in another thread finishes first
            self._disable_locked(state)

    def _disable_locked(self, state: _State) -> None:
        if self.device.type != "cpu":
            torch.get_device_module(self.device).synchronize(self.device)
        state.hooks.remove_all()
        refresh_registry_caches([e.component.module for e in state.exclusives])
        clone = state.host_memory.needs_clone_on_release
        for exclusive in state.exclusives:
            exclusive.offload()
            exclusive.weights.restore(clone=clone, to_original_device=False)
        state.host_memory.release(self.device)
        logger.info("model-level offload disabled: DiTs and encoders are ordinary host tensors again")
