"""Forward hooks for offload strategies, registered in Diffusers' ``HookRegistry`` under names of their own.

Using the registry lets offload hooks sit next to Diffusers' cache hooks on the same modules; every strategy
removes only the names it registered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


class ExecutionDeviceHint:
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


class CallbackHook(ModelHook):
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

    def remove_all(self) -> None:
        while self._entries:
            module, name, created_registry = self._entries.pop()
            registry = module.__dict__.get("_diffusers_hook")
            if registry is None:
                continue
            hook = registry.get_hook(name)
            registry.remove_hook(name, recurse=False)
            if hook is not None:
                hook.fn_ref = None  # hook ↔ function-reference cycle, which also holds the module's forward
            if registry.hooks:
                continue
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
