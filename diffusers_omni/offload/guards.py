"""What a pipeline or model may do while omni offload is on, whichever object it is reached through.

Offload keeps its own copy of every managed weight (flat host buffers, device views, empty placeholders), so
Diffusers methods that change weights, dtypes or placement would desynchronise it. The offload belongs to the
*components*, not to the pipeline object it was enabled on: ``omnify`` shares components with the user's Diffusers
pipeline, ``from_pipe`` and ``Pipeline(**pipe.components)`` build more objects around the same modules. So while a
backend is enabled it installs instance attributes on every component it placed (DiTs, encoders, VAEs, declared
residents) as well as on the pipeline, and every route reaches a guard whatever object it starts from (all removed
exactly on ``disable``):

- each component carries a ``Membership`` (``_omni_offload``): any pipeline sharing it finds the offload
  (``offload_backends``), adopts it (enabling the same config again) or disables it
  (``diffusers_omni.disable_offload(pipe_or_module)``, ``disable_omni_offload()`` on any Omni pipeline);
- methods that change weights or module structure (LoRA loading, fusing, layerwise casting, fused QKV), on the
  pipeline and on the modules whose weights offload holds, run with the offload *suspended*: it is disabled, the
  method runs on ordinary tensors, and the offload is enabled again with the same config (as Diffusers does for its
  group offloading around LoRA loading);
- other offloaders are refused before anything changes, on every route: the ``enable_*offload`` methods of the
  pipeline and of each component; Accelerate (each component's ``_hf_hook`` slot holds an ``OffloadSlotHint``
  whose ``detach_hook`` refuses, and ``cpu_offload``, ``cpu_offload_with_hook``, ``remove_all_hooks``, hence
  ``enable_model_cpu_offload`` and ``enable_sequential_cpu_offload`` on any pipeline object, all detach the
  existing hook before touching anything); Diffusers' ``apply_group_offloading`` (its own check for other
  offloaders, ``_raise_error_if_accelerate_model_or_sequential_hook_present``, also checks for ours);
- ``.to()`` / ``half()`` / ``float()`` / ``cuda()``: a dtype cast *works* (the offload is suspended around it, so
  the host copies are re-packed in the new dtype: bitwise what casting the resident weights gives); a device move
  is allowed to where a tensor already is or to the offload device and refused anywhere else. Every component
  applies the same device rule, so a pipeline-wide ``.to()`` from any pipeline object (its loop moves one component
  after another) is refused at the first component before any has changed. Collective backends cannot suspend on
  one rank: there every component refuses a cast.

Every table below is data: a new method is one entry.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..utils.journal import Journal
from .discovery import OffloadConflictError
from .hooks import ExecutionDeviceHint

logger = logging.getLogger("diffusers_omni")


# Instance attribute naming the offload a component belongs to.
MEMBERSHIP_ATTR = "_omni_offload"

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


@dataclass(frozen=True)
class Membership:
    """What an enabled offload left on one of its components (instance attribute ``_omni_offload``).

    ``managed``: the offload holds copies of the component's weights (DiTs; encoders under model-level); otherwise
    it only placed the component on the device (VAEs; encoders under layerwise; residents).
    """

    backend: Any  # the OffloadBackend (base.py imports this module, not the reverse)
    label: str
    managed: bool
    installer: "GuardInstaller"


def memberships(obj: Any) -> list[tuple[str, nn.Module, Membership]]:
    """``(name, module, membership)`` for every module of ``obj`` that an enabled offload placed: a pipeline's
    components (any pipeline object sharing them), or a module and its submodules."""
    if isinstance(obj, nn.Module):
        named = list(obj.named_modules())
    else:
        components = getattr(obj, "components", None)
        if not isinstance(components, dict):
            raise TypeError(
                f"expected a pipeline (an object with a components dict) or a torch.nn.Module, got "
                f"{type(obj).__name__}"
            )
        named = [(name, m) for name, m in components.items() if isinstance(m, nn.Module)]
    found = []
    for name, module in named:
        membership = module.__dict__.get(MEMBERSHIP_ATTR)
        if isinstance(membership, Membership) and membership.backend.is_enabled():
            found.append((name, module, membership))
    return found


def offload_backends(obj: Any) -> list[Any]:
    """The enabled offload backends placing any component of ``obj`` (a pipeline or a module), in component
    order; normally one."""
    backends: list[Any] = []
    for _, _, membership in memberships(obj):
        if not any(b is membership.backend for b in backends):
            backends.append(membership.backend)
    return backends


def describe_owner(backend: Any) -> str:
    """``"OmniFluxPipeline at 0x7f…"``: the object ``backend`` was enabled on."""
    target = backend.target
    return f"{type(target).__name__} at {id(target):#x}"


class OffloadSlotHint(ExecutionDeviceHint):
    """The ``_hf_hook`` of every component an enabled offload placed: answers Diffusers' execution-device question
    (see ``ExecutionDeviceHint``) and refuses to be detached. Accelerate detaches a module's existing hook before it
    changes anything (``cpu_offload``, ``cpu_offload_with_hook``, ``remove_hook_from_module``; Diffusers'
    ``enable_model_cpu_offload``, ``enable_sequential_cpu_offload`` and ``remove_all_hooks`` go through them), so
    those are refused with nothing changed, from whichever object they are called."""

    def __init__(self, execution_device: Any, label: str, strategy: str, way_out: str) -> None:
        super().__init__(execution_device)
        self.label = label
        self.strategy = strategy
        self.way_out = way_out

    def detach_hook(self, module: nn.Module) -> nn.Module:
        raise OffloadConflictError(
            f"Accelerate cannot remove or replace the hook of {self.label!r} (accelerate.cpu_offload, "
            "cpu_offload_with_hook, remove_hook_from_module; Diffusers' enable_model_cpu_offload, "
            f"enable_sequential_cpu_offload and remove_all_hooks do): diffusers-omni {self.strategy} offload "
            "places that module, whichever pipeline object the call came from (both would place the same weights); "
            f"nothing was changed. Use one: {self.way_out} first (or diffusers_omni.disable_offload(pipe) from any "
            "pipeline sharing the component), then the Accelerate offload; or keep omni's offload"
        )


class PhaseSlotHint(OffloadSlotHint):
    """``OffloadSlotHint`` of a component the offload brings onto the device for its phase (a VAE): Diffusers'
    ``apply_forward_hook`` (on a VAE's ``encode``, ``decode`` and their tiled variants) calls ``pre_forward`` before
    the method runs, which brings the weights in (``on_use``) wherever the method reads them first."""

    def __init__(self, execution_device: Any, label: str, strategy: str, way_out: str,
                 on_use: Callable[[], None]) -> None:
        super().__init__(execution_device, label, strategy, way_out)
        self.on_use = on_use

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.on_use()
        return args, kwargs


def install_group_offloading_check() -> bool:
    """Teach Diffusers' ``apply_group_offloading`` about omni offload: its check for other offloaders
    (``_raise_error_if_accelerate_model_or_sequential_hook_present``, called before it changes anything, looked up
    at call time) also refuses a module an enabled omni offload placed. Installed once; for a module no omni
    offload placed it runs Diffusers' check unchanged. Returns whether the check is in place."""
    try:
        from diffusers.hooks import group_offloading
    except ImportError:  # pragma: no cover - Diffusers is a dependency
        return False
    name = "_raise_error_if_accelerate_model_or_sequential_hook_present"
    original = getattr(group_offloading, name, None)
    if original is None:
        logger.warning("diffusers.hooks.group_offloading.%s is gone: apply_group_offloading(module) on a module under "
                       "omni offload is not refused in this Diffusers version", name)
        return False
    if getattr(original, "_omni_checks_offload", False):
        return True

    @functools.wraps(original)
    def check(module: nn.Module) -> None:
        found = memberships(module)
        if found:
            where, _, membership = found[0]
            label = membership.label if not where else f"{membership.label} (module {where!r})"
            raise OffloadConflictError(
                f"apply_group_offloading({type(module).__name__}): Diffusers' group offloading cannot run on {label} "
                f"while diffusers-omni {membership.backend.strategy} offload places it (both would place the "
                f"same weights); nothing was changed. Use one: {membership.installer.way_out} first (or "
                "diffusers_omni.disable_offload(module)), then the group offloading; or keep omni's offload"
            )
        return original(module)

    check._omni_checks_offload = True  # type: ignore[attr-defined]
    setattr(group_offloading, name, check)
    return True


def conversion_changes(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """``"float32 on cpu → float64 on cpu"`` for each (dtype, device) of ``module``'s tensors that ``fn`` (what
    ``nn.Module._apply`` would apply) changes; empty when it changes nothing. Probes zero-element tensors."""
    moves, casts, _ = classify_conversion(module, fn, None)
    return sorted(set(moves) | set(casts))


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def classify_conversion(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], allowed_device: torch.device | None
) -> tuple[list[str], list[str], dict[torch.dtype, torch.dtype]]:
    """What ``fn`` (the per-tensor conversion ``nn.Module._apply`` would apply) does to ``module``'s tensors, by
    probing a zero-element tensor of each (dtype, device) present: the moves to a device other than the tensor's
    own and ``allowed_device``, the casts (each ``"float32 on cpu → float64 on cpu"``), and dtype → new dtype."""
    kinds = {(t.dtype, t.device) for t in list(module.parameters()) + list(module.buffers()) if t is not None}
    moves: list[str] = []
    casts: list[str] = []
    dtype_map: dict[torch.dtype, torch.dtype] = {}
    for dtype, device in sorted(kinds, key=str):
        result = fn(torch.empty(0, dtype=dtype, device=device))
        text = f"{_dtype_text(dtype)} on {device} → {_dtype_text(result.dtype)} on {result.device}"
        if result.device != device and result.device != allowed_device:
            moves.append(text)
        if result.dtype != dtype:
            casts.append(text)
            dtype_map[dtype] = result.dtype
    return moves, casts, dtype_map


def _cast_only(dtype_map: dict[torch.dtype, torch.dtype]) -> Callable[[torch.Tensor], torch.Tensor]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        target = dtype_map.get(t.dtype)
        return t if target is None else t.to(dtype=target)

    return cast


def split_to_arguments(args: tuple, kwargs: dict) -> tuple[Any, torch.dtype | None, dict]:
    """``(device, dtype, other keyword arguments)`` of ``DiffusionPipeline.to(*args, **kwargs)``."""
    rest = dict(kwargs)
    dtype = rest.pop("dtype", None)
    torch_dtype = rest.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else torch_dtype
    device = rest.pop("device", None)
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif arg is not None:
            device = arg
    return device, dtype, rest


def pipeline_to_conversion(args: tuple, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-tensor conversion ``DiffusionPipeline.to(*args, **kwargs)`` applies to each module."""
    device, dtype, _ = split_to_arguments(args, kwargs)

    def convert(t: torch.Tensor) -> torch.Tensor:
        floating = t.is_floating_point() or t.is_complex()
        return t.to(device=device, dtype=dtype if floating else None)

    return convert


def _call_text(owner: str, name: str, args: tuple, kwargs: dict) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    text = ", ".join(shown)
    return f"{owner}.{name}({text if len(text) <= 80 else text[:77] + '...'})"


def offloaded_pipeline_to(pipe: Any, original_to: Callable, args: tuple, kwargs: dict) -> Any:
    """``pipe.to(*args, **kwargs)`` for a pipeline (any object) sharing components an enabled offload placed.

    Every component is checked before any changes: a device move refused for any of them is refused for the call.
    A cast of managed weights runs once, with each offload suspended around the whole cast (its host copies are
    re-packed in the new dtype when it is enabled again); the device part follows (it moves nothing the offload
    places). Without such components this is ``original_to`` itself."""
    found = memberships(pipe)
    if not found:
        return original_to(*args, **kwargs)
    convert = pipeline_to_conversion(args, kwargs)
    call = _call_text("pipe", "to", args, kwargs)
    refused: list[tuple[str, str]] = []
    suspend: list[GuardInstaller] = []
    for _, module, membership in found:
        installer = membership.installer
        moves, casts, _ = classify_conversion(module, convert, installer.device)
        refused += [(membership.label, change) for change in moves]
        if casts and installer.suspend is None:
            installer.refuse_cast(call, [(membership.label, change) for change in casts], call)
        if casts and membership.managed and not any(i.backend is installer.backend for i in suspend):
            suspend.append(installer)
    if refused:
        found[0][2].installer.refuse_move(call, refused, call)
    if not suspend:
        return original_to(*args, **kwargs)
    device, dtype, rest = split_to_arguments(args, kwargs)
    with contextlib.ExitStack() as stack:
        for installer in suspend:
            stack.enter_context(installer.suspend(call))
        original_to(dtype=dtype, **rest)
    if device is not None:
        original_to(device=device, **rest)
    return pipe


class GuardInstaller:
    """Installs the guards of one enabled backend.

    Args:
        strategy: the backend's strategy name (``"layerwise"``...), for messages.
        suspend: a context manager factory that disables the backend and enables it again (``None`` where that is
            not possible, e.g. collective backends: those methods and casts are refused instead).
        way_out: how the user disables this offload (``"pipe.disable_omni_offload()"``).
        guards: where the changes are recorded.
        device: the offload device (where the offload computes; moves there are allowed).
        backend: the backend, recorded in each component's ``Membership``.
    """

    def __init__(self, strategy: str, suspend: Callable[[str], Any] | None, way_out: str, guards: Journal,
                 suspend_refusal: str = "", device: torch.device | None = None, backend: Any = None) -> None:
        self.strategy = strategy
        self.suspend = suspend
        self.way_out = way_out
        self.guards = guards
        self.suspend_refusal = suspend_refusal
        self.device = device
        self.backend = backend

    # Pipeline ---------------------------------------------------------------------------------------------

    def guard_pipeline(self, pipe: Any, managed: list[tuple[str, nn.Module]]) -> None:
        self._guard_methods(pipe, "pipe")
        original_to = getattr(pipe, "to", None)
        if original_to is not None:
            self.guards.set(pipe, "to", self._pipeline_to(pipe, original_to))

    def _pipeline_to(self, pipe: Any, original: Callable) -> Callable:
        @functools.wraps(original)
        def to(*args: Any, **kwargs: Any) -> Any:
            return offloaded_pipeline_to(pipe, original, args, kwargs)

        return to

    # Components -------------------------------------------------------------------------------------------

    def guard_module(self, label: str, module: nn.Module, owner: str, managed: bool = True,
                     on_use: Callable[[], None] | None = None) -> None:
        """Guard component ``module`` (called ``label`` in messages, reached as ``owner`` in user code, e.g.
        ``pipe.transformer``). ``managed``: the offload holds copies of its weights (else it only placed it).
        ``on_use``: called before the component's ``apply_forward_hook`` methods run (see ``PhaseSlotHint``)."""
        if managed:
            self._guard_methods(module, owner)
        else:
            self._guard_foreign_offloaders(module, owner)
        self.guards.set(module, "_apply", self._module_apply(label, module, owner, managed))
        hint = OffloadSlotHint if on_use is None else functools.partial(PhaseSlotHint, on_use=on_use)
        self.guards.set(module, "_hf_hook", hint(self.device, label, self.strategy, self.way_out))
        self.guards.set(module, MEMBERSHIP_ATTR, Membership(self.backend, label, managed, self))

    def _module_apply(self, label: str, module: nn.Module, owner: str, managed: bool) -> Callable:
        call = f"{owner}.to(...) (or .half(), .float(), .cuda(), ...)"

        def _apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
            moves, casts, dtype_map = classify_conversion(module, fn, self.device)
            if moves:
                self.refuse_move(call, [(label, change) for change in moves], f"{owner}.to(...)")
            if casts and self.suspend is None:
                self.refuse_cast(call, [(label, change) for change in casts], f"{owner}.to(...)")
            if not managed:
                return type(module)._apply(module, fn, recurse)  # placed only: an ordinary move (allowed) or cast
            if casts:
                # The offload's copies are re-packed in the new dtype when it is enabled again.
                with self.suspend(f"{owner}.to(...)"):
                    module._apply(_cast_only(dtype_map), recurse)
            return module  # a device move here changes nothing: the offload places these weights itself

        return _apply

    def refuse_move(self, call: str, found: list[tuple[str, str]], redo: str) -> None:
        raise OffloadActiveError(
            f"{call} while {self.strategy} offload is enabled would change managed weights ({_shown(found)}): it "
            f"would move them away from {self.device}, where the offload places every weight itself (on the host "
            f"between uses), so nothing was changed. Allowed: a .to() to {self.device} or one that moves nothing; "
            f"dtype casts (the offload re-packs its host copies); to move them elsewhere: {self.way_out}, then "
            f"{redo}, then enable the offload again"
        )

    def refuse_cast(self, call: str, found: list[tuple[str, str]], redo: str) -> None:
        raise OffloadActiveError(
            f"{call} while {self.strategy} offload is enabled would change managed weights ({_shown(found)}), which "
            f"needs the offload suspended around the cast ({self.suspend_refusal}); every component it places "
            f"refuses a cast, so nothing was changed. Allowed: {self.way_out}, then {redo}, then enable the offload "
            "again; or a .to() that changes nothing (the offload device, the current dtype)"
        )

    # Methods ----------------------------------------------------------------------------------------------

    def _guard_methods(self, obj: Any, owner: str) -> None:
        self._guard_foreign_offloaders(obj, owner)
        cls = type(obj)
        for name in SUSPENDING_METHODS:
            if hasattr(cls, name):
                self.guards.set(obj, name, self._suspending(obj, owner, name))

    def _guard_foreign_offloaders(self, obj: Any, owner: str) -> None:
        cls = type(obj)
        for name, what in FOREIGN_OFFLOADERS.items():
            if hasattr(cls, name):
                self.guards.set(obj, name, self._refusing(obj, owner, name, what))

    def _refusing(self, obj: Any, owner: str, name: str, what: str) -> Callable:
        original = getattr(obj, name)

        @functools.wraps(original)
        def refuse(*args: Any, **kwargs: Any) -> Any:
            self.refuse_foreign(owner, name, args, kwargs)

        return refuse

    def refuse_foreign(self, owner: str, name: str, args: tuple, kwargs: dict) -> None:
        raise OffloadConflictError(
            f"{_call_text(owner, name, args, kwargs)}: {FOREIGN_OFFLOADERS[name]} cannot run while diffusers-omni "
            f"{self.strategy} offload is enabled (both would place the same weights); nothing was changed. Use one: "
            f"{self.way_out} first, then {owner}.{name}(...); or keep omni's offload"
        )

    def _suspending(self, obj: Any, owner: str, name: str) -> Callable:
        original = getattr(obj, name)

        @functools.wraps(original)
        def suspended(*args: Any, **kwargs: Any) -> Any:
            call = _call_text(owner, name, args, kwargs)
            self.check_suspendable(call, owner, name)
            with self.suspend(call):
                return original(*args, **kwargs)

        return suspended

    def check_suspendable(self, call: str, owner: str, name: str) -> None:
        if self.suspend is None:
            raise OffloadActiveError(
                f"{call} changes weights, which {self.strategy} offload cannot follow while enabled "
                f"({self.suspend_refusal}); nothing was changed. Allowed: {self.way_out}, then {owner}.{name}"
                "(...), then enable the offload again"
            )


def _installers(pipe: Any) -> list[GuardInstaller]:
    """The installer of each enabled offload placing a component of ``pipe``, one per backend."""
    installers: list[GuardInstaller] = []
    for _, _, membership in memberships(pipe):
        if not any(i.backend is membership.backend for i in installers):
            installers.append(membership.installer)
    return installers


def call_suspended(pipe: Any, name: str, original: Callable, args: tuple, kwargs: dict) -> Any:
    """``original(pipe, *args, **kwargs)`` (a method that changes weights, e.g. ``load_lora_weights``) with every
    offload placing a component of ``pipe`` suspended around it: what an Omni pipeline other than the one the offload
    was enabled on does (that one carries instance guards doing the same)."""
    installers = _installers(pipe)
    if not installers:
        return original(pipe, *args, **kwargs)
    call = _call_text("pipe", name, args, kwargs)
    for installer in installers:
        installer.check_suspendable(call, "pipe", name)
    with contextlib.ExitStack() as stack:
        for installer in installers:
            stack.enter_context(installer.suspend(call))
        return original(pipe, *args, **kwargs)


def call_refused(pipe: Any, name: str, original: Callable, args: tuple, kwargs: dict) -> Any:
    """``original(pipe, *args, **kwargs)`` (another offloader, e.g. ``enable_model_cpu_offload``), refused before its
    loop touches any component when an offload places one of ``pipe``'s components."""
    installers = _installers(pipe)
    if installers:
        installers[0].refuse_foreign("pipe", name, args, kwargs)
    return original(pipe, *args, **kwargs)


def _shown(found: list[tuple[str, str]]) -> str:
    shown = "; ".join(f"{label}: {change}" for label, change in found[:4])
    return shown + (f" (and {len(found) - 4} more)" if len(found) > 4 else "")
