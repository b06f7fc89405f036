"""Install omni attention processors on a model and take them off again."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..config.attention import AttentionConfig
from .backends.base import AttentionBackend, AttentionCall
from .platform import Platform, current_platform
from .model_state import remove_states
from .processors import MaskPolicy, RoleAttention, is_omni_processor
from .registry import get_backend_class
from .routing import ShapeRouter
from .selector import Resolution, deterministic_requested, resolve

logger = logging.getLogger("diffusers_omni.attention")

_STATE_ATTR = "_omni_attention"


class UnsupportedModelError(TypeError):
    """The model has no diffusers-omni declaration."""


@dataclass
class _InstalledAttention:
    config: AttentionConfig
    originals: dict[str, Any]
    report: list[dict]
    installed: list[tuple[nn.Module, Any]]
    guard: Any = None


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return None


def _call_device_type(model: nn.Module, platform: Platform) -> str:
    for tensor in model.parameters():
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device.type
        break
    # Models are usually built or loaded on the host and moved to the accelerator afterwards.
    return platform.device_type


def _declaration(model: nn.Module):
    from ..models.base import declaration_for, supported_transformers

    declaration = declaration_for(model)
    if declaration is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no diffusers-omni attention declaration; supported transformers: "
            f"{', '.join(supported_transformers())}"
        )
    return declaration


def plan_attention(model: nn.Module, config: Any = None, platform: Platform | None = None):
    """Resolve every attention role of ``model`` without changing it.

    Returns ``(declaration, [(site, {role: Resolution})])``. Raises when an explicit backend cannot run a role.
    """
    declaration = _declaration(model)
    config = AttentionConfig.parse(config)
    platform = platform or current_platform()
    device_type = _call_device_type(model, platform)
    dtype = _model_dtype(model)
    deterministic, _ = deterministic_requested(config)
    plan = []
    for site in declaration.find_sites(model):
        resolutions = {}
        for role in site.roles:
            call = AttentionCall(
                device_type=device_type,
                dtype=dtype,
                head_dim=site.head_dim,
                has_mask=role.masked,
                gqa=role.gqa,
                mask_free_path=declaration.mask_free,
                deterministic=deterministic,
            )
            resolutions[role.role] = resolve(config, role.role, role.category, call, platform)
        plan.append((site, resolutions))
    return declaration, plan


def apply_attention(model: nn.Module, config: Any = None) -> list[dict]:
    """Route every attention call of ``model`` through the backend resolved for its role.

    Args:
        model (`torch.nn.Module`): a supported Diffusers transformer (e.g. ``FluxTransformer2DModel``).
        config: anything ``AttentionConfig.parse`` accepts; ``None`` resolves every role through the
            environment variable or the platform default.

    Returns:
        The attention report: one dict per attention call site with ``module``, ``role``, ``category``,
        ``backend`` and ``source``.

    Every role is resolved before anything changes, so a backend that cannot run leaves the model untouched.
    Applying again replaces the previous omni processors.

    Example:
    ```py
    >>> from diffusers_omni import apply_attention
    >>> apply_attention(pipe.transformer, {"default": {"backend": "TORCH_SDPA"}})
    ```
    """
    config = AttentionConfig.parse(config)
    declaration, plan = plan_attention(model, config)
    previous = getattr(model, _STATE_ATTR, None)
    originals = {}
    processors = {}
    backends: dict[tuple, AttentionBackend] = {}
    mask_policy = MaskPolicy()
    geometry_users = []
    for site, resolutions in plan:
        attend = {}
        for role, resolution in resolutions.items():
            backend = _instance(backends, resolution.backend, resolution.spec, resolution.call.deterministic)
            if resolution.shape_routed:
                names = (resolution.backend, *resolution.shape_routed)
                backend = ShapeRouter(
                    current_platform().family,
                    {n: _instance(backends, n, resolution.spec, resolution.call.deterministic) for n in names},
                )
            # Optional enable-time hook: a backend may specialise itself per site and role (calibration, layer
            # exemptions, per-role guards) or raise; nothing is installed yet, so a raise leaves the model as is.
            bind_site = getattr(backend, "bind_site", None)
            if bind_site is not None:
                backend = bind_site(model, site, resolution)
            attend[role] = RoleAttention(resolution, backend, mask_policy)
            attach = getattr(backend, "attach_geometry_source", None)
            if attach is not None and getattr(declaration, "video_geometry", None) is not None:
                geometry_users.append(attach)
        current = site.module.processor
        original = current.original if is_omni_processor(current) else current
        processors[site.name] = (site, declaration.make_processor(site, original, attend), original)

    if geometry_users:  # block-sparse backends read the video layout the declaration derives from each forward
        geometry_users[0](model, declaration.video_geometry)
    report, installed = [], []
    for name, (site, processor, original) in processors.items():
        originals[name] = original
        site.module.set_processor(processor)
        installed.append((site.module, processor))
        for role in site.roles:
            attend = processor.attend[role.role]
            report.append(_report_entry(name, role, attend.resolution, attend.backend))
    if previous is not None and previous.guard is not None:
        previous.guard.remove()
    state = _InstalledAttention(config, originals, report, installed)
    state.guard = model.register_forward_pre_hook(_keep_applied)
    setattr(model, _STATE_ATTR, state)
    return [dict(entry) for entry in report]


def _instance(backends: dict, name: str, spec, deterministic: bool) -> AttentionBackend:
    """One backend object per (name, spec, deterministic) for the whole model, shared by its roles."""
    key = (name, spec, deterministic)
    if key not in backends:
        backends[key] = get_backend_class(name)(spec)
        if deterministic:
            backends[key].enable_deterministic()
    return backends[key]


def _keep_applied(model: nn.Module, args) -> None:
    """Re-apply omni attention when Diffusers swapped processors since the last call (IP-adapter or LoRA
    loading, PAG, …); raises naming the module when the new processor cannot be replaced."""
    if torch.compiler.is_compiling():
        return
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    for module, processor in state.installed:
        if module.processor is not processor:
            break
    else:
        return
    swapped = [
        f"{name}: {type(module.processor).__name__}"
        for name, module in model.named_modules()
        if name in state.originals and not is_omni_processor(getattr(module, "processor", None))
    ]
    logger.info("Diffusers replaced attention processors (%s); re-applying omni attention", ", ".join(swapped[:3]))
    apply_attention(model, state.config)


def _report_entry(module: str, role, resolution: Resolution, backend=None) -> dict:
    lossy = bool(getattr(backend, "lossy", False)) if backend is not None else resolution.lossy
    return {
        "module": module,
        "role": role.role,
        "category": role.category,
        "backend": resolution.backend,
        "shape_routed": list(resolution.shape_routed),
        "source": resolution.source,
        "lossy": lossy,
        "quality": resolution.quality_note() if lossy else "exact",
    }


def remove_attention(model: nn.Module) -> bool:
    """Put back the exact processor objects omni attention replaced. Returns False when none was installed."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return False
    if state.guard is not None:
        state.guard.remove()
    remove_states(model)
    modules = dict(model.named_modules())
    for name, original in state.originals.items():
        module = modules.get(name)
        if module is not None and is_omni_processor(getattr(module, "processor", None)):
            module.set_processor(original)
    delattr(model, _STATE_ATTR)
    return True


def attention_report(model: nn.Module) -> list[dict]:
    """The report of the processors currently installed on ``model`` (empty when none)."""
    state = getattr(model, _STATE_ATTR, None)
    return [dict(entry) for entry in state.report] if state else []


def is_attention_applied(model: nn.Module) -> bool:
    return getattr(model, _STATE_ATTR, None) is not None
