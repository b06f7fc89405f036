"""The streaming window: which streamed blocks are on the device, and when each one loads and leaves.

A ``StreamedBlock`` is one block's device buffers (made once, their storage freed between loads) and its store (where
its bytes live between loads: ``stores``). The ``Streamer`` holds the in-flight window: a load takes a slot (bytes
of the window), allocates the block's memory on the compute stream and asks the block's store to fill it on the
copy stream; the block's hooks call ``begin`` (wait for its copy, bind its tensors, load ahead) and ``end`` (park its
tensors, free its memory). Ordering needs no host synchronisation (see the layerwise module's docstring).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from time import perf_counter

import torch

from .hooks import EAGER_ONLY
from .memory import PackedWeights, Transfers, placeholder
from .stats import LayerwiseStats
from .stores import BlockStore


class Slot:
    """One in-flight block: the events ordering its copy (after the memory is free on the compute stream; before
    the block computes) and whether the compute stream has waited for that copy yet."""

    def __init__(self, transfers: Transfers) -> None:
        self.allocated = transfers.new_event()
        self.ready = transfers.new_event()
        self.owner: StreamedBlock | None = None
        self.nbytes = 0
        self.awaited = False

    def release(self) -> None:
        if self.owner is not None:
            self.owner.free_device_memory()
            self.owner.slot = None
        self.owner = None
        self.awaited = False


class StreamedBlock:
    """A streamed block's host copy and its device buffers (one per dtype). The buffers and the views of every
    tensor in them are made once; between loads their storage is freed (resized to zero bytes) and each load
    allocates it again from the caching allocator, so the views stay valid and are not rebuilt for every call
    (hundreds of them per step for a quantized DiT: host time on the critical path of a host-bound step)."""

    def __init__(self, weights: PackedWeights, device: torch.device, store: BlockStore | None = None) -> None:
        self.weights = weights
        self.device = device
        self.store = store  # where its bytes live between loads (stores.base)
        self.placeholders = [placeholder(s.dtype, device) for s in weights.slots]
        self.slot: Slot | None = None
        self.running = False
        self.retired = False  # it stays on the device (``stay``, ``headroom``): its ``state_dict()`` hooks stand aside
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.views: list[torch.Tensor] = []
        self._storages: list[tuple[torch.UntypedStorage, int]] = []  # (storage, bytes when allocated)

    def allocate(self) -> dict[torch.dtype, torch.Tensor]:
        """Device memory for one load (on the current stream); returns the device buffers, one per dtype."""
        if not self.buffers:
            # Sized as the store fills them (a rank's shard is gathered into a buffer padded to N shards).
            numel = self.store.device_numel if self.store is not None else None
            self.buffers, self.views = self.weights.device_buffers(self.device, numel)
            self._storages = [(b.untyped_storage(), b.numel() * b.element_size()) for b in self.buffers.values()]
        else:
            for storage, nbytes in self._storages:
                storage.resize_(nbytes)
        return self.buffers

    def free_device_memory(self) -> None:
        for storage, _ in self._storages:
            storage.resize_(0)

    def stay(self, transfers: Transfers) -> None:
        """Load the block for good (``headroom``: it stays on the device): its buffers filled by its store, the
        compute stream ordered after the fill, its tensors bound. ``leave_device`` frees them again."""
        with torch.inference_mode(False):
            buffers = self.allocate()
        allocated, ready = transfers.new_event(), transfers.new_event()
        transfers.record_on_compute(allocated)
        try:
            self.store.fill(buffers, transfers, allocated, ready)
        except BaseException:
            transfers.synchronize()  # nothing may still write the memory freed here
            self.free_device_memory()
            raise
        transfers.compute_waits_for(ready)
        with torch.inference_mode(False):
            self.weights.bind(self.views)

    def leave_device(self) -> None:
        """A block loaded with ``stay`` leaves the device: its tensors back on their placeholders, its memory freed
        (stream-ordered after the compute that used it)."""
        with torch.inference_mode(False):
            self.weights.park(self.placeholders)
        self.free_device_memory()


class Streamer:
    """The in-flight window and the per-stack rings that feed it. Hot-path methods run on every block call.

    The window holds at most ``capacity`` bytes (``prefetch_depth + 1`` largest blocks) and, when ``max_blocks`` is
    set, at most that many blocks. With a budget (no block limit) smaller blocks can have more loads in flight, so
    a run of small streamed blocks or of resident blocks keeps the copy engine ahead within the reserved bytes.
    Without one, the block limit keeps device memory at the running block plus ``prefetch_depth`` prefetched ones.
    """

    def __init__(self, capacity: int, transfers: Transfers, stats: LayerwiseStats,
                 max_blocks: int | None = None,
                 before_stack: Callable[[list[StreamedBlock]], None] | None = None) -> None:
        self.capacity = capacity
        # Called with a stack's streamed blocks when it is entered (a file-backed store requests their reads).
        self.before_stack = before_stack
        self.max_blocks = max_blocks
        self.transfers = transfers
        self.stats = stats
        self.in_flight: deque[Slot] = deque()  # load order
        self.in_flight_bytes = 0
        self._spare: list[Slot] = []

    def _full(self, nbytes: int) -> bool:
        if self.in_flight_bytes + nbytes > self.capacity:
            return True
        return self.max_blocks is not None and len(self.in_flight) >= self.max_blocks

    def _take_slot(self, nbytes: int, evict: bool) -> Slot | None:
        # Prefetches only use free room; evicting a prefetched block that has not run yet would waste its copy.
        while self._full(nbytes):
            oldest = self.in_flight[0] if self.in_flight else None
            if oldest is None or oldest.owner.running or not evict:
                return None
            self.free(oldest)
        slot = self._spare.pop() if self._spare else Slot(self.transfers)
        slot.nbytes = nbytes
        self.in_flight.append(slot)
        self.in_flight_bytes += nbytes
        if self.in_flight_bytes > self.stats.max_in_flight_bytes:
            self.stats.max_in_flight_bytes = self.in_flight_bytes
        return slot

    def free(self, slot: Slot) -> None:
        if not slot.awaited:
            # A prefetched block evicted before it ran: nothing on the compute stream is ordered after its copy, and
            # the compute stream may reuse the memory as soon as it is freed.
            self.transfers.compute_waits_for(slot.ready)
        slot.release()
        self._return_slot(slot)

    def _return_slot(self, slot: Slot) -> None:
        """Take ``slot`` out of the window and keep it for reuse."""
        self.in_flight.remove(slot)
        self.in_flight_bytes -= slot.nbytes
        slot.nbytes = 0
        self._spare.append(slot)

    def load(self, block: StreamedBlock, evict: bool = True) -> bool:
        slot = self._take_slot(block.weights.nbytes, evict)
        if slot is None:
            return False
        try:
            # Normal (not inference) tensors, so parameters never point at inference tensors between calls.
            with torch.inference_mode(False):
                buffers = block.allocate()
            # The memory is allocated on the compute stream, which may have used it until now: the copy waits for
            # that. No ``record_stream`` for the copy stream: the compute stream waits for the copy before the block
            # runs (or before the memory is freed, see ``free``), so later compute-stream uses are ordered after it.
            self.transfers.record_on_compute(slot.allocated)
            block.store.fill(buffers, self.transfers, slot.allocated, slot.ready)
        except BaseException:
            self.transfers.synchronize()  # nothing may still copy into the memory freed here
            block.free_device_memory()
            self._return_slot(slot)  # the load failed before its copy was queued
            raise
        slot.owner = block
        block.slot = slot
        self.stats.loads += 1
        self.stats.copied_bytes += block.weights.nbytes
        return True

    def _load_ahead(self, blocks: tuple[StreamedBlock, ...], evict: bool = False) -> None:
        """Load ``blocks`` in order, those not loaded yet, until the window is full."""
        for block in blocks:
            if block.slot is None and not self.load(block, evict=evict):
                break

    @torch.compiler.disable(reason=EAGER_ONLY)
    def begin(self, block: StreamedBlock | None, lookahead: tuple[StreamedBlock, ...]) -> None:
        start = perf_counter()
        self._begin(block, lookahead)
        self.stats.hook_seconds += perf_counter() - start

    def _begin(self, block: StreamedBlock | None, lookahead: tuple[StreamedBlock, ...]) -> None:
        if block is not None:
            if block.slot is None:
                self.stats.on_demand_loads += 1
                if not self.load(block):
                    raise RuntimeError(
                        f"layerwise offload: no free slot for block {block.weights.path!r}; every slot holds a "
                        "running block (are blocks calling each other?)"
                    )
            if not block.slot.awaited:
                self.transfers.compute_waits_for(block.slot.ready)
                block.slot.awaited = True
            if not block.running:  # a last block's output layers begin it again while it runs
                with torch.inference_mode(False):
                    block.weights.bind(block.views)
                block.running = True
        self._load_ahead(lookahead)

    @torch.compiler.disable(reason=EAGER_ONLY)
    def end(self, block: StreamedBlock) -> None:
        start = perf_counter()
        block.weights.park(block.placeholders)
        block.running = False
        if block.slot is not None:
            self.free(block.slot)
        self.stats.hook_seconds += perf_counter() - start

    @torch.compiler.disable(reason=EAGER_ONLY)
    def end_pass(self, block: StreamedBlock, first: tuple[StreamedBlock, ...]) -> None:
        """The stack's last streamed block ended: the next pass's first blocks load now, after its activations are
        freed, not while it runs (that overlap would raise the peak above the window's)."""
        self.end(block)
        self.load_next_pass(first)

    @torch.compiler.disable(reason=EAGER_ONLY)
    def load_next_pass(self, first: tuple[StreamedBlock, ...]) -> None:
        """The last block (which carries the DiT's output layers, so it stays bound until the forward returns)
        finished computing: the next pass's first blocks load now, while the output layers run."""
        start = perf_counter()
        self._load_ahead(first)
        self.stats.hook_seconds += perf_counter() - start

    def release_all(self) -> None:
        """Free every in-flight block's device memory (``disable``, after a synchronize)."""
        while self.in_flight:
            slot = self.in_flight[0]
            slot.awaited = True  # the caller synchronized: no copy is pending
            self.free(slot)

    def settle(self) -> None:
        """A forward raised midway and will run again (``oom_retry``): the blocks it left running end (parked on
        their placeholders), and every in-flight block is freed once the copies queued for them are done, so the
        new run starts from an empty window, as a step after ``disable``/``enable`` would."""
        self.transfers.synchronize()
        for slot in list(self.in_flight):
            if slot.owner is not None and slot.owner.running:
                self.end(slot.owner)
        self.release_all()

    def resize(self, capacity: int, max_blocks: int | None) -> None:
        """A new window (``oom_retry``: resident blocks that now stream may be larger than any streamed before)."""
        self.capacity = capacity
        self.max_blocks = max_blocks

    def release_idle(self, keep: frozenset[int] = frozenset()) -> None:
        """Free the in-flight blocks that are not running, except those whose ``id`` is in ``keep`` (a stack about
        to run keeps its own prefetched blocks): another phase starts, and another stack's prefetched blocks would
        sit in its memory (or in the window) until evicted."""
        for slot in list(self.in_flight):
            owner = slot.owner
            if owner is not None and not owner.running and id(owner) not in keep:
                self.free(slot)

    @torch.compiler.disable(reason=EAGER_ONLY)
    def enter_stack(self, blocks: list[StreamedBlock], first: tuple[StreamedBlock, ...],
                    own: frozenset[int] | None = None) -> None:
        # A block whose forward raised never ran its end(); settle it before the stack runs again.
        for block in blocks:
            if block.running:
                self.end(block)
        if own is not None:
            self.release_idle(own)
        if self.before_stack is not None:
            self.before_stack(blocks)
        self._load_ahead(first, evict=True)


def lookahead_blocks(row: list[StreamedBlock | None], position: int, capacity: int,
               limit: int | None = None, wrap: bool = True) -> tuple[StreamedBlock, ...]:
    """The streamed blocks after ``position`` (with ``wrap``, wrapping to the stack's start: the next step) that
    fit in ``capacity`` bytes together, at most ``limit`` of them; at least one when there is another block."""
    ring = [(i, b) for i, b in enumerate(row) if b is not None]
    after = [b for i, b in ring if i > position] + ([b for i, b in ring if i <= position] if wrap else [])
    current = row[position]
    chosen, total = [], 0
    for block in after:
        if block is current:
            continue
        total += block.weights.nbytes
        if chosen and (total > capacity or (limit is not None and len(chosen) >= limit)):
            break
        chosen.append(block)
    return tuple(chosen)
