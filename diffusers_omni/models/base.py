"""Architecture declarations: which attention modules a DiT has, their roles, and its block topology."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn

from ..attention.processors import OmniAttnProcessor, RoleAttention, bind_routed

SELF = "self"
CROSS = "cross"


@dataclass(frozen=True)
class AttentionRole:
    """One attention call made by a module: a model-specific role, its category, whether it is masked, and whether
    it uses grouped-query attention (fewer KV heads than query heads)."""

    role: str
    category: str
    masked: bool = False
    gqa: bool = False


@dataclass(frozen=True)
class AttentionSite:
    """An attention module found in a model, with the roles of the calls its processor makes.

    ``model_name`` is the name of the declaration that found it (``"flux"``), filled in by ``plan_attention`` so
    that a backend binding to the site (``bind_site``) knows the architecture without asking the model layer.
    """

    name: str
    module: nn.Module
    roles: tuple[AttentionRole, ...]
    head_dim: int
    model_name: str = ""


ProcessorFactory = Callable[[Any, dict[str, RoleAttention]], OmniAttnProcessor]


@dataclass(frozen=True)
class TransformerDeclaration:
    """How diffusers-omni drives one DiT class.

    Args:
        name: short family name used in role prefixes (``"flux"``).
        display_name: the architecture as users know it (``"FLUX.1"``), for the supported-models table.
        example_checkpoint: a hub id of a real checkpoint of this architecture.
        class_names: Diffusers class names this declaration covers.
        blocks_attrs: attributes holding the repeated blocks, in execution order (layerwise offload units).
        find_sites: ``(model) -> list[AttentionSite]`` for every attention module in the model.
        make_processor: ``(site, original_processor, attend) -> processor``; raises for processors it cannot
            replace.
        mask_free: the model passes no attention mask on any path (eligible for mask-free kernels).
        video_geometry: ``(model, args, kwargs) -> VideoGeometry | None``: the video layout of a forward's
            self-attention sequence (prefix rows, latent grid), read by block-sparse backends (``RAINFUSION_ATTN``).
        tail_attrs: modules the forward calls only after its last block (final norm, output projection): layerwise
            offload streams their weights with the last block instead of keeping them on the device throughout.
        model_level_offload: whether the pipelines of this DiT take model-level offload (``False``: their Omni
            class refuses it, e.g. a single backbone that never leaves the device).
    """

    name: str
    class_names: tuple[str, ...]
    blocks_attrs: tuple[str, ...]
    find_sites: Callable[[nn.Module], list[AttentionSite]]
    make_processor: Callable[[AttentionSite, Any, dict[str, RoleAttention]], OmniAttnProcessor]
    mask_free: bool = True
    roles: tuple[AttentionRole, ...] = field(default=())
    display_name: str = ""
    example_checkpoint: str = ""
    video_geometry: Callable[[nn.Module, tuple, dict], Any] | None = None
    tail_attrs: tuple[str, ...] = ()
    model_level_offload: bool = True


# The output layers of most DiTs: called once, after the last block.
NORM_PROJ_OUT = ("norm_out", "proj_out")

_DECLARATIONS: dict[str, TransformerDeclaration] = {}


def register_transformer(declaration: TransformerDeclaration) -> TransformerDeclaration:
    for class_name in declaration.class_names:
        _DECLARATIONS[class_name] = declaration
    return declaration


_loaded = False


def _ensure_builtin_declarations() -> None:
    """Import every architecture module in this package; each registers its declarations on import."""
    global _loaded
    if _loaded:
        return
    import importlib
    import pkgutil

    from .. import models

    for info in pkgutil.iter_modules(models.__path__):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{models.__name__}.{info.name}")
    _loaded = True


def declaration_for(model: nn.Module) -> TransformerDeclaration | None:
    _ensure_builtin_declarations()
    for cls in type(model).__mro__:
        if cls.__name__ in _DECLARATIONS:
            return _DECLARATIONS[cls.__name__]
    return None


def supported_transformers() -> list[str]:
    _ensure_builtin_declarations()
    return sorted(_DECLARATIONS)


def declarations() -> list[TransformerDeclaration]:
    """Every registered declaration once, in registration order."""
    _ensure_builtin_declarations()
    return list(dict.fromkeys(_DECLARATIONS.values()))


def blocks_attrs_for(model: nn.Module) -> tuple[str, ...]:
    """Block attributes of a DiT: its own ``_layerwise_offload_blocks_attrs`` or this package's declaration."""
    own = getattr(model, "_layerwise_offload_blocks_attrs", None)
    if own:
        return tuple(own)
    declaration = declaration_for(model)
    return declaration.blocks_attrs if declaration else ()


