"""What a pipeline or model may do while omni offload is on.

Offload keeps its own copy of every managed weight (flat host buffers, device views, empty placeholders), so
Diffusers methods that change weights, dtypes or placement would desynchronise it. While a backend is enabled it
installs instance attributes on the pipeline and on every module it manages (removed exactly on ``disable``):

- methods that change weights or module structure (LoRA loading, fusing, layerwise casting, fused QKV) run with
  the offload *suspended*: it is disabled, the method runs on ordinary tensors, and the offload is enabled again
  with the same config (as Diffusers does for its group offloading around LoRA loading);
- other offloaders (``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``, ``enable_group_offload``) are
  refused before anything changes;
- ``.to()`` / ``half()`` / ``float()`` that would change a managed weight's dtype or device are refused before
  anything changes; moves that change nothing (the execution device, the current dtype) are allowed.

Every table below is data: a new method is one entry.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .discovery import OffloadConflictError

logger = logging.getLogger("diffusers_omni")

_MISSING = object()

# Methods that change weights or module structure: they run with the offload suspended.
SUSPENDING_METHODS: tuple[str, ...] = (
    # Diffusers pipelines (LoraBaseMixin and family loaders)
    "load_lora_weights",
    "unload_lora_weights",
    "fuse_lora",
    "unfuse_lora",
    "delete_adapters",
    "fuse_qkv_projections",
    "unfuse_qkv_projections",
    # Diffusers models (PeftAdapterMixin, AttentionMixin, ModelMixin)
    "load_lora_adapter",
    "add_adapter",
    "unload_lora",
    "enable_layerwise_casting",
    # transformers models (PEFT integration)
    "load_adapter",
    "delete_adapter",
)

# Other offloaders: refused, with the way out.
FOREIGN_OFFLOADERS: dict[str, str] = {
    "enable_model_cpu_offload": "Diffusers' model CPU offload (omni's counterpart: model_level)",
    "enable_sequential_cpu_offload": "Diffusers' sequential CPU offload (omni's counterpart: layerwise)",
    "enable_group_offload": "Diffusers' group offloading (omni's counterpart: layerwise)",
}


class OffloadActiveError(RuntimeError):
    """The pipeline or model cannot do this while omni offload is enabled; nothing was changed."""


class Guards:
    """Instance attributes (and other reversible changes) installed while offload is on; ``remove_all`` restores
    every ``__dict__`` exactly."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        before = obj.__dict__.get(name, _MISSING)
        obj.__dict__[name] = value

        def undo() -> None:
            if before is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = before

        self._undo.append(undo)

    def on_remove(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def remove_all(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __len__(self) -> int:
        return len(self._undo)


def conversion_changes(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """``"float32 on cpu → float64 on cpu"`` for each (dtype, device) of ``module``'s tensors that ``fn`` (what
    ``nn.Module._apply`` would apply) changes; empty when it changes nothing. Probes zero-element tensors."""
    kinds = {(t.dtype, t.device) for t in list(module.parameters()) + list(module.buffers()) if t is not None}
    changes = []
    for dtype, device in sorted(kinds, key=str):
        probe = torch.empty(0, dtype=dtype, device=device)
        result = fn(probe)
        if result.dtype != dtype or result.device != device:
            changes.append(f"{str(dtype).removeprefix('torch.')} on {device} → "
                           f"{str(result.dtype).removeprefix('torch.')} on {result.device}")
    return changes


def pipeline_to_conversion(args: tuple, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-tensor conversion ``DiffusionPipeline.to(*args, **kwargs)`` applies to each module."""
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    device = kwargs.get("device")
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, (str, torch.device, int)):
            device = arg

    def convert(t: torch.Tensor) -> torch.Tensor:
        floating = t.is_floating_point() or t.is_complex()
        return t.to(device=device, dtype=dtype if floating else None)

    return convert


def _call_text(owner: str, name: str, args: tuple, kwargs: dict) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    text = ", ".join(shown)
    return f"{owner}.{name}({text if len(text) <= 80 else text[:77] + '...'})"


class GuardInstaller:
    """Installs the guards of one enabled backend.

    Args:
        strategy: the backend's strategy name (``"layerwise"``...), for messages.
        suspend: a context manager factory that disables the backend and enables it again (``None`` where that is
            not possible, e.g. collective backends: those methods are refused instead).
        way_out: how the user disables this offload (``"pipe.disable_omni_offload()"``).
        guards: where the changes are recorded.
    """

    def __init__(self, strategy: str, suspend: Callable[[str], Any] | None, way_out: str, guards: Guards,
                 suspend_refusal: str = "") -> None:
        self.strategy = strategy
        self.suspend = suspend
        self.way_out = way_out
        self.guards = guards
        self.suspend_refusal = suspend_refusal

    # Pipeline ---------------------------------------------------------------------------------------------

    def guard_pipeline(self, pipe: Any, managed: list[tuple[str, nn.Module]]) -> None:
        self._guard_methods(pipe, "pipe")
        original_to = getattr(pipe, "to", None)
        if original_to is not None:
            self.guards.set(pipe, "to", self._pipeline_to(pipe, original_to, managed))

    def _pipeline_to(self, pipe: Any, original: Callable, managed: list[tuple[str, nn.Module]]) -> Callable:
        @functools.wraps(original)
        def to(*args: Any, **kwargs: Any) -> Any:
            convert = pipeline_to_conversion(args, kwargs)
            found = [(label, c) for label, module in managed for c in conversion_changes(module, convert)]
            if found:
                call = _call_text("pipe", "to", args, kwargs)
                self._refuse_move(call, found, call)
            return original(*args, **kwargs)

        return to

    # Modules ----------------------------------------------------------------------------------------------

    def guard_module(self, label: str, module: nn.Module, owner: str) -> None:
        """Guard ``module`` (called ``label`` in messages, reached as ``owner`` in user code, e.g.
        ``pipe.transformer``)."""
        self._guard_methods(module, owner)
        self.guards.set(module, "_apply", self._module_apply(label, module, owner))

    def _module_apply(self, label: str, module: nn.Module, owner: str) -> Callable:
        def _apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
            found = [(label, c) for c in conversion_changes(module, fn)]
            if found:
                self._refuse_move(f"{owner}.to(...) (or .half(), .float(), .cuda(), ...)", found, f"{owner}.to(...)")
            return module  # nothing would change: every managed tensor already has that dtype and device

        return _apply

    def _refuse_move(self, call: str, found: list[tuple[str, str]], redo: str) -> None:
        shown = "; ".join(f"{label}: {change}" for label, change in found[:4])
        more = f" (and {len(found) - 4} more)" if len(found) > 4 else ""
        raise OffloadActiveError(
            f"{call} while {self.strategy} offload is enabled would change managed weights ({shown}{more}); the "
            f"offload keeps its own host copies in their current dtypes and places every weight itself, so nothing "
            f"was changed. Allowed: {self.way_out}, then {redo}, then enable the offload again; or a .to() that "
            "changes nothing (the offload device, the current dtype)"
        )

    # Methods ----------------------------------------------------------------------------------------------

    def _guard_methods(self, obj: Any, owner: str) -> None:
        cls = type(obj)
        for name, what in FOREIGN_OFFLOADERS.items():
            if hasattr(cls, name):
                self.guards.set(obj, name, self._refusing(obj, owner, name, what))
        for name in SUSPENDING_METHODS:
            if hasattr(cls, name):
                self.guards.set(obj, name, self._suspending(obj, owner, name))

    def _refusing(self, obj: Any, owner: str, name: str, what: str) -> Callable:
        original = getattr(obj, name)

        @functools.wraps(original)
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise OffloadConflictError(
                f"{_call_text(owner, name, args, kwargs)}: {what} cannot run while diffusers-omni {self.strategy} "
                f"offload is enabled (both would place the same weights); nothing was changed. Use one: "
                f"{self.way_out} first, then {owner}.{name}(...); or keep omni's offload"
            )

        return refuse

    def _suspending(self, obj: Any, owner: str, name: str) -> Callable:
        original = getattr(obj, name)

        @functools.wraps(original)
        def suspended(*args: Any, **kwargs: Any) -> Any:
            call = _call_text(owner, name, args, kwargs)
            if self.suspend is None:
                raise OffloadActiveError(
                    f"{call} changes weights, which {self.strategy} offload cannot follow while enabled "
                    f"({self.suspend_refusal}); nothing was changed. Allowed: {self.way_out}, then {owner}.{name}"
                    "(...), then enable the offload again"
                )
            with self.suspend(call):
                return original(*args, **kwargs)

        return suspended
