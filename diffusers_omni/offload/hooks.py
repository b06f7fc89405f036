"""Forward hooks for offload strategies, registered in Diffusers' ``HookRegistry`` under names of their own.

Using the registry lets offload hooks sit next to Diffusers' cache hooks on the same modules; every strategy
removes only the names it registered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from diffusers.hooks import HookRegistry, ModelHook

MODEL_LEVEL_HOOK = "omni_model_level_offload"
LAYERWISE_BLOCK_HOOK = "omni_layerwise_offload_block"
LAYERWISE_ENTRY_HOOK = "omni_layerwise_offload_entry"

OMNI_OFFLOAD_HOOKS: frozenset[str] = frozenset({MODEL_LEVEL_HOOK, LAYERWISE_BLOCK_HOOK, LAYERWISE_ENTRY_HOOK})

# Why offload hooks stay out of compiled graphs (shown by torch.compile(fullgraph=True), which cannot include them):
# they rebind weights between blocks and order copies on streams, which Dynamo cannot trace.
EAGER_ONLY = (
    "diffusers-omni offload hooks rebind weights between blocks and run eagerly, so torch.compile(fullgraph=True) "
    "cannot include them. Allowed with offload on: torch.compile(model) (fullgraph=False: graph breaks at block "
    "boundaries) or regional compile, model.compile_repeated_blocks(fullgraph=False)"
)

# Hook names Diffusers' own offloading registers (hooks/group_offloading.py).
DIFFUSERS_OFFLOAD_HOOKS: frozenset[str] = frozenset(
    {"group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading"}
)


# Why a model cannot be pickled (or deep-copied) while offloaded: its tensors are views into shared host buffers or
# empty placeholders, and its forward runs through hooks bound to this process's buffers, streams and locks.
NO_PICKLE = (
    "cannot pickle (or deep-copy) a model while diffusers-omni offload is enabled: its offloaded weights are views "
    "into host buffers of this process (streamed blocks hold empty placeholders between uses) and its forward runs "
    "through this process's offload hooks; call pipe.disable_omni_offload() (backend.disable() for a bare model) "
    "first, pickle or copy, then enable the offload again"
)


class NotPicklable:
    """Refuses pickling and ``copy.deepcopy`` with ``NO_PICKLE`` (Python's own error names a local function)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(NO_PICKLE)


class _RefusePickling(NotPicklable):
    """Installed as the instance attribute ``__getstate__`` of an offloaded pipeline and its components, which
    ``pickle``, ``torch.save`` and ``copy.deepcopy`` call first: they raise ``TypeError(NO_PICKLE)`` at once instead
    of failing deep inside on a hook's local function ("Can't pickle local object")."""

    def __call__(self, *args: Any) -> Any:
        raise TypeError(NO_PICKLE)


def refuse_pickling(objects: list[Any], set_attribute: Callable[[Any, str, Any], None]) -> None:
    """Make pickling (and deep-copying) each of ``objects`` raise ``TypeError(NO_PICKLE)``; ``set_attribute`` is
    the backend's reversible ``Guards.set``, so ``disable`` makes them picklable again."""
    refusal = _RefusePickling()
    seen: set[int] = set()
    for obj in objects:
        if id(obj) not in seen and hasattr(obj, "__dict__"):
            seen.add(id(obj))
            set_attribute(obj, "__getstate__", refusal)


class ConcurrentCallError(RuntimeError):
    """A forward was called from a second thread while another thread's forward held an offload that refuses
    concurrent callers (distributed layerwise offload)."""


class ForwardLock(NotPicklable):
    """One per enabled offload: held for the whole forward of each top-level module the offload manages (a DiT's
    forward from its entry hook to its end; an encoder's under model-level offload), so callers in several threads
    are served one after another. The streaming window, slots and onloaded components are shared state of the
    offload, not of one call. Re-entrant: a module calling itself or another managed module in the same thread
    does not wait for itself. Released when the forward raises.

    With ``refusal`` set (distributed offload, whose forwards are collectives in lockstep with the other ranks, so
    waiting would change the order of collectives on this rank), a call from a second thread raises
    ``ConcurrentCallError`` at once instead of waiting; ``refusal`` is the message's explanation and way out.
    """

    def __init__(self, what: str, refusal: str | None = None) -> None:
        self.what = what
        self.refusal = refusal
        self._lock = threading.RLock()
        self._holder: str | None = None  # the thread inside (for the refusal message)
        self._depth = 0

    @torch.compiler.disable(reason=EAGER_ONLY)
    def acquire(self, label: str) -> None:
        if self.refusal is None:
            self._lock.acquire()
        elif not self._lock.acquire(blocking=False):
            raise ConcurrentCallError(
                f"{label}: {self.what} is already running a call in thread {self._holder!r}, and a second thread "
                f"({threading.current_thread().name!r}) called it; {self.refusal}"
            )
        if self._depth == 0:
            self._holder = threading.current_thread().name
        self._depth += 1

    @property
    def depth(self) -> int:
        """How many forwards the holding thread has entered under it (1: the outermost; read while holding it)."""
        return self._depth

    @torch.compiler.disable(reason=EAGER_ONLY)
    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._holder = None
        self._lock.release()

    def __enter__(self) -> "ForwardLock":
        self.acquire(self.what)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class ExecutionDeviceHint(NotPicklable):
    """Set as ``_hf_hook`` on every module model-level offload parks on the host, while the offload is enabled.

    Diffusers pipelines put a component's inputs where ``diffusers.utils.torch_utils.get_module_execution_device``
    says (FLUX's CLIP prompt path in 0.42, about 30 pipelines): an offloader's onload device when it finds one
    (Diffusers' group-offload hook, or the ``execution_device`` of an Accelerate hook on the module), else the
    device of the module's weights. Parked on the host, the weights say ``cpu``: the inputs went to the host and the
    onloaded module failed with ``index is on cpu`` (the H200 check of a bitsandbytes FLUX pipeline). This object
    answers that one question. It is no Accelerate hook: Diffusers' checks for its own CPU offload
    (``isinstance(_hf_hook, CpuOffload / AlignDevicesHook)``) still find none, and ``remove_hook_from_module``
    only detaches it.
    """

    def __init__(self, execution_device: Any) -> None:
        self.execution_device = execution_device

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module

    def __repr__(self) -> str:
        return f"ExecutionDeviceHint(execution_device={str(self.execution_device)!r})"


class CallbackHook(NotPicklable, ModelHook):
    """Calls ``before()`` ahead of the module's forward and ``after()`` once it returns; arguments pass through."""

    def __init__(self, before: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._before = before
        self._after = after

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._before is not None:
            self._before()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self._after is not None:
            self._after()
        return output

    def rewire(self, other: "CallbackHook") -> None:
        """Take ``other``'s callbacks, keeping this hook's place among the module's hooks (resident blocks that
        start streaming change what the hooks do, not their order; see ``oom_retry``)."""
        self._before, self._after = other._before, other._after


class InferenceOnlyError(RuntimeError):
    """A backward pass reached a forward that ran on streamed weights (freed, or overwritten, once each block
    ends)."""


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _refuse_unpack(message: str, tensor: Any) -> Any:
    raise InferenceOnlyError(message)


class LockedCallbackHook(NotPicklable, ModelHook):
    """``CallbackHook`` whose callbacks and the module's forward run under ``lock`` (a ``ForwardLock``), taken
    before ``before()`` and released after ``after()``, or when either or the forward raises (``after()`` then does
    not run, as with ``CallbackHook``). ``label`` names the module in ``ConcurrentCallError``.

    With ``retry`` (a DiT's entry hook: ``oom_retry.StepRetry``), the outermost forward under ``lock`` runs through
    it, ``retry(run, module, args, kwargs)``, which may run ``before()``, the forward and ``after()`` once more after
    an out-of-memory error; a forward nested in another one under the same lock (a module calling another managed
    one) raises as it came, to the outermost, which alone can start the call again from a clean state.

    With ``inference_only`` (a message), a forward run with grad enabled saves its tensors for backward through
    saved-tensor hooks whose unpacking raises ``InferenceOnlyError(inference_only)``: a backward through it would
    read weights that were freed (a streamed block's device memory; Autograd said ``setStorage: ... storage of
    size 0``) or overwritten (a gathered slot: silently wrong gradients). The forward itself is unchanged, and
    under ``torch.no_grad()`` / ``inference_mode()`` (what pipelines use) nothing is saved.
    """

    def __init__(self, lock: ForwardLock, label: str, before: Callable[[], None] | None = None,
                 after: Callable[[], None] | None = None, inference_only: str | None = None,
                 retry: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.lock = lock
        self.label = label
        self._before = before
        self._after = after
        self._refuse = None if inference_only is None else partial(_refuse_unpack, inference_only)
        self._retry = retry

    def rewire(self, other: "LockedCallbackHook") -> None:
        """Take ``other``'s callbacks, refusal and retry, keeping this hook's place among the module's hooks."""
        self._before, self._after = other._before, other._after
        self._refuse, self._retry = other._refuse, other._retry

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.lock.acquire(self.label)
        if self.fn_ref is None:
            # The offload was disabled while this call waited for the lock: the hook is gone, and the module's
            # forward (its own weights again) serves the call.
            self.lock.release()
            return module.forward(*args, **kwargs)
        try:
            if self._retry is not None and self.lock.depth == 1:
                return self._retry(self._run, module, args, kwargs)
            return self._run(module, args, kwargs)
        finally:
            self.lock.release()

    def _run(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``before()``, the module's forward and ``after()`` (read at each run: a retry runs the rewired ones)."""
        if self._before is not None:
            self._before()
        if self._refuse is not None and torch.is_grad_enabled():
            with torch.autograd.graph.saved_tensors_hooks(_keep, self._refuse):
                output = self.fn_ref.original_forward(*args, **kwargs)
        else:
            output = self.fn_ref.original_forward(*args, **kwargs)
        if self._after is not None:
            self._after()
        return output


def inference_only_message(strategy: str, label: str, way_out: str) -> str:
    """The ``InferenceOnlyError`` text for a backward through ``label``'s forward under ``strategy`` offload."""
    return (
        f"backward through {label!r}: {strategy} offload is inference only; the forward ran on streamed weights, "
        "which are freed (or reused for the next block) as soon as each block ends, so no gradient can be computed "
        f"through it. Allowed: run the forward under torch.no_grad() or torch.inference_mode() (as pipelines do), "
        f"or, to compute gradients (training, LoRA fitting, guidance by gradients), {way_out} first and keep the "
        "model resident"
    )


def hook_names(module: nn.Module) -> tuple[str, ...]:
    """Names of the Diffusers-registry hooks on ``module`` itself (not its children)."""
    registry = module.__dict__.get("_diffusers_hook")
    return tuple(registry._hook_order) if registry is not None else ()


class InstalledHooks:
    """The hooks one backend registered, so it can remove exactly those and nothing else.

    When a module's registry has no hook left, the module is left exactly as before the first was installed:
    Diffusers' ``HookRegistry.remove_hook`` puts the class's ``forward`` back as a *bound method instance
    attribute* (a reference cycle module → method → module, and a ``module.__dict__`` that differs from before),
    so that attribute is dropped and class lookup applies again.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[nn.Module, str, bool]] = []

    def install(self, module: nn.Module, hook: ModelHook, name: str) -> None:
        created_registry = "_diffusers_hook" not in module.__dict__
        registry = HookRegistry.check_if_exists_or_initialize(module)
        registry.register_hook(hook, name)
        self._entries.append((module, name, created_registry))

    def installed(self, module: nn.Module, name: str) -> ModelHook | None:
        """The hook named ``name`` this object installed on ``module``, or ``None``."""
        if not any(m is module and n == name for m, n, _ in self._entries):
            return None
        registry = module.__dict__.get("_diffusers_hook")
        return None if registry is None else registry.get_hook(name)

    def remove(self, module: nn.Module, name: str) -> None:
        """Remove the one hook named ``name`` this object installed on ``module`` (to install it again outermost)."""
        for index, (m, n, created_registry) in enumerate(self._entries):
            if m is module and n == name:
                del self._entries[index]
                self._remove(module, name, created_registry)
                return

    def remove_all(self) -> None:
        while self._entries:
            self._remove(*self._entries.pop())

    @staticmethod
    def _remove(module: nn.Module, name: str, created_registry: bool) -> None:
        registry = module.__dict__.get("_diffusers_hook")
        if registry is None:
            return
        hook = registry.get_hook(name)
        registry.remove_hook(name, recurse=False)
        if hook is not None:
            hook.fn_ref = None  # hook ↔ function-reference cycle, which also holds the module's forward
        if registry.hooks:
            return
        forward = module.__dict__.get("forward")
        if getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is getattr(
            type(module), "forward", None
        ):
            del module.__dict__["forward"]
        if created_registry:
            del module._diffusers_hook

    def __len__(self) -> int:
        return len(self._entries)


def refresh_registry_caches(roots: list[nn.Module]) -> None:
    """Drop the child-registry lists Diffusers caches under ``roots`` (cache hooks walk them every step); adding
    or removing a registry on a descendant stales them."""
    for root in roots:
        for module in root.modules():
            registry = module.__dict__.get("_diffusers_hook")
            if registry is not None and getattr(registry, "_child_registries_cache", None) is not None:
                registry._child_registries_cache = None
