"""Auto's headroom, measured per call shape: under ``max_device_memory="auto"`` the DiT blocks that stay on the
device follow what each shape of call needs beside them, as measured on the device, not as predicted.

When enabling, auto predicts the activations' share (``budget.HEADROOM_SHARE`` of what this process may take) and
plans with the rest. From then on, at each DiT forward (its entry hook, the outermost forward, under the offload's
lock, where ``oom_retry`` runs it):

- The call's shape is its ``hidden_states`` (a DiT's first tensor argument): batch × tokens (× frames), what the
  activations grow with. The text's length is left out: a call with classifier-free guidance alternates two
  prompts' lengths, and the plan must not follow each.
- Before the forward, what the shape needs beside the resident weights (``beside``) is the largest measured for it;
  for a shape not measured yet, that of the nearest larger measured shape, or the largest measured shape's scaled
  by the ratio of sizes (a call at a larger shape re-plans before it runs); with nothing measured, the plan stays.
  The predicted peak is the resident bytes + beside (+ any growth of the streaming window). Above the ceiling auto
  read (``AutoBudget.limit``) less ``budget.peak_margin``, resident blocks the budget chose stream until it fits,
  the smallest first (the planner keeps the largest: theirs are the copies that outrun compute), each the nearest to
  another resident one; below it by a block or more, streamed blocks whose store fills them from this process's
  memory (the pinned copy, the lossless code: ``BlockStore.can_stay``) stay on the device, the largest first, each
  the farthest from the resident blocks of its stack (so streamed ones copy while resident ones compute), while the
  prediction stays under the ceiling. Nothing changes otherwise: the steps of one call at one shape re-plan at most
  once.
- A forward at a shape not measured yet, or the first after the resident set changed, is measured: the
  allocator's unused cache goes back to the driver before it, and what the allocator holds reserved after it
  (``budget.read_reserved``; the cache keeps every segment the forward reserved, so this is its peak; reserved, not
  allocated: the card and a per-process fraction cap what is reserved, fragmentation included), less the resident
  bytes at its start, is what the shape needs beside them. The largest measured for a shape is kept. Other forwards
  are not measured (giving the cache back costs a synchronisation).
- A forward that ran out of memory anyway (``oom_retry`` streams the resident blocks and runs it again) freezes its
  shape: no block is kept on the device for that shape again.

Explicit budgets are the user's numbers and stay as planned. Where the allocator keeps no statistics (the CPU),
nothing is measured and auto's prediction stays; tests replace ``read_reserved``. Moving blocks never changes a result:
a resident block computes on the same bytes its stream would have copied.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..config.offload import format_bytes
from . import budget as machine
from .memory import release_freed_device_memory
from .residency import size_classes

logger = logging.getLogger("diffusers_omni")


@dataclass(frozen=True)
class Shape:
    """A DiT call's shape: the DiT's label and its ``hidden_states``' dimensions; ``size`` their product."""

    label: str
    dims: tuple[int, ...]
    size: int

    def describe(self) -> str:
        return f"{self.label} {'×'.join(str(d) for d in self.dims)}"


