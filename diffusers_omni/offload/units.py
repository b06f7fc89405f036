"""The units a streaming offload moves: one per block (the DiT's output layers join its last block), and one per
component phase (an encoder's weights outside its blocks, a VAE); the DiTs' other tensors stay on the device."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..models.base import tail_attrs_for
from .discovery import DIT, ENCODER, Stack, check_stacks, encoder_stack, holds_any, named_tensors
from .memory import PackedWeights
from .phases import PhaseUnit
from .streamer import StreamedBlock


def component_units(state: Any) -> None:
    """Encoders stream their blocks (declared per family, else scanned) with their other weights in a unit for
    their phase; encoders without blocks and VAEs are one unit each. An encoder holding a path of
    the offload plan's ``extra_streamed`` is left as the plan says (its other weights stay on the device)."""
    extra = [stack.owner for stack, kind in zip(state.stacks, state.kinds) if kind == DIT]
    for component in state.topology.encoders + state.topology.vaes:
        if any(holds_any(component.module, {id(owner)}) for owner in extra):
            continue
        stack, source = encoder_stack(component) if component.role == ENCODER else (None, "")
        if stack is not None:
            try:
                check_stacks(state.stacks + [stack])
            except ValueError:
                if source != "scanned":
                    raise
                stack = None  # the scan's guess shares weights across its blocks: swap it whole instead
        if stack is not None:
            block_ids = {id(t) for _, block in stack.blocks for _, t in named_tensors(block)}
            rest = {id(t) for _, t in named_tensors(component.module)} - block_ids
            state.stacks.append(stack)
            state.kinds.append(ENCODER)
            if rest:
                unit = PhaseUnit(component.label, component.module,
                                  PackedWeights(component.label, component.module, select=rest,
                                                keep_residues=state.keep_residues), per_call=True)
                state.units.append(unit)
                state.stack_units[len(state.stacks) - 1] = unit
            state.managed[component.label] = f"{len(stack.blocks)} blocks streamed ({source})"
        elif named_tensors(component.module):
            state.units.append(PhaseUnit(component.label, component.module,
                                          PackedWeights(component.label, component.module,
                                                        keep_residues=state.keep_residues),
                                          per_call=component.role == ENCODER))
            state.managed[component.label] = "on the device for its phase"


def stack_weights(stack: Stack, state: Any, kind: str = DIT, fold_tail: bool = True) -> list[PackedWeights]:
    """One unit per block. The DiT's output layers (final norm, output projection: called once, after the last
    block) join the last block's unit, so they are on the device only from the last block to the end of the
    forward instead of throughout, as every non-block weight is (Diffusers' group offload keeps them, too)."""
    weights = [PackedWeights(path, block, keep_residues=state.keep_residues) for path, block in stack.blocks]
    tail = tail_modules(stack) if fold_tail and kind == DIT else []
    if tail and weights:
        path, last = stack.blocks[-1]
        owner_path = _owner_path(stack.owner, path, last)
        ids = {id(t) for _, t in named_tensors(last)} | {id(t) for _, m in tail for _, t in named_tensors(m)}
        weights[-1] = PackedWeights(path, stack.owner, select=ids, label=owner_path, keep_residues=state.keep_residues)
        state.tails[path] = tail
    return weights

def tail_modules(stack: Stack) -> list[tuple[str, nn.Module]]:
    """The declared output layers that exist, hold tensors and are not (inside) a block. A name the model sets
    itself (``_layerwise_offload_tail_attrs``) must be such a module; a package declaration's may be missing
    from another Diffusers version, and is skipped."""
    in_blocks = {id(m) for _, block in stack.blocks for m in block.modules()}
    own = getattr(stack.owner, "_layerwise_offload_tail_attrs", None) is not None
    tail = []
    for attr in tail_attrs_for(stack.owner):
        module = getattr(stack.owner, attr, None)
        usable = isinstance(module, nn.Module) and not holds_any(module, in_blocks)
        if own and not usable:
            modules = [name for name, child in stack.owner.named_children() if not holds_any(child, in_blocks)]
            raise ValueError(
                f"_layerwise_offload_tail_attrs of {stack.name!r} ({type(stack.owner).__name__}) names {attr!r}, "
                f"which is {'(or holds) a block' if isinstance(module, nn.Module) else 'not a module of it'}; "
                f"allowed: its modules outside the blocks ({', '.join(modules)})"
            )
        if usable and named_tensors(module):
            tail.append((attr, module))
    return tail

def non_block_tensors(state: Any) -> list[torch.Tensor]:
    """The DiTs' tensors outside their streamed units (they stay on the device)."""
    in_blocks = {i for stack in state.weights for w in stack for i in w.tensors.ids}
    seen: set[int] = set()
    tensors = []
    for stack, kind in zip(state.stacks, state.kinds):
        if kind != DIT:
            continue
        for _, tensor in named_tensors(stack.owner):
            if id(tensor) not in in_blocks and id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
    return tensors

# Host memory budget (max_host_memory) -------------------------------------------------------------------


def state_dict_hooks(block: StreamedBlock):
    """The block's store shows its tensors as host tensors (a file-backed block's are read into fresh pageable
    tensors, dropped once ``state_dict()`` is done with them)."""
    saved: list[list[torch.Tensor]] = []
    weights = block.weights

    def bind_host_copies(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if block.retired:  # the block is resident now: its tensors are its device views, as a resident's are
            return
        views = block.store.host_views()
        saved.append(weights.tensors.current())
        weights.bind(views)

    def put_back(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        if saved:
            weights.park(saved.pop())

    return bind_host_copies, put_back


def _owner_path(owner: nn.Module, block_path: str, block: nn.Module) -> str:
    """The dotted path of ``owner``, given one of its blocks and its path (``"transformer.blocks.3"`` gives
    ``"transformer"``)."""
    relative = next(name for name, module in owner.named_modules() if module is block)
    return block_path[: len(block_path) - len(relative)].rstrip(".")
