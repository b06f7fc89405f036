"""A denoising step that runs out of device memory beside resident DiT blocks: they stream from then on, and the
step runs again, exactly, once.

A ``max_device_memory`` budget keeps DiT blocks resident by their weights' bytes; the step's activations are not in
that sum, and they grow with the resolution, the frame count and the batch, which the offload cannot know when it
plans (``"auto"`` reads the card once, before any call). So a step can run out of memory where the same step with
fewer resident blocks fits. Failing the call there would be wrong: the budget was the offload's choice, not the
user's. Every resident block keeps its packed host copy (``disable`` gives it back), so it can stream like the
other blocks at any time: its tensors go to placeholders, its device buffers are freed, and the pinned store copies
it from that host copy when it runs (``stores.pinned``: nothing is packed again, nothing is lost).

How many blocks would have to go is not known either (the error says what one allocation lacked, not what the
step needs), and a second failure is not retried, so the one retry is the one most likely to fit: every resident
block the budget chose streams, and the step needs only the streaming window beside the DiTs' other weights, as
it does without a budget. Blocks the pipeline or the plan declared resident (``_resident_modules``,
``OffloadPlan.resident``) stay: they were not the budget's choice. The window is sized again for the largest block
that streams now (what the planner reserved for it already). Later steps and calls keep that smaller resident set
and fail no more; ``disable_omni_offload()`` and enabling again plans anew.

The retry runs at the DiT's entry hook, the outermost forward under the offload's lock (``hooks.LockedCallbackHook``:
a forward nested in another one raises to it), with the same arguments, after the failed forward's leftovers are
settled: blocks it left running end, every in-flight block is freed (``Streamer.settle``), the lock's nested
holds were released by the failing frames, and the entry hook enters the stack again as any step does. A DiT's
forward is a pure function of its arguments and weights, so the retried step's output is bitwise the one it would
have been (stateful hooks of other libraries inside the DiT, such as a step cache, are theirs to keep consistent).
With nothing resident to stream (no budget, or the residents streamed after an earlier failure), the one retry
shrinks the streaming window instead: it keeps only the running block (no prefetched ones), the least device memory
a streamed step can take; steps are slower from then on (copies no longer overlap compute), which one warning says.
When nothing can be shrunk (the window holds one block already), or the retry fails too, the error is raised as it
came.

Distributed offload does not retry: one rank starting its step again would put its collectives out of step with
the other ranks'.

An encoder runs before the DiTs, beside the same resident blocks: one that runs out of memory there makes room
instead (``PhaseRetry``: the resident blocks leave the device as they do for a VAE, ``Phases.make_room``, and come
back when their DiT runs), and runs again with the same inputs, once.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable

import torch
import torch.nn as nn

from ..config.offload import format_bytes
from .discovery import DIT
from .memory import release_freed_device_memory
from .residents import ResidentBlocks
from .stores import PinnedStore
from .streamer import StreamedBlock

logger = logging.getLogger("diffusers_omni")


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


class StepShrink:
    """Makes a step that ran out of memory need less (see the module's docstring): the resident DiT blocks a budget
    chose become streamed ones or, with none, the window keeps only the running block. ``rewire(retry_for)`` puts the
    stacks' hooks in line with ``state.streamed`` and the window; ``guard(block, module)`` installs the
    ``state_dict()`` hooks a streamed block needs (its tensors are placeholders between uses)."""

    def __init__(self, state: Any, device: torch.device, depth: int,
                 rewire: Callable[[Callable[[str], "StepRetry"]], None],
                 guard: Callable[[StreamedBlock, str, nn.Module], None]) -> None:
        self.state = state
        self.device = device
        self.depth = depth
        self.rewire = rewire
        self.guard = guard
        self.declared = {c.path for c in state.topology.residents}  # resident by declaration: they stay
        self.headroom: Any = None  # headroom.Headroom under max_device_memory="auto": fits residents to each shape

    def candidates(self) -> list[tuple[int, int]]:
        """(stack, position) of every resident DiT block the budget chose."""
        state = self.state
        return [(i, j) for i, (kind, row_weights, row_resident) in enumerate(
                    zip(state.kinds, state.weights, state.resident)) if kind == DIT
                for j, (weights, resident) in enumerate(zip(row_weights, row_resident))
                if resident and not weights.empty and weights.path not in self.declared]

    def retry_for(self, label: str) -> "StepRetry":
        """What the entry hook of the DiT named ``label`` runs its forward through."""
        return StepRetry(label, self)

    def window_shrinkable(self) -> bool:
        """Whether the streaming window holds more than the running block (it can drop its prefetched ones)."""
        state = self.state
        streamer = state.streamer
        if streamer is None or not any(b is not None for row, kind in zip(state.streamed, state.kinds)
                                       if kind == DIT for b in row):
            return False
        return streamer.max_blocks is None or streamer.max_blocks > 1

    def possible(self) -> bool:
        return bool(self.candidates()) or self.window_shrinkable()

    def __call__(self) -> tuple[str, int, int]:
        """Shrink what the step needs on the device: every candidate streams from now on or, with none, the window
        keeps only the running block; returns (what shrank: ``"residents"`` or ``"window"``, blocks, bytes released
        from the device). Runs under the offload's forward lock, between the failed run and its retry."""
        candidates = self.candidates()
        if not candidates:
            return self._shrink_window()
        self.state.streamer.settle()
        nbytes = self.stream(candidates)
        self.state.stats.residents_shrunk += len(candidates)
        self.state.stats.residents_shrunk_bytes += nbytes
        gc.collect()  # the failed run's frames and activations
        release_freed_device_memory(self.device)
        return "residents", len(candidates), nbytes

    def promotable(self) -> list[tuple[int, int]]:
        """(stack, position) of every streamed DiT block that may stay on the device: its store fills it from this
        process's memory alone (``BlockStore.can_stay``: the pinned copy, the lossless code; not a block read from
        its files or gathered from other ranks)."""
        state = self.state
        return [(i, j) for i, (kind, row) in enumerate(zip(state.kinds, state.streamed)) if kind == DIT
                for j, block in enumerate(row) if block is not None and block.store.can_stay]

    def stream(self, positions: list[tuple[int, int]]) -> int:
        """The resident blocks at ``positions`` stream from now on, over their packed host copies (nothing is
        copied); the window is sized again and the hooks rewired. The caller settled the streamer. Returns the bytes
        released from the device."""
        state, stats = self.state, self.state.stats
        moved: list[StreamedBlock] = []
        with torch.inference_mode(False):  # placeholders and rebinding: ordinary tensors, as at enable
            for i, j in positions:
                block = state.kept.pop((i, j), None)
                if block is not None:  # a streamed block that stayed (``keep``): it streams again, as it was
                    block.leave_device()
                    block.retired = False
                else:  # resident since enable: it streams over its packed host copy
                    weights = state.weights[i][j]
                    block = StreamedBlock(weights, self.device, PinnedStore(weights, state.stores))
                    weights.park(block.placeholders)  # the device buffers go with their last views
                    self.guard(block, *state.stacks[i].blocks[j])
                state.streamed[i][j] = block
                state.resident[i][j] = False
                moved.append(block)
        residents = state.phases.residents if state.phases is not None else None
        if residents is not None:
            residents.drop([block.weights for block in moved])
            if residents.empty():
                state.phases.residents = None
        nbytes = sum(block.weights.nbytes for block in moved)
        self._count(moved, +1)
        stats.resident_device_bytes -= nbytes
        self._resize_window()
        self.rewire(self.retry_for)
        return nbytes

    def keep(self, positions: list[tuple[int, int]]) -> int:
        """The streamed blocks at ``positions`` (``promotable`` ones) stay on the device from now on: loaded once by
        their store (``StreamedBlock.stay``: the compute stream waits for the fill), kept in ``state.kept`` (disable
        gives their tensors back through the store, as for a streamed block), the window sized again and the hooks
        rewired. The caller settled the streamer. Returns the bytes added. Where the device refuses a block's
        memory, the blocks before it stay kept (consistently: stats, window, hooks), it and the rest stream as
        before, and the error is raised."""
        state, stats = self.state, self.state.stats
        kept: list[StreamedBlock] = []
        residents = state.phases.residents
        if residents is not None:
            residents.come_back()  # one set, all on the device, before it grows
        try:
            for i, j in positions:
                block = state.streamed[i][j]
                block.stay(state.transfers)  # raises before anything changed for this block
                block.retired = True  # its state_dict() hooks stand aside: it computes on device views
                state.kept[(i, j)] = block
                state.streamed[i][j] = None
                state.resident[i][j] = True
                kept.append(block)
        finally:  # the blocks kept so far, also when one ran out of memory (raised after this)
            if kept:
                if state.phases.residents is None:
                    state.phases.residents = ResidentBlocks([], self.device, state.transfers)
                state.phases.residents.kept.extend(kept)
                self._count(kept, -1)
                stats.resident_device_bytes += sum(block.weights.nbytes for block in kept)
                self._resize_window()
                self.rewire(self.retry_for)
        return sum(block.weights.nbytes for block in kept)

    def _count(self, blocks: list[StreamedBlock], sign: int) -> None:
        """The stats of ``blocks`` starting (+1) or stopping (-1) to stream, each in its store's counters."""
        stats = self.state.stats
        nbytes = sum(block.weights.nbytes for block in blocks)
        stats.streamed_blocks += sign * len(blocks)
        stats.resident_blocks -= sign * len(blocks)
        stats.streamed_bytes_per_pass += sign * nbytes
        for block in blocks:
            name = block.store.name
            stats.store_blocks[name] = stats.store_blocks.get(name, 0) + sign
            stats.store_bytes[name] = stats.store_bytes.get(name, 0) + sign * block.weights.nbytes
            stats.store_host_bytes[name] = stats.store_host_bytes.get(name, 0) + sign * block.store.host_nbytes
            stats.store_counters.setdefault(name, {}).setdefault(block.weights.path.split(".")[0], {})

    def _shrink_window(self) -> tuple[str, int, int]:
        """Nothing resident to stream: the window keeps only the running block from now on (no prefetch: each
        block's copy no longer overlaps the previous block's compute, so steps are slower, but the step needs the
        least device memory a streamed step can). Returns ("window", the prefetched blocks dropped, bytes)."""
        state, stats = self.state, self.state.stats
        streamer = state.streamer
        streamer.settle()
        before = stats.in_flight_capacity
        dropped = (streamer.max_blocks or stats.slot_count or 1) - 1
        stats.slot_count = 1
        stats.in_flight_capacity = stats.slot_bytes
        stats.in_flight_blocks = 1
        stats.window_shrunk += 1
        streamer.resize(stats.in_flight_capacity, 1)
        gc.collect()  # the failed run's frames and activations
        release_freed_device_memory(self.device)
        return "window", dropped, max(before - stats.in_flight_capacity, 0)

    def _resize_window(self) -> None:
        """The window as ``_allocate_slots`` sizes it, over the blocks that stream now."""
        state, stats = self.state, self.state.stats
        blocks = [b for row in state.streamed for b in row if b is not None]
        count = self.depth + 1 if blocks else 0
        stats.slot_count = count
        stats.slot_bytes = max((sum(n * d.itemsize for d, n in b.store.device_numel.items()) for b in blocks),
                               default=0)
        stats.in_flight_capacity = count * stats.slot_bytes
        if stats.in_flight_blocks is not None or state.device_budget is None:
            stats.in_flight_blocks = count
        state.streamer.resize(stats.in_flight_capacity, stats.in_flight_blocks)


class StepRetry:
    """What a DiT's entry hook runs its forward through (``hooks.LockedCallbackHook``'s ``retry``): on an
    out-of-memory error, ``shrink`` streams the resident blocks and the forward runs once more, with one warning.
    Under ``"auto"`` (``shrink.headroom``, see ``headroom``) the resident set is fitted to the call's shape before
    the forward and the forward's peak measured after it."""

    def __init__(self, label: str, shrink: StepShrink) -> None:
        self.label = label
        self.shrink = shrink

    def __call__(self, run: Callable[..., Any], module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        headroom = self.shrink.headroom
        watch = headroom.before(self.shrink, self.label, args, kwargs) if headroom is not None else None
        try:
            output = run(module, args, kwargs)
        except torch.OutOfMemoryError as error:
            if headroom is not None:
                headroom.failed(watch)
            if not self.shrink.possible():
                raise  # nothing to shrink: the error as it came
            # Leave the except block before retrying, so the failed run's frames (and the activations they hold)
            # are gone from the traceback first.
            message = _first_line(error)
        else:
            if headroom is not None:
                headroom.after(watch)
            return output
        kind, blocks, nbytes = self.shrink()
        if kind == "residents":
            logger.warning(
                "%s ran out of device memory in a denoising step beside the DiT blocks a max_device_memory budget "
                "keeps resident (%s); %d resident blocks stream from now on like the others (%s released from the "
                "device) and the step runs again with the same inputs: the output is unchanged. Later steps run with "
                "the smaller resident set; disable_omni_offload() and enabling again plans the budget anew",
                self.label, message, blocks, format_bytes(nbytes))
        else:
            logger.warning(
                "%s ran out of device memory in a denoising step with nothing resident to stream (%s); the streaming "
                "window keeps only the running block from now on (%d prefetched blocks, up to %s, no longer held: "
                "copies stop overlapping compute, so steps are slower) and the step runs again with the same inputs: "
                "the output is unchanged. disable_omni_offload() and enabling again restores the window",
                self.label, message, blocks, format_bytes(nbytes))
        return run(module, args, kwargs)


class PhaseRetry:
    """What an encoder's entry hook runs its forward through (a streamed encoder's stack, or an encoder that comes
    in whole for its phase). An encoder runs before the DiT, beside the DiT blocks a budget keeps on the device (or
    ``headroom`` kept there); one that runs out of device memory there makes room (``Phases.make_room``: the resident
    blocks leave the device, exactly, and come back when their DiT runs) and runs again with the same inputs, once,
    with one warning. Under ``"auto"`` (``Phases.headroom``) the ceiling the resident set is planned under comes down
    by a margin, so that its later calls find the room; with an explicit budget its later calls make room before
    they run (``Phases.room_needed``). With no resident block on the device, or after making room, the error is
    raised as it came."""

    def __init__(self, label: str, phases: Any, streamer: Any) -> None:
        self.label = label
        self.phases = phases
        self.streamer = streamer

    def __call__(self, run: Callable[..., Any], module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        phases = self.phases
        if self.label in phases.room_needed:
            phases.make_room()
        try:
            return run(module, args, kwargs)
        except torch.OutOfMemoryError as error:
            residents = phases.residents
            if self.label in phases.room_needed or residents is None or residents.away:
                raise  # nothing to make room from: the error as it came
            message = _first_line(error)  # leave the except block first: the failed run's frames go
        if self.streamer is not None:
            self.streamer.settle()
        gc.collect()
        freed = phases.make_room()
        headroom = phases.headroom() if phases.headroom is not None else None
        if headroom is not None:  # "auto": fewer blocks stay from the next DiT forward on
            headroom.lower(self.label)
            later = ("The resident set is planned under a lower ceiling from the next denoising step on, so that its "
                     "later calls find this room")
            if self.label in phases.lowered_for:  # said once
                logger.info("%s ran out of device memory beside the DiT blocks kept on the device again (%s); they "
                            "left for it and it ran again", self.label, message)
                return run(module, args, kwargs)
            phases.lowered_for.add(self.label)
        else:
            phases.room_needed.add(self.label)
            later = "Its later calls make this room before they run"
        logger.warning(
            "%s ran out of device memory beside the DiT blocks kept on the device (%s); they leave the device for it "
            "(%s; they come back when their DiT runs, the output is unchanged) and it runs again with the same "
            "inputs. %s", self.label, message, format_bytes(freed), later)
        return run(module, args, kwargs)