def call_shape(label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shape | None:
    """The shape of a DiT call: its ``hidden_states`` (keyword, else the first tensor argument); ``None`` without
    a tensor argument."""
    tensor = kwargs.get("hidden_states")
    if not isinstance(tensor, torch.Tensor):
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if tensor is None:
        tensor = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    if tensor is None:
        return None
    return Shape(label, tuple(tensor.shape), tensor.numel())


@dataclass
class Need:
    """What a shape needs on the device beside the resident weights (``beside``: activations, the streaming window
    in use, whatever else the call holds there), measured with a window of ``window`` bytes."""

    beside: int
    window: int
    measured: bool = True  # False: predicted from another shape


@dataclass
class Watch:
    """One forward under watch: its shape and the resident bytes and window at its start (``measure``: whether
    what it reserves is read after it)."""

    shape: Shape
    resident: int
    window: int
    measure: bool


class Headroom:
    """Fits the resident DiT blocks to each call's shape (see the module's docstring): ``state`` is the offload's
    ``LayerwiseState``, ``depth`` its prefetch depth, ``limit`` the ceiling auto read. The hooks pass the offload's
    ``oom_retry.StepShrink``, whose ``stream``, ``keep``, ``candidates`` and ``promotable`` change the resident set
    (passed, not kept: it keeps this object, and a cycle would keep the pipeline alive after disable)."""

    def __init__(self, state: Any, device: torch.device, depth: int, limit: int) -> None:
        self.state = state
        self.depth = depth
        self.device = device
        self.limit = limit
        self.margin = machine.peak_margin(limit)
        self.ceiling = limit - self.margin
        self.needs: dict[Shape, Need] = {}
        self.frozen: set[Shape] = set()
        # (shape, need) pairs the resident set is fitted to as it is now (emptied when it changes): alternating DiTs
        # or shapes do not fit it again at every forward
        self._fitted: set[tuple[Shape, int]] = set()
        stats = self.state.stats
        stats.headroom_ceiling = self.ceiling

    # What a shape needs -------------------------------------------------------------------------------------------

    def need(self, shape: Shape) -> Need | None:
        """Measured for ``shape``, else predicted from the measured shapes of the same DiT, else ``None``."""
        known = self.needs.get(shape)
        if known is not None:
            return known
        # The same DiT's shapes; for a DiT not measured yet (Wan 2.2's second expert), the others'.
        same = [(other, need) for other, need in self.needs.items() if other.label == shape.label] or [
            (Shape(shape.label, other.dims, other.size), need) for other, need in self.needs.items()]
        larger = [(other, need) for other, need in same if other.size >= shape.size]
        if larger:
            _, need = min(larger, key=lambda item: (item[0].size, -item[1].beside))
            return Need(need.beside, need.window, measured=False)
        if same:
            other, need = max(same, key=lambda item: (item[0].size, item[1].beside))
            return Need(-(-need.beside * shape.size // other.size), need.window, measured=False)
        return None

    # The forward's hooks (under the offload's lock) -----------------------------------------------------------

    def before(self, shrink: Any, label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Watch | None:
        """Fit the resident set to this call's shape; measure the forward where its shape's need is not measured
        yet or the set just changed."""
        shape = call_shape(label, args, kwargs)
        if shape is None:
            return None
        need = self.need(shape)
        changed = False
        if need is not None and (shape, need.beside) not in self._fitted:
            changed = self._fit(shrink, shape, need)
            if changed:
                self._fitted.clear()
            self._fitted.add((shape, need.beside))
        measure = (need is None or not need.measured or changed) and \
            machine.read_reserved(self.device, empty_cache=True) is not None
        stats = self.state.stats
        return Watch(shape, stats.resident_device_bytes, stats.in_flight_capacity, measure)

    def after(self, watch: Watch | None) -> None:
        """The forward returned: record what its shape needed beside the resident weights, if it was measured."""
        if watch is None or not watch.measure:
            return
        reserved = machine.read_reserved(self.device)
        if reserved is None:
            return
        beside = max(reserved - watch.resident, 0)
        known = self.needs.get(watch.shape)
        if known is None or beside > known.beside:
            self.needs[watch.shape] = Need(beside, watch.window)
            self.state.stats.headroom[watch.shape.describe()] = beside
            logger.info("layerwise offload: %s needs %s on %s beside the resident weights (measured)",
                        watch.shape.describe(), format_bytes(beside), self.device)

    def failed(self, watch: Watch | None) -> None:
        """The forward ran out of memory (``oom_retry`` retries it): no block stays on the device for its shape, and
        the ceiling comes down by a margin."""
        if watch is not None:
            self.frozen.add(watch.shape)
        self.lower(watch.shape.label if watch is not None else "a DiT")

    def lower(self, what: str) -> None:
        """``what`` ran out of device memory where the plan said it would fit (the allocator's fragmentation, a
        phase not measured): the ceiling comes down by a margin, and the next DiT forward fits the resident set
        to it (an encoder that ran out beside the resident blocks then finds more room at its next call)."""
        self.ceiling = max(self.ceiling - self.margin, 0)
        self._fitted.clear()
        self.state.stats.headroom_ceiling = self.ceiling
        self.state.stats.headroom_lowered += 1
        logger.info("layerwise offload: %s ran out of device memory beside the resident weights; the ceiling they are "
                    "planned under comes down to %s", what, format_bytes(self.ceiling))

    # Changing the resident set ----------------------------------------------------------------------------------

    def _window(self, largest: int) -> int:
        """The window's bytes when the largest streamed block takes ``largest`` bytes on the device (0: none
        streams), as ``oom_retry`` sizes it."""
        return (self.depth + 1) * largest

    def _peak(self, need: Need, resident: int, window: int) -> int:
        return resident + need.beside + max(0, window - need.window)

    def _fit(self, shrink: Any, shape: Shape, need: Need) -> bool:
        """Stream or keep blocks so that ``need`` fits under the ceiling; whether anything changed."""
        state, stats = self.state, self.state.stats
        resident = stats.resident_device_bytes
        streamed = {(i, j): sum(n * d.itemsize for d, n in b.store.device_numel.items())
                    for i, row in enumerate(state.streamed) for j, b in enumerate(row) if b is not None}
        if self._peak(need, resident, self._window(max(streamed.values(), default=0))) > self.ceiling:
            chosen = self._to_stream(shrink.candidates(), need, resident, streamed)
            if not chosen:
                return False
            state.streamer.settle()
            nbytes = shrink.stream(chosen)
            gc.collect()
            release_freed_device_memory(self.device)
            stats.headroom_streamed += len(chosen)
            stats.headroom_streamed_bytes += nbytes
            self._log("stream from now on", shape, need, chosen, nbytes)
            return True
        if shape in self.frozen:
            return False
        chosen = self._to_keep(shrink.promotable(), need, resident, streamed)
        if not chosen:
            return False
        state.streamer.settle()
        before = stats.resident_device_bytes
        try:
            shrink.keep(chosen)
        except torch.OutOfMemoryError as error:
            # The device had less room than measured (another process took some, say): the blocks kept so far stay,
            # the others stream as before, and this shape keeps no more.
            self.frozen.add(shape)
            gc.collect()
            release_freed_device_memory(self.device)
            logger.info("layerwise offload: keeping DiT blocks on %s for %s ran out of memory (%s); they stream as "
                        "before", self.device, shape.describe(), str(error).splitlines()[0] if str(error) else "")
        kept = [p for p in chosen if state.resident[p[0]][p[1]]]
        nbytes = stats.resident_device_bytes - before
        stats.headroom_kept += len(kept)
        stats.headroom_kept_bytes += nbytes
        if kept:
            self._log("stay on the device from now on", shape, need, kept, nbytes)
        return bool(kept)

    def _log(self, what: str, shape: Shape, need: Need, chosen: list[tuple[int, int]], nbytes: int) -> None:
        logger.info("layerwise offload: %s needs %s beside the resident weights (%s); %d DiT blocks (%s) %s, for "
                    "a peak within %s", shape.describe(), format_bytes(need.beside),
                    "measured" if need.measured else "predicted from another shape", len(chosen),
                    format_bytes(nbytes), what, format_bytes(self.ceiling))

    def _spread(self, i: int, j: int, resident: list[bool]) -> int:
        """How far block ``j`` of stack ``i`` is from the nearest other resident block of its stack (cyclic)."""
        n = len(resident)
        distances = [min(abs(j - k), n - abs(j - k)) for k, kept in enumerate(resident) if kept and k != j]
        return min(distances, default=n)

    def _to_keep(self, promotable: list[tuple[int, int]], need: Need, resident: int,
                 streamed: dict[tuple[int, int], int]) -> list[tuple[int, int]]:
        """Streamed blocks (``streamed``: position → device bytes) to keep on the device while the prediction
        stays under the ceiling: size class by size class, the largest first, each the farthest from the stack's
        resident blocks."""
        state = self.state
        plan = [list(row) for row in state.resident]
        left = dict(streamed)
        chosen: list[tuple[int, int]] = []
        sizes = [state.weights[i][j].nbytes for i, j in promotable]
        for group in size_classes(sizes, list(range(len(promotable)))):
            pending = [promotable[g] for g in group]
            while pending:
                for position in sorted(pending, key=lambda p: (-self._spread(p[0], p[1], plan[p[0]]), p)):
                    i, j = position
                    nbytes = state.weights[i][j].nbytes
                    largest = max((b for p, b in left.items() if p != position), default=0)
                    if self._peak(need, resident + nbytes, self._window(largest)) <= self.ceiling:
                        del left[position]
                        resident += nbytes
                        plan[i][j] = True
                        chosen.append(position)
                        pending.remove(position)
                        break
                else:
                    break  # none of this class fits any more
        return chosen

    def _to_stream(self, candidates: list[tuple[int, int]], need: Need, resident: int,
                   streamed: dict[tuple[int, int], int]) -> list[tuple[int, int]]:
        """Resident blocks the budget chose that stream until the prediction is under the ceiling (all of them
        when even that is not enough: the least a step can take beside the window): size class by size class, the
        smallest first, each the nearest to another resident block of its stack."""
        state = self.state
        plan = [list(row) for row in state.resident]
        largest = max(streamed.values(), default=0)
        chosen: list[tuple[int, int]] = []
        sizes = [state.weights[i][j].nbytes for i, j in candidates]
        for group in reversed(size_classes(sizes, list(range(len(candidates))))):
            pending = [candidates[g] for g in group]
            while pending:
                if self._peak(need, resident, self._window(largest)) <= self.ceiling:
                    return chosen
                position = min(pending, key=lambda p: (state.weights[p[0]][p[1]].nbytes,
                                                       self._spread(p[0], p[1], plan[p[0]]), p))
                i, j = position
                nbytes = state.weights[i][j].nbytes
                largest = max(largest, nbytes)  # a block takes its packed bytes on the device
                resident -= nbytes
                plan[i][j] = False
                chosen.append(position)
                pending.remove(position)
        return chosen


__all__ = ["Headroom", "Need", "Shape", "Watch", "call_shape"]
