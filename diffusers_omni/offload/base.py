"""The lifecycle every offload backend shares: transactional ``enable``, idempotent ``disable``."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..config.offload import OffloadConfig, OffloadStrategy

logger = logging.getLogger("diffusers_omni")


class Journal:
    """Undo actions recorded while enabling; ``rollback`` runs them newest first."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def record(self, what: str, undo: Callable[[], None]) -> None:
        self._undo.append((what, undo))

    def rollback(self) -> None:
        while self._undo:
            what, undo = self._undo.pop()
            try:
                undo()
            except Exception:  # noqa: BLE001 - keep undoing the rest, report each failure
                logger.exception("offload: rollback step %r failed", what)

    def move_tensor(self, tensor: torch.Tensor, device: torch.device) -> None:
        """Rebind ``tensor`` to a copy on ``device``; rollback rebinds the original data."""
        if tensor.device == device:
            return
        original = tensor.data
        tensor.data = original.to(device)

        def undo() -> None:
            tensor.data = original

        self.record("move tensor", undo)


def resolve_device(device: torch.device) -> torch.device:
    """``cuda`` → ``cuda:<current>``; raises when the accelerator is missing."""
    if device.type == "cpu":
        return device
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if is_available is None or not is_available():
        raise ValueError(
            f"device={str(device)!r} is not available on this machine; allowed: an available accelerator, or "
            "'cpu' (runs the same offload logic with synchronous copies, for testing)"
        )
    if device.index is None:
        return torch.device(device.type, module.current_device())
    return device


class OffloadBackend(ABC):
    """One offload strategy applied to one pipeline or bare model.

    ``enable`` is transactional: if any stage fails, every hook it installed is removed and every tensor is
    rebound to its original device and values. ``disable`` is idempotent.
    """

    strategy: ClassVar[OffloadStrategy]
    # Names of the enable stages, in order; each is a method ``_stage_<name>(state, journal)``.
    stages: ClassVar[tuple[str, ...]]

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self._enabled = False

    @classmethod
    def for_config(cls, config: OffloadConfig) -> "OffloadBackend":
        """The backend serving ``config`` (a strategy with variants returns the variant's class)."""
        return cls(config)

    def enable(self, target: Any) -> "OffloadBackend":
        """Apply this strategy to ``target`` (a pipeline or a bare ``nn.Module``)."""
        if self._enabled:
            raise RuntimeError(f"{type(self).__name__} is already enabled; call disable() first")
        journal = Journal()
        state = self._new_state(target)
        # Buffers and views made here must be ordinary tensors even when called under inference_mode.
        with torch.inference_mode(False), torch.no_grad():
            try:
                for stage in self.stages:
                    getattr(self, f"_stage_{stage}")(state, journal)
            except BaseException:
                logger.info("offload: enabling %s failed; rolling back", self.strategy.value)
                journal.rollback()
                self._forget()
                raise
        self._enabled = True
        return self

    def disable(self) -> None:
        """Remove this backend's hooks and leave offloaded weights in ordinary host tensors. Modules the backend
        placed on the device stay there. Safe to call repeatedly."""
        if not self._enabled:
            return
        with torch.inference_mode(False), torch.no_grad():
            self._disable()
        self._forget()
        self._enabled = False

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def execution_device(self) -> torch.device:
        """Where the offloaded modules compute (latents and embeddings belong here)."""
        return self.device

    @abstractmethod
    def _new_state(self, target: Any) -> Any: ...

    @abstractmethod
    def _disable(self) -> None: ...

    @abstractmethod
    def _forget(self) -> None:
        """Drop every reference to the target (after disable or a failed enable)."""
