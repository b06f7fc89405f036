"""The lifecycle every offload backend shares: transactional ``enable``, idempotent ``disable``."""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from ..config.offload import OffloadConfig
from ..utils.journal import Journal
from .guards import GuardInstaller, describe_owner, install_group_offloading_check

logger = logging.getLogger("diffusers_omni")

# One step of an enable: it changes the target and records on the journal how to undo that.
EnableStep = Callable[[Any, Journal], None]


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

    ``enable`` is transactional: if any step fails, every hook it installed is removed and every tensor is
    rebound to its original device and values. ``disable`` is idempotent.
    """

    # The registered name of the strategy served (an ``OffloadStrategy`` for the built-in ones).
    strategy: ClassVar[str]

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self._enabled = False
        self._target: Any = None
        self._guards = Journal("offload guards")
        self._members: list[tuple[str, torch.nn.Module, bool]] = []

    @classmethod
    def for_config(cls, config: OffloadConfig) -> "OffloadBackend":
        """The backend serving ``config`` (a strategy with variants returns the variant's class)."""
        return cls(config)

    def enable(self, target: Any) -> "OffloadBackend":
        """Apply this strategy to ``target`` (a pipeline or a bare ``nn.Module``)."""
        if self._enabled:
            raise RuntimeError(f"{type(self).__name__} is already enabled; call disable() first")
        journal = Journal("offload")
        state = self._new_state(target)
        self._guards = Journal("offload guards")
        # Buffers and views made here must be ordinary tensors even when called under inference_mode.
        with torch.inference_mode(False), torch.no_grad():
            try:
                for step in self._enable_steps():
                    step(state, journal)
            except BaseException:
                logger.info("offload: enabling %s failed; rolling back", self.strategy)
                journal.rollback()
                self._members = []
                self._forget()
                raise
        self._enabled = True
        self._target = target
        return self

    def disable(self) -> None:
        """Remove this backend's hooks and leave offloaded weights in ordinary host tensors. Modules the backend
        placed on the device stay there. Safe to call repeatedly."""
        if not self._enabled:
            return
        with torch.inference_mode(False), torch.no_grad():
            self._prepare_disable()  # may refuse: then nothing changed and the offload stays enabled
        self._guards.rollback()
        with torch.inference_mode(False), torch.no_grad():
            self._disable()
        self._forget()
        self._members = []
        self._enabled = False
        self._target = None

    @contextlib.contextmanager
    def suspended(self, reason: str = "") -> Iterator[None]:
        """Disable the offload for the body (weights are ordinary host tensors, modules may change) and enable it
        again on the same target with the same config afterwards, also when the body raises.

        Example:
        ```py
        >>> with backend.suspended():
        ...     pipe.load_lora_weights(path)  # what the guarded LoRA methods do for you
        ```
        """
        if not self._enabled:
            yield
            return
        target = self._target
        logger.info("offload: %s runs with %s offload suspended (disabled, then enabled again)", reason or "code",
                    self.strategy)
        self.disable()
        try:
            yield
        finally:
            self.enable(target)

    # Guards (see guards.py) ---------------------------------------------------------------------------------

    def _install_guards(self, state: Any, journal: Journal) -> None:
        """The enable step that guards every component the offload placed (see guards.py)."""
        guards = self._guards
        journal.record("remove guards", guards.rollback)
        installer = self._guard_installer(state, guards)
        managed = self._managed_modules(state)
        managed_ids = {id(module) for _, module in managed}
        topology = getattr(state, "topology", None)
        # Components the offload placed without holding their weights (VAEs, layerwise's encoders, residents): they
        # carry the offload too, so every route from any pipeline object sharing them meets a guard.
        placed = [(c.label, c.module) for c in (topology.components if topology is not None else ())
                  if id(c.module) not in managed_ids]
        target = state.target
        pipeline = not isinstance(target, torch.nn.Module)
        if pipeline:
            installer.guard_pipeline(target, managed)
        members = [(label, module, True) for label, module in managed] + [(l, m, False) for l, m in placed]
        for label, module, holds_weights in members:
            owner = f"pipe.{label}" if pipeline else "model" if module is target else label
            installer.guard_module(label, module, owner, managed=holds_weights, on_use=self._on_use(state, module))
        self._members = members
        install_group_offloading_check()

    def end_of_call(self) -> None:
        """A pipeline call using this offload returned (called by the Omni pipelines' call wrapper): what is on the
        device only for a phase of the call may leave. Nothing, unless a strategy keeps phases."""

    def _on_use(self, state: Any, module: torch.nn.Module) -> Callable[[], None] | None:
        """What must run before a method of component ``module`` other than ``forward`` computes (Diffusers calls
        ``_hf_hook.pre_forward`` first in the methods it decorates with ``apply_forward_hook``: a VAE's ``encode``
        and ``decode``); ``None``: nothing."""
        return None

    def _guard_installer(self, state: Any, guards: Journal) -> GuardInstaller:
        pipeline = not isinstance(state.target, torch.nn.Module)
        way_out = "pipe.disable_omni_offload()" if pipeline else "backend.disable()"
        return GuardInstaller(str(self.strategy), self.suspended, way_out, guards, device=self.device, backend=self)

    def members(self) -> list[tuple[str, torch.nn.Module, bool]]:
        """``(label, module, managed)`` for every component this enabled backend placed; ``managed``: it holds
        copies of the module's weights (else it only placed it on the device). Empty while disabled."""
        return list(self._members)

    @property
    def target(self) -> Any:
        """The pipeline or model this backend is enabled on (``None`` while disabled)."""
        return self._target

    def owner(self) -> str:
        """The object this backend was enabled on, for messages (``"OmniFluxPipeline at 0x7f…"``)."""
        return describe_owner(self)

    @abstractmethod
    def _managed_modules(self, state: Any) -> list[tuple[str, torch.nn.Module]]:
        """(label, module) of every module whose weights this backend holds copies of."""

    def is_enabled(self) -> bool:
        return self._enabled

    def __repr__(self) -> str:
        state = "enabled" if self._enabled else "disabled"
        return f"{type(self).__name__}(strategy={str(self.strategy)!r}, device={str(self.device)!r}, {state})"

    @property
    def execution_device(self) -> torch.device:
        """Where the offloaded modules compute (latents and embeddings belong here)."""
        return self.device

    @abstractmethod
    def _enable_steps(self) -> Sequence[EnableStep]:
        """The steps of ``enable``, in order, each ``step(state, journal)``; a failing step rolls back the journal."""

    @abstractmethod
    def _new_state(self, target: Any) -> Any: ...

    def _prepare_disable(self) -> None:
        """Get what ``disable`` needs that may fail (a block read back from its files, say) before anything is
        undone; raising refuses the disable and leaves the offload enabled and consistent. Nothing by default."""

    @abstractmethod
    def _disable(self) -> None: ...

    @abstractmethod
    def _forget(self) -> None:
        """Drop every reference to the target (after disable or a failed enable)."""
