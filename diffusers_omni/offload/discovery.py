"""Find a pipeline's DiTs, encoders and VAEs, and check the whole topology before any strategy mutates it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..config.offload import OffloadPlan
from ..models.base import blocks_attrs_for
from ..models.encoders import encoder_blocks_attrs
from ..utils.modules import get_submodule_path
from .hooks import DIFFUSERS_OFFLOAD_HOOKS, OMNI_OFFLOAD_HOOKS, ExecutionDeviceHint, hook_names
from .tensors import UnsupportedTensorError, tensor_nbytes

logger = logging.getLogger("diffusers_omni")

DIT = "dit"
ENCODER = "encoder"
VAE = "vae"
RESIDENT = "resident"

# Attribute names scanned when a pipeline declares nothing (see SupportsComponentDiscovery).
FALLBACK_NAMES: dict[str, tuple[str, ...]] = {
    DIT: ("transformer", "transformer_2", "dit", "unet", "prior", "decoder"),
    ENCODER: ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder"),
    VAE: ("vae", "audio_vae", "vocoder"),
}


class OffloadConflictError(RuntimeError):
    """Another offloading mechanism already manages a module this strategy would manage."""


@dataclass(frozen=True)
class Component:
    """One pipeline component: ``path`` is dotted from the pipeline (``""`` for a bare model)."""

    path: str
    module: nn.Module
    role: str

    @property
    def label(self) -> str:
        return self.path or type(self.module).__name__


@dataclass(frozen=True)
class Topology:
    dits: tuple[Component, ...]
    encoders: tuple[Component, ...]
    vaes: tuple[Component, ...]
    residents: tuple[Component, ...]
    source: str  # "declared", "scanned" or "bare model"
    # DiTs of which one runs per denoising step (declared: ``_alternating_dits``; Wan 2.2's two experts)
    alternating: tuple[Component, ...] = ()

    @property
    def components(self) -> tuple[Component, ...]:
        return self.dits + self.encoders + self.vaes + self.residents


@dataclass(frozen=True)
class Stack:
    """Blocks that run one after another and stream as one prefetch ring.

    ``owner`` is the module whose forward runs the whole stack (the DiT); ``blocks`` are (dotted path, module) in
    execution order.
    """

    name: str
    owner: nn.Module
    blocks: tuple[tuple[str, nn.Module], ...]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _resolve(root: Any, path: str, what: str) -> nn.Module | None:
    module = get_submodule_path(root, path) if path else root
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(f"{what} path {path!r} resolves to {type(module).__name__}, not a torch.nn.Module")
    return module


def discover_components(target: Any, plan: OffloadPlan | None = None) -> Topology:
    """Components of a pipeline (declared first, else scanned by attribute name) or of a bare model."""
    plan = plan or OffloadPlan()
    if isinstance(target, nn.Module):
        residents = tuple(Component(p, _resolve(target, p, "resident"), RESIDENT) for p in plan.resident)
        return Topology((Component("", target, DIT),), (), (), residents, "bare model")

    declared_dits = tuple(getattr(target, "_dit_modules", ()) or ())
    if declared_dits:
        source = "declared"
        paths = {
            DIT: declared_dits,
            ENCODER: tuple(getattr(target, "_encoder_modules", ()) or ()),
            VAE: tuple(getattr(target, "_vae_modules", ()) or ()),
        }
    else:
        source = "scanned"
        paths = FALLBACK_NAMES
    found: dict[str, list[Component]] = {DIT: [], ENCODER: [], VAE: []}
    for role, role_paths in paths.items():
        for path in role_paths:
            module = _resolve(target, path, role)
            if module is not None:
                found[role].append(Component(path, module, role))
    resident_paths = tuple(getattr(target, "_resident_modules", ()) or ()) + plan.resident
    residents = []
    for path in resident_paths:
        module = _resolve(target, path, "resident")
        if module is None:
            raise ValueError(f"resident module path {path!r} does not exist on {type(target).__name__}")
        residents.append(Component(path, module, RESIDENT))
    if source == "scanned":
        logger.warning(
            "%s declares no components; found them by attribute name (DiTs %s, encoders %s, VAEs %s). Declare "
            "_dit_modules/_encoder_modules/_vae_modules (SupportsComponentDiscovery) to make this explicit.",
            type(target).__name__,
            [c.path for c in found[DIT]],
            [c.path for c in found[ENCODER]],
            [c.path for c in found[VAE]],
        )
    if not found[DIT]:
        raise ValueError(
            f"{type(target).__name__} has no DiT to offload (looked for {list(paths[DIT])}); declare _dit_modules"
        )
    alternating = ()
    if source == "declared":
        declared = tuple(getattr(target, "_alternating_dits", ()) or ())
        unknown = [path for path in declared if path not in declared_dits]
        if unknown:
            raise ValueError(f"{type(target).__name__}._alternating_dits names {unknown}, which are not among its "
                             f"_dit_modules {list(declared_dits)}")
        alternating = tuple(c for c in found[DIT] if c.path in declared)
        if len(alternating) < 2:  # one of them absent (Wan 2.1 has no transformer_2): nothing alternates
            alternating = ()
    return Topology(tuple(found[DIT]), tuple(found[ENCODER]), tuple(found[VAE]), tuple(residents), source,
                    alternating)


def _tensor_ids(module: nn.Module) -> set[int]:
    ids = {id(p) for p in module.parameters()}
    ids.update(id(b) for b in module.buffers())
    return ids


def check_topology(topology: Topology, allow_residents_inside: tuple[str, ...] = (DIT,)) -> None:
    """Every component is a distinct module, none nests inside another (except residents inside roles listed in
    ``allow_residents_inside``), and no parameter is shared between components."""
    seen: dict[int, str] = {}
    for component in topology.components:
        if id(component.module) in seen:
            raise ValueError(
                f"module {component.label!r} is the same object as {seen[id(component.module)]!r}; each component "
                "must be a distinct module"
            )
        seen[id(component.module)] = component.label
    exclusive = [c for c in topology.components if c.role != RESIDENT]
    for outer in exclusive:
        inner_modules = {id(m) for m in outer.module.modules() if m is not outer.module}
        for other in topology.components:
            if other is outer or id(other.module) not in inner_modules:
                continue
            if other.role == RESIDENT and outer.role in allow_residents_inside:
                continue
            raise ValueError(
                f"component {other.label!r} ({other.role}) lies inside {outer.label!r} ({outer.role}); offload "
                "components must not nest"
            )
    owners: dict[int, str] = {}
    for component in exclusive:
        for tensor_id in _tensor_ids(component.module):
            if tensor_id in owners:
                raise ValueError(
                    f"components {owners[tensor_id]!r} and {component.label!r} share a parameter or buffer; offload "
                    "would move it away from one of them while it runs"
                )
            owners[tensor_id] = component.label


def foreign_offload_reasons(component: Component) -> list[str]:
    """One line per submodule that some other offloading mechanism already manages."""
    reasons = []
    for name, module in component.module.named_modules():
        where = _join(component.label, name)
        if hasattr(module, "_hf_hook") and not isinstance(module._hf_hook, ExecutionDeviceHint):
            reasons.append(
                f"{where!r} has an Accelerate hook ({type(module._hf_hook).__name__}), set by Diffusers' "
                "enable_model_cpu_offload / enable_sequential_cpu_offload; call pipe.remove_all_hooks() first"
            )
        names = set(hook_names(module))
        diffusers = sorted(names & DIFFUSERS_OFFLOAD_HOOKS)
        if diffusers:
            reasons.append(
                f"{where!r} has Diffusers group offloading hooks {diffusers} (enable_group_offload); rebuild the "
                "model without it"
            )
        ours = sorted(names & OMNI_OFFLOAD_HOOKS)
        if ours:
            reasons.append(
                f"{where!r} already has diffusers-omni offload hooks {ours}; disable that offload first (from any "
                "object sharing the module: diffusers_omni.disable_offload(pipe_or_module))"
            )
    return reasons


def check_no_foreign_offload(topology: Topology, strategy_name: str) -> None:
    reasons = [reason for c in topology.components for reason in foreign_offload_reasons(c)]
    if reasons:
        shown = "\n  ".join(reasons[:5]) + (f"\n  ... and {len(reasons) - 5} more" if len(reasons) > 5 else "")
        raise OffloadConflictError(
            f"cannot enable diffusers-omni {strategy_name} offload; another offloader is active:\n  {shown}"
        )


def check_no_self_rewriting_weights(topology: Topology, device: torch.device) -> None:
    """Refuse weights that their own module rewrites when it runs on ``device``. Offload rebinds every weight to its
    own copies around each use, so such a rewrite (a new ``weight.data``, a new ``quant_state``) would be dropped and
    later forwards would compute on bytes that no longer match their metadata. The known case: bitsandbytes 4-bit
    layers on the CPU, whose CPU backend repacks the weight and its ``quant_state`` on the layer's first eval forward
    (CPUs with AVX512-BF16) and undoes that in ``state_dict()`` (which LoRA loading calls). Nothing is changed."""
    if device.type != "cpu":
        return
    for component in topology.components:
        for name, module in component.module.named_modules():
            weight = getattr(module, "weight", None)
            state = getattr(weight, "quant_state", None)
            if state is None or not getattr(module, "support_avx512bf16_for_cpu", False):
                continue
            if getattr(state, "packing_format_for_cpu", False):
                continue  # packed already: the forward leaves it as it is
            where = f"{component.label}.{name}" if name else component.label
            raise UnsupportedTensorError(
                f"cannot offload parameter 'weight' of module {where!r} to device='cpu': it is a "
                f"{type(weight).__module__}.{type(weight).__qualname__} that bitsandbytes' CPU backend repacks "
                "(its bytes and quant_state) on the module's first forward and unpacks in state_dict(), which offload "
                "cannot follow; allowed: run one forward before enabling offload (it is then packed for good, until "
                "state_dict() or LoRA loading unpacks it), or offload to a GPU, where bitsandbytes does not repack"
            )


def resolve_stacks(target: Any, topology: Topology, plan: OffloadPlan | None) -> list[Stack]:
    """Block stacks to stream: each DiT's block attributes (plan, then model, then declaration) plus the plan's
    extra streamed paths. Blocks listed as resident stay in their stack (they keep the prefetch ring moving)."""
    plan = plan or OffloadPlan()
    stacks = []
    for dit in topology.dits:
        attrs = plan.blocks.get(dit.path) or blocks_attrs_for(dit.module)
        if not attrs:
            raise ValueError(
                f"DiT {dit.label!r} ({type(dit.module).__name__}) declares no blocks for layerwise offload; set "
                "_layerwise_offload_blocks_attrs on the model class or pass plan=OffloadPlan(blocks="
                f"{{{dit.path!r}: ('blocks',)}}) in the offload config (e.g. LayerwiseOffloadConfig)"
            )
        blocks: list[tuple[str, nn.Module]] = []
        for attr in attrs:
            container = _resolve(dit.module, attr, "block container")
            if container is None:
                raise ValueError(f"DiT {dit.label!r} has no block attribute {attr!r} (from {list(attrs)})")
            blocks.extend(_children_as_blocks(_join(dit.path, attr), container))
        stacks.append(Stack(dit.label, dit.module, tuple(blocks)))
    for path in plan.extra_streamed:
        module = _resolve(target, path, "extra streamed")
        if module is None:
            raise ValueError(f"extra streamed path {path!r} does not exist on {type(target).__name__}")
        stacks.append(Stack(path, module, tuple(_children_as_blocks(path, module))))
    check_stacks(stacks)
    return stacks


# A scanned block list must hold at least this share of its component's weight bytes (smaller lists, e.g. a
# vision tower's two patch-merger layers, are not worth a prefetch ring of their own).
_SCAN_MIN_SHARE = 0.05


def scan_block_lists(module: nn.Module) -> tuple[str, ...]:
    """Dotted paths of the outermost ``nn.ModuleList``s under ``module`` whose children are two or more modules of
    one class that hold weights (a transformer's layers), in registration order, each holding at least
    ``_SCAN_MIN_SHARE`` of the module's weight bytes. For encoders nobody declared."""
    total = sum(tensor_nbytes(t) for _, t in named_tensors(module)) or 1
    found: list[str] = []
    taken: list[str] = []
    for name, child in module.named_modules():
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if not isinstance(child, nn.ModuleList) or len(child) < 2 or len({type(c) for c in child}) != 1:
            continue
        nbytes = sum(tensor_nbytes(t) for _, t in named_tensors(child))
        if nbytes and nbytes >= _SCAN_MIN_SHARE * total:
            found.append(name)
            taken.append(name)
    return tuple(found)


def encoder_stack(component: Component) -> tuple[Stack | None, str]:
    """The blocks of encoder ``component`` as one stack (every block list, in forward order; the encoder's own
    forward enters it), and where the lists came from (``"model"``, ``"declared"``, ``"scanned"``); ``(None, "")``
    when it has none (it is then swapped whole for its phase)."""
    attrs, source = encoder_blocks_attrs(component.module)
    if not attrs:
        attrs, source = scan_block_lists(component.module), "scanned"
    blocks: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for attr in attrs:
        container = _resolve(component.module, attr, "block container")
        if container is None or id(container) in seen:  # a property aliasing another spelling
            continue
        seen.add(id(container))
        blocks.extend(_children_as_blocks(_join(component.path, attr), container))
    if not blocks:
        return None, ""
    return Stack(component.label, component.module, tuple(blocks)), source


def _children_as_blocks(path: str, container: nn.Module) -> list[tuple[str, nn.Module]]:
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        return [(_join(path, name), child) for name, child in container.named_children()]
    return [(path, container)]


def check_stacks(stacks: list[Stack]) -> None:
    """No tensor belongs to two blocks, and no block tensor is also one of its stack owner's other tensors."""
    owner_of: dict[int, str] = {}
    for stack in stacks:
        for path, block in stack.blocks:
            for name, tensor in named_tensors(block):
                if id(tensor) in owner_of:
                    raise ValueError(
                        f"{_join(path, name)!r} is also used by {owner_of[id(tensor)]!r}; a streamed tensor must "
                        "belong to one block"
                    )
                owner_of[id(tensor)] = _join(path, name)
    for stack in stacks:
        block_tensors = {id(t) for _, block in stack.blocks for _, t in named_tensors(block)}
        block_modules = {id(m) for _, block in stack.blocks for m in block.modules()}
        for name, module in stack.owner.named_modules():
            if id(module) in block_modules:
                continue
            for tensor_name, tensor in list(module.named_parameters(recurse=False)) + list(
                module.named_buffers(recurse=False)
            ):
                if id(tensor) in block_tensors:
                    raise ValueError(
                        f"{_join(_join(stack.name, name), tensor_name)!r} is shared with a streamed block; it would "
                        "be empty whenever that block is not running"
                    )


def named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    tensors = list(module.named_parameters())
    tensors.extend((name, buf) for name, buf in module.named_buffers() if buf is not None)
    return tensors




def holds_any(module: nn.Module, ids: set[int]) -> bool:
    """Whether ``module`` or one of its submodules has its ``id`` in ``ids``."""
    return any(id(m) in ids for m in module.modules())


def component_of(topology: Topology, owner: nn.Module) -> Component | None:
    """The pipeline component holding ``owner`` (a stack's owner), or ``None``."""
    for component in topology.components:
        if component.module is owner or holds_any(component.module, {id(owner)}):
            return component
    return None
