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

# Hook names Diffusers' own offloading registers (hooks/group_offloading.py).
DIFFUSERS_OFFLOAD_HOOKS: frozenset[str] = frozenset(
    {"group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading"}
)


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


_MISSING = object()


class InstalledHooks:
    """The hooks one backend registered, so it can remove exactly those and nothing else.

    Removing a module's last registry hook leaves the module exactly as before the first was installed: Diffusers'
    ``HookRegistry.remove_hook`` puts the original *bound* ``forward`` back as an instance attribute (a reference
    cycle, and a ``module.__dict__`` that differs from before), so the instance attribute it had before (usually
    none) is restored instead.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[nn.Module, str, bool, Any]] = []

    def install(self, module: nn.Module, hook: ModelHook, name: str) -> None:
        created_registry = "_diffusers_hook" not in module.__dict__
        forward_before = module.__dict__.get("forward", _MISSING) if created_registry else _MISSING
        registry = HookRegistry.check_if_exists_or_initialize(module)
        registry.register_hook(hook, name)
        self._entries.append((module, name, created_registry, forward_before))

    def remove_all(self) -> None:
        while self._entries:
            module, name, created_registry, forward_before = self._entries.pop()
            registry = module.__dict__.get("_diffusers_hook")
            if registry is None:
                continue
            registry.remove_hook(name, recurse=False)
            if created_registry and not registry.hooks:
                del module._diffusers_hook
                if forward_before is _MISSING:
                    module.__dict__.pop("forward", None)
                else:
                    module.__dict__["forward"] = forward_before

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
