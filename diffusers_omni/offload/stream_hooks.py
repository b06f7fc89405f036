"""The hooks of a streaming offload: each stack's entry hook (the forward lock, the phase, the first loads), each
block's begin/end hooks (wait for its copy, bind, load ahead; park, free), the phase hooks of components whose
weights come in for their phase only, and the ``state_dict()``/``save_pretrained`` guards of streamed blocks."""

from __future__ import annotations

import functools
from functools import partial
from typing import Any, Callable

import torch.nn as nn

from ..utils.journal import Journal
from .discovery import DIT, named_tensors
from .guards import OffloadActiveError
from .hooks import LAYERWISE_BLOCK_HOOK, LAYERWISE_ENTRY_HOOK, CallbackHook, LockedCallbackHook, refresh_registry_caches
from .oom_retry import PhaseRetry
from .phases import Phases
from .streamer import lookahead_blocks
from .units import state_dict_hooks


def install_stream_hooks(state: Any, phases: Phases, depth: int, inference_only: Callable[[str], str],
                         journal: Journal, retry: Callable[[str], Any] | None = None) -> None:
    """Install the hooks of every stack in ``state`` (a ``LayerwiseState`` with its blocks packed, its streamer and
    forward lock made) and of its phase units; ``depth`` is the prefetch depth, ``inference_only(label)`` the error
    a backward through a streamed forward raises, ``retry(label)`` what a DiT's entry hook runs its forward through
    (``oom_retry.StepRetry``; ``None``: the forward runs once). The journal removes them again."""
    journal.record("remove hooks", state.hooks.remove_all)
    _wire_stacks(state, phases, depth, inference_only, retry, state.hooks.install)
    roots = [stack.owner for stack in state.stacks]
    for unit in state.units:
        if unit.resident or unit in state.stack_units.values():
            continue
        roots.append(unit.module)
        # The unit comes in when its component (or any of its direct parts, which a VAE's encode and decode
        # call) runs; an encoder's goes again when its forward returns, a VAE's when another phase starts.
        parts = [unit.module] + [child for _, child in unit.module.named_children() if named_tensors(child)]
        for position, part in enumerate(parts):
            outermost = unit.per_call and position == 0  # an encoder's own forward (a VAE's phase: vae_tiling)
            state.hooks.install(part, LockedCallbackHook(
                state.lock, unit.label, before=partial(phases.enter, unit),
                after=partial(phases.leave, unit) if outermost else None,
                retry=PhaseRetry(unit.label, phases, state.streamer) if outermost else None),
                LAYERWISE_ENTRY_HOOK)
    refresh_registry_caches(roots)
    journal.record("refresh registry caches", lambda: refresh_registry_caches(roots))


def rewire_stream_hooks(state: Any, phases: Phases, depth: int, inference_only: Callable[[str], str],
                        retry: Callable[[str], Any] | None = None) -> None:
    """The stacks' hooks again, for ``state.streamed`` and the window as they are now (resident blocks that started
    streaming, ``oom_retry``, or streamed ones that stay, ``headroom``): hooks already there take the new callbacks
    in place (their order among other hooks on the module is kept), blocks that had none get theirs, a stack whose
    every block is resident loses its block hooks; removed by the same ``state.hooks``."""
    hooks = state.hooks

    def place(module: nn.Module, hook: Any, name: str) -> None:
        existing = hooks.installed(module, name)
        if existing is not None:
            existing.rewire(hook)
            return
        if name == LAYERWISE_BLOCK_HOOK and hooks.installed(module, LAYERWISE_ENTRY_HOOK) is not None:
            # A stack that is its own block (an extra streamed module): its entry hook stays the outermost, so the
            # stack is entered (and the lock taken) before the block is bound; it is placed again below.
            hooks.remove(module, LAYERWISE_ENTRY_HOOK)
        hooks.install(module, hook, name)

    for stack, row in zip(state.stacks, state.streamed):
        # Blocks resident now (``headroom``) keep no hooks of a streamed block: a last block's output layers lose
        # theirs once it is resident, and a stack whose every block is resident its block hooks (the entry stays).
        gone = [m for _, m in state.tails.get(stack.blocks[-1][0], ())] if row[-1] is None else []
        if not any(b is not None for b in row):
            gone += [m for _, m in stack.blocks]
        for module in gone:
            if hooks.installed(module, LAYERWISE_BLOCK_HOOK) is not None:
                hooks.remove(module, LAYERWISE_BLOCK_HOOK)
    _wire_stacks(state, phases, depth, inference_only, retry, place)
    refresh_registry_caches([stack.owner for stack in state.stacks])