def tail_attrs_for(model: nn.Module) -> tuple[str, ...]:
    """Modules a DiT calls only after its last block: its own ``_layerwise_offload_tail_attrs`` or this package's
    declaration (none for a model that declares nothing)."""
    own = getattr(model, "_layerwise_offload_tail_attrs", None)
    if own is not None:
        return tuple(own)
    declaration = declaration_for(model)
    return declaration.tail_attrs if declaration else ()


def head_dim_of(module: nn.Module) -> int:
    head_dim = getattr(module, "head_dim", None)
    if head_dim is None:
        head_dim = module.inner_dim // module.heads
    return int(head_dim)


def routed_processors(
    *accepted: type,
    mask_source: str | None = None,
    calls: dict[str, AttentionRole] | None = None,
    stand_ins: dict[type, type] | None = None,
    refuse: tuple[str, ...] = (),
) -> Callable[[AttentionSite, Any, dict[str, RoleAttention]], Any]:
    """``make_processor`` for Diffusers processor classes that attend through ``dispatch_attention_fn`` or
    ``F.scaled_dot_product_attention``: the module keeps running Diffusers' own processor code, each attention call
    routed to its role (``attention.processors.bind_routed``). Anything else raises naming the module.

    ``calls``: the role of each call that is not the module's own, by the name Diffusers' code gives the call's
    result (``{"hidden_states_img": WAN_IMAGE_CROSS}``); every other call goes to the one role of the module that
    ``calls`` does not name. ``stand_ins``: accepted classes whose attention has no call to route (an explicit
    softmax) and the class whose code runs for them. ``refuse``: arguments the processors accept but ignore, which
    raise rather than being dropped silently.

    ``mask_source``: the processors' argument holding the key-padding mask that every module of a forward receives
    as the same tensor and that Diffusers derives each call's attention mask from (the derived mask depending only
    on it and the mask's shape); the backends then get one mask tensor per forward instead of one per module."""
    call_roles = {result: role.role for result, role in (calls or {}).items()}
    stand_ins = stand_ins or {}

    def make(site: AttentionSite, original: Any, attend: dict[str, RoleAttention]) -> OmniAttnProcessor:
        original = unwrap_processor(original)
        if type(original) not in accepted:
            raise unsupported_processor_error(site, original, accepted)
        return bind_routed(original, attend, mask_source, calls=call_roles, runs=stand_ins.get(type(original)),
                           slice_size=getattr(original, "slice_size", None) if type(original) in stand_ins else None,
                           refuse=refuse, where=f"attention module {site.name!r}")

    return make


def unwrap_processor(processor: Any) -> Any:
    """The Diffusers processor an omni processor stands for (the processor itself when it is not omni)."""
    return processor.original if isinstance(processor, OmniAttnProcessor) else processor


def unsupported_processor_error(site: AttentionSite, processor: Any, expected: tuple[type, ...]) -> TypeError:
    names = ", ".join(cls.__name__ for cls in expected)
    return TypeError(
        f"attention module {site.name!r} uses processor {type(processor).__name__}, which omni attention does not "
        f"replace yet; supported here: {names}. Call disable_omni_attention() or restore the default processor."
    )


# Config fields that count layers or blocks (``num_layers``, ``num_single_layers``, ``n_refiner_layers``,
# ``num_hidden_layers``, ``video_connector_num_layers``, ``layers_per_block``, ``approximator_layers``, ...).
_LAYER_COUNT_FIELD = re.compile(r"(^|_)layers($|_per_block$)")


def check_layer_counts(config: Any, owner: str) -> None:
    """Refuse a negative layer count in a model config (a mapping, or a model with ``.config``): Diffusers builds
    such a model with no blocks and drops the checkpoint's block weights with a warning. Raises ``ValueError``
    naming ``owner``, the field, the value and what is allowed."""
    config = getattr(config, "config", config)
    if not hasattr(config, "items"):
        return
    for name, value in config.items():
        if (isinstance(name, str) and _LAYER_COUNT_FIELD.search(name) and isinstance(value, int)
                and not isinstance(value, bool) and value < 0):
            raise ValueError(
                f"{owner} config: {name}={value} is a negative layer count (Diffusers would build the model without "
                f"those layers and drop their weights); allowed: 0 or more, as the checkpoint has them"
            )
