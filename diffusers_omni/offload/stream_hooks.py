"""The hooks of a streaming offload: each stack's entry hook (the forward lock, the phase, the first loads), each
block's begin/end hooks (wait for its copy, bind, load ahead; park, free), and the phase hooks of components whose
weights come in for their phase only."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from ..utils.journal import Journal
from .discovery import DIT, named_tensors
from .hooks import LAYERWISE_BLOCK_HOOK, LAYERWISE_ENTRY_HOOK, CallbackHook, LockedCallbackHook, refresh_registry_caches
from .phases import Phases
from .streamer import lookahead_blocks


def install_stream_hooks(state: Any, phases: Phases, depth: int, inference_only: Callable[[str], str],
                         journal: Journal) -> None:
    """Install the hooks of every stack in ``state`` (a ``LayerwiseState`` with its blocks packed, its streamer and
    forward lock made) and of its phase units; ``depth`` is the prefetch depth, ``inference_only(label)`` the error
    a backward through a streamed forward raises. The journal removes them again."""
    journal.record("remove hooks", state.hooks.remove_all)
    capacity = state.stats.in_flight_capacity
    limit = state.stats.in_flight_blocks
    streamer = state.streamer
    for index, (stack, row, kind) in enumerate(zip(state.stacks, state.streamed, state.kinds)):
        ring = [b for b in row if b is not None]
        unit = state.stack_units.get(index)
        if not ring:
            if unit is not None and not unit.resident:  # every block resident: only its other weights swap
                state.hooks.install(stack.owner, LockedCallbackHook(
                    state.lock, stack.name, before=partial(phases.enter, unit),
                    after=partial(phases.leave, unit)), LAYERWISE_ENTRY_HOOK)
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
                state.hooks.install(module, CallbackHook(before=partial(streamer.begin, last, ())),
                                    LAYERWISE_BLOCK_HOOK)
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
            state.hooks.install(
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
        state.hooks.install(
            stack.owner,
            LockedCallbackHook(state.lock, stack.name, before=before,
                               after=end_last, inference_only=inference_only(stack.name)),
            LAYERWISE_ENTRY_HOOK,
        )
    roots = [stack.owner for stack in state.stacks]
    for unit in state.units:
        if unit.resident or unit in state.stack_units.values():
            continue
        roots.append(unit.module)
        # The unit comes in when its component (or any of its direct parts, which a VAE's encode and decode
        # call) runs; an encoder's goes again when its forward returns, a VAE's when another phase starts.
        parts = [unit.module] + [child for _, child in unit.module.named_children() if named_tensors(child)]
        for position, part in enumerate(parts):
            after = partial(phases.leave, unit) if unit.per_call and position == 0 else None
            state.hooks.install(part, LockedCallbackHook(
                state.lock, unit.label, before=partial(phases.enter, unit), after=after),
                LAYERWISE_ENTRY_HOOK)
    refresh_registry_caches(roots)
    journal.record("refresh registry caches", lambda: refresh_registry_caches(roots))