def _wire_stacks(state: Any, phases: Phases, depth: int, inference_only: Callable[[str], str],
                 retry: Callable[[str], Any] | None, place: Callable[[nn.Module, Any, str], None]) -> None:
    """Each stack's hooks, handed to ``place(module, hook, name)`` (install, or rewire)."""
    capacity = state.stats.in_flight_capacity
    limit = state.stats.in_flight_blocks
    streamer = state.streamer
    for index, (stack, row, kind) in enumerate(zip(state.stacks, state.streamed, state.kinds)):
        ring = [b for b in row if b is not None]
        unit = state.stack_units.get(index)
        if not ring:  # every block resident: only its other weights swap, and resident blocks that left come back
            swaps = unit is not None and not unit.resident
            if swaps or (kind == DIT and phases.residents is not None):
                place(stack.owner, LockedCallbackHook(
                    state.lock, stack.name, before=partial(phases.enter_resident_stack, unit if swaps else None),
                    after=partial(phases.leave, unit) if swaps else None,
                    retry=retry(stack.name) if retry is not None and kind == DIT else None), LAYERWISE_ENTRY_HOOK)
            continue
        first = tuple(ring[:depth])
        own = frozenset(id(b) for b in ring)
        # With the default depth the window is Diffusers' (the running block and the next one of the same pass):
        # the next pass's first blocks load when the last block ends, not over its activations. With a budget,
        # or a deeper window, the lookahead wraps around (the memory is paid for): a copy-bound run of blocks at
        # the start of the pass (FLUX's double-stream blocks) starts with the lead the window allows.
        # An encoder runs once per call: its lookahead never wraps to a next pass that may not come.
        wrap = (limit is None or depth > 1) and kind == DIT
        # A last block that carries the DiT's output layers ends with the DiT's forward, after they ran.
        tail = state.tails.get(stack.blocks[-1][0]) if row[-1] is not None else None
        last = row[-1] if tail else None
        end_last = None
        if last is not None:
            end_last = partial(streamer.end, last)
            for _, module in tail:
                # Normally a no-op (the last block bound them); loads them if called without the last block.
                place(module, CallbackHook(before=partial(streamer.begin, last, ())), LAYERWISE_BLOCK_HOOK)
        for position, ((_, module), block) in enumerate(zip(stack.blocks, row)):
            # As far ahead as the window could ever hold: each upcoming block loads as soon as room frees up
            # (e.g. while resident blocks run), so the copy engine never idles waiting for the next one.
            lookahead = lookahead_blocks(row, position, capacity, limit, wrap=wrap)
            if block is None or (block is last and wrap):
                after = None
            elif block is last:
                after = partial(streamer.load_next_pass, first)
            elif block is ring[-1] and not wrap and kind == DIT:
                after = partial(streamer.end_pass, block, first)
            else:
                after = partial(streamer.end, block)
            place(
                module,
                CallbackHook(before=partial(streamer.begin, block, lookahead), after=after),
                LAYERWISE_BLOCK_HOOK,
            )
        # Installed last, so it is the outermost hook where the owner is its own block (an extra streamed module
        # streams as one unit): the stack is entered (and the lock taken) before the block is bound.
        if kind == DIT:
            before = partial(phases.enter_stack, ring, first, own)
        else:
            before = partial(phases.enter_encoder, unit, ring, first, own)
            end_last = partial(phases.leave, None if unit is None or unit.resident else unit)
        if kind == DIT:
            entry_retry = retry(stack.name) if retry is not None else None
        else:  # an encoder runs beside the DiT blocks kept on the device: it makes room if it must
            entry_retry = PhaseRetry(stack.name, phases, streamer)
        place(
            stack.owner,
            LockedCallbackHook(state.lock, stack.name, before=before, after=end_last,
                               inference_only=inference_only(stack.name), retry=entry_retry),
            LAYERWISE_ENTRY_HOOK,
        )


def install_state_dict_guards(state: Any, managed: list[tuple[str, nn.Module]], way_out: str,
                              guards: Journal) -> None:
    """``state_dict()`` (save_pretrained, LoRA and PEFT helpers) of streamed blocks, whose own tensors are empty
    placeholders between uses: each block is bound to its store's host views for the duration of its
    ``state_dict()`` (quantized weights included: wrapper subclasses are rebuilt around the host views,
    bitsandbytes' quant_state tensors rebound), then put back exactly as it was. A store that cannot show the whole
    block in this process (``BlockStore.host_views_refusal``: a rank's shard) refuses its blocks' ``state_dict()``,
    and ``save_pretrained`` of every managed module and of the pipeline is refused before anything is written.
    ``guards`` removes them on disable."""
    refusals: list[str] = []
    for stack, row in zip(state.stacks, state.streamed):
        for (path, module), block in zip(stack.blocks, row):
            if block is None:
                continue
            refusal = block.store.host_views_refusal
            if refusal is not None:
                if refusal not in refusals:
                    refusals.append(refusal)
                message = _refusal(refusal, way_out)
                handle = module.register_state_dict_post_hook(_refuse_state_dict(message, path))
                guards.record("remove a state_dict hook", handle.remove)
                continue
            guard_state_dict(state, block, path, module, guards)
    if not refusals:
        return
    message = _refusal("; ".join(refusals), way_out)
    owners = list(managed)
    if not isinstance(state.target, nn.Module):
        owners.append(("pipe", state.target))
    for label, owner in owners:
        original = getattr(owner, "save_pretrained", None)
        if original is not None:
            guards.set(owner, "save_pretrained", _refuse_call(message, f"{label}.save_pretrained", original))


def guard_state_dict(state: Any, block: Any, path: str, module: nn.Module, guards: Journal) -> None:
    """``state_dict()`` of the streamed ``block`` (at ``path``, with its output layers) shows its store's host
    views; ``guards`` removes the hooks on disable."""
    for owner in [module] + [m for _, m in state.tails.get(path, ())]:
        before, after = state_dict_hooks(block)
        for handle in (owner.register_state_dict_pre_hook(before), owner.register_state_dict_post_hook(after)):
            guards.record("remove a state_dict hook", handle.remove)


def _refusal(reason: str, way_out: str) -> str:
    return f"{{what}}: {reason}; nothing was written. Allowed: {way_out}, then save"


def _refuse_state_dict(message: str, path: str):
    def refuse(module, state_dict, prefix, local_metadata) -> None:
        raise OffloadActiveError(message.replace("{what}", f"state_dict() of {path!r}", 1))

    return refuse


def _refuse_call(message: str, what: str, original):
    @functools.wraps(original)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OffloadActiveError(message.replace("{what}", f"{what}(...)", 1))

    return refuse
