"""Layerwise offload: DiT blocks stream from flat host buffers onto the device, one prefetch ring per DiT.

Each block's tensors live in one contiguous (pinned) host buffer per dtype. Without a device-memory budget at most
``prefetch_depth + 1`` streamed blocks are on the device at once (the running one and those prefetched, as
Diffusers' group offload holds its running and next group); with a budget, the reserve of ``prefetch_depth + 1``
largest blocks is filled with as many smaller blocks as fit. When a block starts, its tensors are rebound to views
of its device buffer and the next streamed blocks are copied on a copy stream; when it ends, its tensors go back
to empty placeholders and its buffer's memory is freed. Device memory is taken from PyTorch's caching allocator at
the size of each block, so it follows the blocks actually in flight (a small block does not hold a slot sized for
the largest); a block's buffers and views are made once and only their storage is allocated and freed per load.
Ordering needs no host synchronisation: memory is allocated on the compute stream and the copy stream waits for
an event recorded right after the allocation (so the memory's previous users have finished), and the compute
stream waits for the copy's ``ready`` event before the block runs (or before a prefetched block that never ran is
freed), so the compute stream's later uses of that memory come after the copy.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import Any, Callable

import torch
import torch.nn as nn

from ..config.offload import OffloadStrategy, format_bytes
from ..models.base import tail_attrs_for
from ..utils.progress import byte_progress
from . import vae_tiling
from .base import Journal, OffloadBackend
from .disk import (
    BlockSource,
    DiskReader,
    DiskReadError,
    FileViews,
    StagingRing,
    block_source,
    checkpoint_names,
    find_checkpoint,
    plain_leaf,
    verify_block,
    view_source,
)
from .discovery import (
    DIT,
    ENCODER,
    Stack,
    Topology,
    check_no_foreign_offload,
    check_no_self_rewriting_weights,
    check_stacks,
    check_topology,
    discover_components,
    encoder_stack,
    named_tensors,
    resolve_stacks,
)
from .hooks import (
    EAGER_ONLY,
    LAYERWISE_BLOCK_HOOK,
    LAYERWISE_ENTRY_HOOK,
    CallbackHook,
    ForwardLock,
    InstalledHooks,
    LockedCallbackHook,
    inference_only_message,
    refresh_registry_caches,
    refuse_pickling,
)
from .host_plan import HostCandidate, plan_host_memory, spread_positions
from .memory import (
    HostMemory, PackedWeights, Transfers, placeholder, release_freed_device_memory, release_freed_host_memory,
)
from .tensors import PLAIN_TENSOR_TYPES, TensorSet, tensor_nbytes

logger = logging.getLogger("diffusers_omni")


def plan_residency(
    block_bytes: list[int], forced: list[bool], fixed_bytes: int, budget: int | None, slot_count: int,
    never: list[bool] | None = None, labels: list[str] | None = None, fixed_detail: str = "",
) -> list[bool]:
    """Which blocks stay on the device.

    ``forced`` blocks are always resident; ``never`` blocks (an encoder's, run once per call where a DiT's run every
    step) stay resident only when everything fits, and otherwise stream, sizing the window like any other streamed
    block. Without a budget the rest stream. With one, everything is resident if
    it fits; otherwise ``slot_count`` slots for the largest candidate (the streaming window) are reserved and the
    rest of the budget keeps blocks resident: size class by size class, the largest first (``_residency_order``),
    each class as an evenly spread set, and no run of consecutive resident blocks longer than the window (or than
    an evenly spread set of the same budget would have; ``_longest_chosen_run``), so the streamed ones copy while
    resident ones compute.
    """
    resident = list(forced)
    never = never or [False] * len(block_bytes)
    streamable = [i for i, f in enumerate(forced) if not f]
    candidates = [i for i in streamable if not never[i]]
    if budget is None or not streamable:
        return resident
    forced_bytes = sum(b for b, f in zip(block_bytes, forced) if f)
    if fixed_bytes + forced_bytes + sum(block_bytes[i] for i in streamable) <= budget:
        return [True] * len(block_bytes)
    window = slot_count * max(block_bytes[i] for i in streamable)
    available = budget - fixed_bytes - forced_bytes - window
    if available < 0:
        needed = fixed_bytes + forced_bytes + window
        largest = max(streamable, key=lambda i: block_bytes[i])
        block = f" (the largest streamed block, {labels[largest]!r})" if labels else ""
        raise ValueError(
            f"max_device_memory={budget} ({format_bytes(budget)}) is too small; allowed: at least "
            f"{needed} ({format_bytes(needed)}) = non-block weights {format_bytes(fixed_bytes)}{fixed_detail} + "
            f"resident blocks {format_bytes(forced_bytes)} + {slot_count} streaming slots of "
            f"{format_bytes(window // slot_count)}{block}"
        )
    if not candidates:
        return resident
    # The longest resident run allowed: the window, or as long as an evenly spread set filling the same budget
    # would have (a budget near the model's size keeps long runs either way; its few streamed blocks copy in time).
    spread, _ = _spread_fill(block_bytes, resident, candidates, available)
    cap = max(window, _longest_chosen_run(block_bytes, forced, spread))
    for group in _residency_order(block_bytes, candidates):
        resident, used = _spread_fill(block_bytes, resident, group, available,
                                      accept=lambda plan: _longest_chosen_run(block_bytes, forced, plan) <= cap)
        available -= used
    return resident


def _spread_fill(block_bytes: list[int], resident: list[bool], group: list[int], available: int,
                 accept: Callable[[list[bool]], bool] = lambda plan: True) -> tuple[list[bool], int]:
    """``resident`` plus the most blocks of ``group``, evenly spread among them, that fit in ``available`` bytes
    and that ``accept`` takes; and the bytes they add."""
    for count in range(len(group), 0, -1):
        chosen = [group[p] for p in spread_positions(count, len(group))]
        used = sum(block_bytes[i] for i in chosen)
        if used > available:
            continue
        plan = list(resident)
        for i in chosen:
            plan[i] = True
        if accept(plan):
            return plan, used
    return list(resident), 0


def _longest_chosen_run(block_bytes: list[int], forced: list[bool], resident: list[bool]) -> int:
    """Bytes of the longest run of consecutive resident blocks (cyclic: the last blocks run right before the next
    step's first) holding at least one block the plan chose. While such a run computes, the copy engine can only
    fill the window; a longer run leaves it idle where a copy-bound model (a bf16 DiT) needs it busy."""
    n = len(resident)
    if all(resident):
        return sum(block_bytes)
    start = next(i for i in range(n) if not resident[i])  # a run never wraps past a streamed block
    longest = run_bytes = 0
    chose = False
    for k in range(1, n + 1):
        i = (start + k) % n
        if resident[i]:
            run_bytes += block_bytes[i]
            chose = chose or not forced[i]
            continue
        if chose:
            longest = max(longest, run_bytes)
        run_bytes, chose = 0, False
    return longest


# Blocks within this fraction of a size class's largest block are one class: GGUF mixes (e.g. Q4_K_M) make blocks of
# one kind differ by a few percent, and a last block carrying the output layers is ~14% larger than its FLUX peers.
_SIZE_CLASS_TOLERANCE = 0.8


def _residency_order(block_bytes: list[int], candidates: list[int]) -> list[list[int]]:
    """The candidates in size classes, largest first, each in stack order.

    Where a stack mixes block sizes (FLUX's and HunyuanVideo's double-stream blocks are ~2.4x their single-stream
    ones), the larger blocks carry a second stream's weights that only see the text tokens: the most bytes per
    unit of compute, so theirs are the copies that outrun compute in a run of them (FLUX int8 and Q8_0 on an H200).
    Keeping those resident first leaves the streamed bytes where compute can hide them. A stack of equal blocks
    (Wan) is one class.
    """
    order = sorted(candidates, key=lambda i: (-block_bytes[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and block_bytes[i] >= _SIZE_CLASS_TOLERANCE * block_bytes[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(group) for group in groups]


class _Slot:
    """One in-flight block: the events ordering its copy (after the memory is free on the compute stream; before
    the block computes) and whether the compute stream has waited for that copy yet."""

    def __init__(self, transfers: Transfers) -> None:
        self.allocated = transfers.new_event()
        self.ready = transfers.new_event()
        self.owner: _StreamedBlock | None = None
        self.nbytes = 0
        self.awaited = False

    def release(self) -> None:
        if self.owner is not None:
            self.owner.free_device_memory()
            self.owner.slot = None
        self.owner = None
        self.awaited = False


class _StreamedBlock:
    """A streamed block's host copy and its device buffers (one per dtype). The buffers and the views of every
    tensor in them are made once; between loads their storage is freed (resized to zero bytes) and each load
    allocates it again from the caching allocator, so the views stay valid and are not rebuilt for every call
    (hundreds of them per step for a quantized DiT: host time on the critical path of a host-bound step)."""

    def __init__(self, weights: PackedWeights, device: torch.device) -> None:
        self.weights = weights
        self.device = device
        self.placeholders = [placeholder(s.dtype, device) for s in weights.slots]
        self.slot: _Slot | None = None
        self.running = False
        self.disk: BlockSource | None = None  # no host copy: read from the checkpoint at each load (max_host_memory)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.views: list[torch.Tensor] = []
        self._copy_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._storages: list[tuple[torch.UntypedStorage, int]] = []  # (storage, bytes when allocated)

    def allocate(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Device memory for one load (on the current stream); returns the (host, device) copy pairs."""
        if not self.buffers:
            self.buffers, self.views = self.weights.device_buffers(self.device)
            self._copy_pairs = [(host, self.buffers[dtype].narrow(0, 0, host.numel()))
                                for dtype, host in self.weights.host.items()]
            self._storages = [(b.untyped_storage(), b.numel() * b.element_size()) for b in self.buffers.values()]
        else:
            for storage, nbytes in self._storages:
                storage.resize_(nbytes)
        return self._copy_pairs

    def free_device_memory(self) -> None:
        for storage, _ in self._storages:
            storage.resize_(0)


class _PhaseUnit:
    """Weights of one component that are on the device only for its phase: an encoder's weights outside its blocks
    (embeddings, final norm, LM head) while the encoder runs, or a whole VAE (or an encoder without blocks) from its
    first use until another phase starts or the pipeline call ends. Onloading copies the packed host copy into one
    fresh device buffer per dtype on the compute stream (no event needed) and rebinds the tensors to views of it;
    parking rebinds them to their host views and drops the device buffers (weights do not change while offload is
    enabled)."""

    def __init__(self, label: str, module: nn.Module, weights: PackedWeights, per_call: bool) -> None:
        self.label = label
        self.module = module
        self.weights = weights
        self.per_call = per_call  # parked when its component's forward returns (an encoder), else when replaced
        self.onloaded = False
        self.resident = False  # the budget keeps it on the device for good
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def onload(self, device: torch.device) -> None:
        with torch.inference_mode(False):
            self._buffers, views = self.weights.device_buffers(device)
            for dtype, host in self.weights.host.items():
                self._buffers[dtype].narrow(0, 0, host.numel()).copy_(host, non_blocking=True)
            self.weights.bind(views)
        self.onloaded = True

    def park(self) -> None:
        with torch.inference_mode(False):
            self.weights.park(self.weights.host_views)
        self._buffers = {}
        self.onloaded = False


@dataclass
class LayerwiseStats:
    streamed_blocks: int = 0
    resident_blocks: int = 0
    slot_count: int = 0  # largest blocks that fit in the in-flight window (prefetch depth + 1)
    slot_bytes: int = 0  # the largest streamed block
    in_flight_capacity: int = 0  # bytes of streamed blocks on the device at once, at most
    in_flight_blocks: int | None = None  # streamed blocks on the device at once, at most (None: bytes only)
    max_in_flight_bytes: int = 0  # the most bytes of streamed blocks that were on the device at once
    hook_seconds: float = 0.0  # host time spent in the block hooks (loads, rebinding, releasing)
    streamed_bytes_per_pass: int = 0
    resident_device_bytes: int = 0
    host_bytes: int = 0
    host_memory_mode: str = ""
    loads: int = 0
    on_demand_loads: int = 0
    copied_bytes: int = 0
    phase_units: int = 0  # encoders' non-block weights and VAEs, on the device for their phase only
    phase_bytes: int = 0  # the largest of them
    phase_onloads: int = 0
    phase_onloaded_bytes: int = 0
    # max_host_memory: blocks with no host copy, read from their checkpoint files at each load
    disk_blocks: int = 0
    disk_bytes_per_pass: int = 0  # file bytes those blocks read per pass
    staging_bytes: int = 0  # the page-locked staging ring they are read into
    disk_reads: int = 0
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0  # the reader thread's time in reads (overlapping compute)
    disk_waits: int = 0  # loads that waited for their block's read
    disk_wait_seconds: float = 0.0
    # max_host_memory, alternating DiTs: blocks at one position share one host buffer, read when their DiT is back
    shared_buffers: int = 0
    shared_blocks: int = 0
    shared_bytes: int = 0
    shared_hits: int = 0  # loads that found their block in its shared buffer (nothing read)
    tiled_vaes: list[str] = field(default_factory=list)  # VAEs switched to tiling after running out of memory


class _Streamer:
    """The in-flight window and the per-stack rings that feed it. Hot-path methods run on every block call.

    The window holds at most ``capacity`` bytes (``prefetch_depth + 1`` largest blocks) and, when ``max_blocks`` is
    set, at most that many blocks. With a budget (no block limit) smaller blocks can have more loads in flight, so
    a run of small streamed blocks or of resident blocks keeps the copy engine ahead within the reserved bytes.
    Without one, the block limit keeps device memory at the running block plus ``prefetch_depth`` prefetched ones.
    """

    def __init__(self, capacity: int, transfers: Transfers, stats: LayerwiseStats,
                 max_blocks: int | None = None) -> None:
        self.capacity = capacity
        self.max_blocks = max_blocks
        self.transfers = transfers
        self.stats = stats
        self.in_flight: deque[_Slot] = deque()  # load order
        self.in_flight_bytes = 0
        self._spare: list[_Slot] = []

    def _full(self, nbytes: int) -> bool:
        if self.in_flight_bytes + nbytes > self.capacity:
            return True
        return self.max_blocks is not None and len(self.in_flight) >= self.max_blocks

    def _take_slot(self, nbytes: int, evict: bool) -> _Slot | None:
        # Prefetches only use free room; evicting a prefetched block that has not run yet would waste its copy.
        while self._full(nbytes):
            oldest = self.in_flight[0] if self.in_flight else None
            if oldest is None or oldest.owner.running or not evict:
                return None
            self.free(oldest)
        slot = self._spare.pop() if self._spare else _Slot(self.transfers)
        slot.nbytes = nbytes
        self.in_flight.append(slot)
        self.in_flight_bytes += nbytes
        if self.in_flight_bytes > self.stats.max_in_flight_bytes:
            self.stats.max_in_flight_bytes = self.in_flight_bytes
        return slot

    def free(self, slot: _Slot) -> None:
        if not slot.awaited:
            # A prefetched block evicted before it ran: nothing on the compute stream is ordered after its copy, and
            # the compute stream may reuse the memory as soon as it is freed.
            self.transfers.compute_waits_for(slot.ready)
        slot.release()
        self._return_slot(slot)

    def _return_slot(self, slot: _Slot) -> None:
        """Take ``slot`` out of the window and keep it for reuse."""
        self.in_flight.remove(slot)
        self.in_flight_bytes -= slot.nbytes
        slot.nbytes = 0
        self._spare.append(slot)

    def load(self, block: _StreamedBlock, evict: bool = True) -> bool:
        slot = self._take_slot(block.weights.nbytes, evict)
        if slot is None:
            return False
        # Normal (not inference) tensors, so parameters never point at inference tensors between calls.
        with torch.inference_mode(False):
            pairs = block.allocate()
        # The memory is allocated on the compute stream, which may have used it until now: the copy waits for that.
        # No ``record_stream`` for the copy stream: the compute stream waits for the copy before the block runs (or
        # before the memory is freed, see ``free``), so later compute-stream uses are ordered after it.
        self.transfers.record_on_compute(slot.allocated)
        self.transfers.copy(pairs, wait_for=slot.allocated, done=slot.ready)
        slot.owner = block
        block.slot = slot
        self.stats.loads += 1
        self.stats.copied_bytes += block.weights.nbytes
        return True

    def _load_ahead(self, blocks: tuple[_StreamedBlock, ...], evict: bool = False) -> None:
        """Load ``blocks`` in order, those not loaded yet, until the window is full."""
        for block in blocks:
            if block.slot is None and not self.load(block, evict=evict):
                break

    @torch.compiler.disable(reason=EAGER_ONLY)
    def begin(self, block: _StreamedBlock | None, lookahead: tuple[_StreamedBlock, ...]) -> None:
        start = perf_counter()
        self._begin(block, lookahead)
        self.stats.hook_seconds += perf_counter() - start

    def _begin(self, block: _StreamedBlock | None, lookahead: tuple[_StreamedBlock, ...]) -> None:
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
    def end(self, block: _StreamedBlock) -> None:
        start = perf_counter()
        block.weights.park(block.placeholders)
        block.running = False
        if block.slot is not None:
            self.free(block.slot)
        self.stats.hook_seconds += perf_counter() - start

    @torch.compiler.disable(reason=EAGER_ONLY)
    def end_pass(self, block: _StreamedBlock, first: tuple[_StreamedBlock, ...]) -> None:
        """The stack's last streamed block ended: the next pass's first blocks load now, after its activations are
        freed, not while it runs (that overlap would raise the peak above the window's)."""
        self.end(block)
        self.load_next_pass(first)

    @torch.compiler.disable(reason=EAGER_ONLY)
    def load_next_pass(self, first: tuple[_StreamedBlock, ...]) -> None:
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

    def release_idle(self, keep: frozenset[int] = frozenset()) -> None:
        """Free the in-flight blocks that are not running, except those whose ``id`` is in ``keep`` (a stack about
        to run keeps its own prefetched blocks): another phase starts, and another stack's prefetched blocks would
        sit in its memory (or in the window) until evicted."""
        for slot in list(self.in_flight):
            owner = slot.owner
            if owner is not None and not owner.running and id(owner) not in keep:
                self.free(slot)

    @torch.compiler.disable(reason=EAGER_ONLY)
    def enter_stack(self, blocks: list[_StreamedBlock], first: tuple[_StreamedBlock, ...],
                    own: frozenset[int] | None = None) -> None:
        # A block whose forward raised never ran its end(); settle it before the stack runs again.
        for block in blocks:
            if block.running:
                self.end(block)
        if own is not None:
            self.release_idle(own)
        self._request_reads(blocks)
        self._load_ahead(first, evict=True)

    def _request_reads(self, blocks: list[_StreamedBlock]) -> None:
        """Start reading what ``blocks`` need from disk before they load (nothing here: every block has a host
        copy; see ``_DiskStreamer``)."""


class _DiskStreamer(_Streamer):
    """The streamer when some blocks have no host copy (``max_host_memory``): such a block's load takes its bytes
    from the staging ring (``disk.StagingRing``: read from the checkpoint by the reader thread, waiting if the
    read is not done) and copies them to the device exactly as a host copy is copied; the staging buffer goes back
    to the ring once the copy is queued (its event recorded on the copy stream), and the reads of the next
    disk-backed blocks are requested. Blocks with a host copy load as in ``_Streamer``."""

    def __init__(self, capacity: int, transfers: Transfers, stats: LayerwiseStats, ring: StagingRing,
                 max_blocks: int | None = None) -> None:
        super().__init__(capacity, transfers, stats, max_blocks=max_blocks)
        self.ring = ring
        self._record = transfers.record_on_copy if transfers.asynchronous else None

    def load(self, block: _StreamedBlock, evict: bool = True) -> bool:
        source = block.disk
        if source is None:
            return super().load(block, evict)
        slot = self._take_slot(block.weights.nbytes, evict)
        if slot is None:
            return False
        try:
            staged = self.ring.take(source)
        except BaseException:
            self._return_slot(slot)  # the load failed before its copy was queued
            raise
        try:
            with torch.inference_mode(False):
                block.allocate()
            pairs = staged.pairs[source.index]
            if pairs is None:  # made once per (block, staging buffer): the hot path allocates nothing more
                views = source.views(staged.buffer)
                pairs = staged.pairs[source.index] = [(views[dtype], block.buffers[dtype]) for dtype in views]
            self.transfers.record_on_compute(slot.allocated)
            self.transfers.copy(pairs, wait_for=slot.allocated, done=slot.ready)
        except BaseException:
            self.transfers.synchronize()  # nothing may still copy into the memory freed here
            block.free_device_memory()
            self._return_slot(slot)
            self.ring.release(staged)
            raise
        self.ring.release(staged, self._record)
        slot.owner = block
        block.slot = slot
        self.stats.loads += 1
        self.stats.copied_bytes += block.weights.nbytes
        return True

    def _request_reads(self, blocks: list[_StreamedBlock]) -> None:
        # The stack's first disk-backed blocks not on the device yet are read now (another stack's staged reads
        # give way), while its first blocks load.
        wanted = []
        for block in blocks:
            if block.disk is not None and block.slot is None:
                wanted.append(block.disk)
                if len(wanted) == self.ring.ahead:
                    break
        if wanted:
            self.ring.want(tuple(wanted))


@dataclass
class LayerwiseState:
    """What one enable of layerwise offload built: discovered stacks, packed weights, slots, hooks, counters."""

    target: Any
    topology: Topology | None = None
    stacks: list[Stack] = field(default_factory=list)
    weights: list[list[PackedWeights]] = field(default_factory=list)
    resident: list[list[bool]] = field(default_factory=list)
    host_memory: HostMemory | None = None
    transfers: Transfers | None = None
    streamed: list[list[_StreamedBlock | None]] = field(default_factory=list)
    streamer: _Streamer | None = None
    tails: dict[str, list[tuple[str, nn.Module]]] = field(default_factory=dict)  # last block path → output layers
    hooks: InstalledHooks = field(default_factory=InstalledHooks)
    stats: LayerwiseStats = field(default_factory=LayerwiseStats)
    lock: ForwardLock | None = None  # held for each DiT's whole forward: callers in several threads take turns
    kinds: list[str] = field(default_factory=list)  # per stack: DIT (also extra streamed paths) or ENCODER
    units: list[_PhaseUnit] = field(default_factory=list)  # per-phase weights: encoders' non-block parts, VAEs
    stack_units: dict[int, _PhaseUnit] = field(default_factory=dict)  # encoder stack index → its non-block unit
    managed: dict[str, str] = field(default_factory=dict)  # component label → how it is managed (for logs)
    # max_host_memory: id(PackedWeights) → where that block's bytes are in its checkpoint (no host copy)
    disk: dict[int, BlockSource] = field(default_factory=dict)
    disk_reader: DiskReader | None = None
    # blocks (one per alternating DiT, same position) that share one host buffer; their sources are in ``disk`` too
    shared: list[list[BlockSource]] = field(default_factory=list)
    staging: StagingRing | None = None
    stop_reader: Any = None  # weakref.finalize: stops and joins the reader thread (disable, rollback, or GC)
    file_views: FileViews | None = None  # the process's file mappings, read once while enabling


class LayerwiseOffloadBackend(OffloadBackend):
    """Streams every block of every DiT through a few device slots; everything else stays on the device."""

    strategy = OffloadStrategy.LAYERWISE
    # Whether text/image encoders stream and VAEs come in for their phase (``dits_only=False``); the distributed
    # backends keep them on the device.
    manages_components = True
    stages = (
        "discover", "plan_host", "move_residents", "pack_blocks", "allocate_slots", "install_hooks", "install_guards",
        "prime",
    )
    # Whether a DiT's output layers (its declaration's ``tail_attrs``) stream with its last block.
    fold_tail = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self._state: LayerwiseState | None = None

    @property
    def max_device_memory(self) -> int | None:
        """The byte budget of DiT weights on the device (``config.max_device_memory``); ``None`` streams every
        block that is not forced resident."""
        return self.config.max_device_memory

    @property
    def stats(self) -> LayerwiseStats:
        """Counters since enable: blocks, slots, bytes copied, on-demand (not prefetched) loads."""
        if self._state is None:
            raise RuntimeError("layerwise offload is not enabled")
        return self._state.stats

    def _new_state(self, target: Any) -> LayerwiseState:
        self._state = LayerwiseState(target)
        return self._state

    def _forget(self) -> None:
        self._state = None

    @property
    def _manage_components(self) -> bool:
        return self.manages_components and not getattr(self.config, "dits_only", False)

    def _managed_modules(self, state: LayerwiseState) -> list[tuple[str, nn.Module]]:
        found = [(stack.name, stack.owner) for stack in state.stacks]
        seen = {id(module) for _, module in found}
        for unit in state.units:
            if id(unit.module) not in seen:
                found.append((unit.label, unit.module))
                seen.add(id(unit.module))
        return found

    def _component_units(self, state: LayerwiseState, plan) -> None:
        """Encoders stream their blocks (declared per family, else scanned) with their other weights in a unit for
        their phase; encoders without blocks and VAEs are one unit each. An encoder holding a path of
        ``plan.extra_streamed`` is left as the plan says (its other weights stay on the device)."""
        extra = [stack.owner for stack, kind in zip(state.stacks, state.kinds) if kind == DIT]
        for component in state.topology.encoders + state.topology.vaes:
            if any(_holds_any(component.module, {id(owner)}) for owner in extra):
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
                    unit = _PhaseUnit(component.label, component.module,
                                      PackedWeights(component.label, component.module, select=rest), per_call=True)
                    state.units.append(unit)
                    state.stack_units[len(state.stacks) - 1] = unit
                state.managed[component.label] = f"{len(stack.blocks)} blocks streamed ({source})"
            elif named_tensors(component.module):
                state.units.append(_PhaseUnit(component.label, component.module,
                                              PackedWeights(component.label, component.module),
                                              per_call=component.role == ENCODER))
                state.managed[component.label] = "on the device for its phase"

    # Enable stages ----------------------------------------------------------------------------------------

    def _stage_discover(self, state: LayerwiseState, journal: Journal) -> None:
        plan = self.config.plan
        state.topology = discover_components(state.target, plan)
        check_topology(state.topology)
        check_no_foreign_offload(state.topology, "layerwise")
        check_no_self_rewriting_weights(state.topology, self.device)
        state.stacks = resolve_stacks(state.target, state.topology, plan)
        state.kinds = [DIT] * len(state.stacks)
        if self._manage_components:
            self._component_units(state, plan)
        forced_paths = {c.path for c in state.topology.residents}
        state.weights = [self._stack_weights(stack, state, kind) for stack, kind in zip(state.stacks, state.kinds)]
        flat = [w for stack in state.weights for w in stack]
        never = [kind == ENCODER for stack, kind in zip(state.weights, state.kinds) for _ in stack]
        forced = [w.path in forced_paths or w.empty for w in flat]
        dit_bytes = sum(tensor_nbytes(t) for t in self._non_block_tensors(state))
        unit_bytes = max((u.weights.nbytes for u in state.units), default=0)
        budget = self.max_device_memory
        everything = dit_bytes + sum(w.nbytes for w in flat) + sum(u.weights.nbytes for u in state.units)
        units_resident = budget is not None and everything <= budget
        largest_unit = max(state.units, key=lambda u: u.weights.nbytes).label if state.units else ""
        resident = plan_residency(
            [w.nbytes for w in flat], forced, dit_bytes + (0 if units_resident else unit_bytes), budget,
            self.config.prefetch_depth + 1, never=never, labels=[w.path for w in flat],
            fixed_detail=(f" (the DiTs' {format_bytes(dit_bytes)} + the largest phase, {largest_unit!r}, "
                          f"{format_bytes(unit_bytes)})" if unit_bytes and not units_resident else ""),
        )
        for unit in state.units:
            unit.resident = units_resident
        it = iter(resident)
        state.resident = [[next(it) for _ in stack] for stack in state.weights]
        streamed = [w for w, r in zip(flat, resident) if not r]
        state.stats.streamed_blocks = len(streamed)
        state.stats.resident_blocks = sum(1 for w, r in zip(flat, resident) if r and not w.empty)
        state.stats.streamed_bytes_per_pass = sum(w.nbytes for w in streamed)
        state.stats.resident_device_bytes = dit_bytes + sum(w.nbytes for w, r in zip(flat, resident) if r) + (
            sum(u.weights.nbytes for u in state.units) if units_resident else 0)
        state.stats.phase_units = 0 if units_resident else len(state.units)
        state.stats.phase_bytes = 0 if units_resident else unit_bytes
        logger.info(
            "layerwise offload: %d stacks (%s), %d blocks streamed (%s per pass), %d resident; non-block DiT "
            "weights %s stay on %s; %s; budget %s",
            len(state.stacks),
            ", ".join(f"{s.name}: {len(s.blocks)}" for s in state.stacks),
            len(streamed),
            format_bytes(state.stats.streamed_bytes_per_pass),
            state.stats.resident_blocks,
            format_bytes(dit_bytes),
            self.device,
            ", ".join(f"{label}: {how}" for label, how in state.managed.items()) or "encoders and VAEs stay there",
            "none" if budget is None else format_bytes(budget),
        )

    def _stack_weights(self, stack: Stack, state: LayerwiseState, kind: str = DIT) -> list[PackedWeights]:
        """One unit per block. The DiT's output layers (final norm, output projection: called once, after the last
        block) join the last block's unit, so they are on the device only from the last block to the end of the
        forward instead of throughout, as every non-block weight is (Diffusers' group offload keeps them, too)."""
        weights = [PackedWeights(path, block) for path, block in stack.blocks]
        tail = self._tail_modules(stack) if self.fold_tail and kind == DIT else []
        if tail and weights:
            path, last = stack.blocks[-1]
            owner_path = _owner_path(stack.owner, path, last)
            ids = {id(t) for _, t in named_tensors(last)} | {id(t) for _, m in tail for _, t in named_tensors(m)}
            weights[-1] = PackedWeights(path, stack.owner, select=ids, label=owner_path)
            state.tails[path] = tail
        return weights

    @staticmethod
    def _tail_modules(stack: Stack) -> list[tuple[str, nn.Module]]:
        """The declared output layers that exist, hold tensors and are not (inside) a block. A name the model sets
        itself (``_layerwise_offload_tail_attrs``) must be such a module; a package declaration's may be missing
        from another Diffusers version, and is skipped."""
        in_blocks = {id(m) for _, block in stack.blocks for m in block.modules()}
        own = getattr(stack.owner, "_layerwise_offload_tail_attrs", None) is not None
        tail = []
        for attr in tail_attrs_for(stack.owner):
            module = getattr(stack.owner, attr, None)
            usable = isinstance(module, nn.Module) and not _holds_any(module, in_blocks)
            if own and not usable:
                modules = [name for name, child in stack.owner.named_children() if not _holds_any(child, in_blocks)]
                raise ValueError(
                    f"_layerwise_offload_tail_attrs of {stack.name!r} ({type(stack.owner).__name__}) names {attr!r}, "
                    f"which is {'(or holds) a block' if isinstance(module, nn.Module) else 'not a module of it'}; "
                    f"allowed: its modules outside the blocks ({', '.join(modules)})"
                )
            if usable and named_tensors(module):
                tail.append((attr, module))
        return tail

    def _non_block_tensors(self, state: LayerwiseState) -> list[torch.Tensor]:
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

    def _staging_count(self) -> int:
        """Buffers of the staging ring: one per block the window can hold ahead (``prefetch_depth``), one whose
        copy to the device is draining, and one being read."""
        return self.config.prefetch_depth + 2

    def _stage_plan_host(self, state: LayerwiseState, journal: Journal) -> None:
        """With ``max_host_memory``: which streamed blocks keep no host copy of their own (``plan_host_memory``:
        read from disk at every load, or sharing a buffer with the blocks of the alternating DiTs at the same
        position), each mapped to its checkpoint files and checked against them (names, dtypes, shapes, bytes),
        before anything changes."""
        budget = getattr(self.config, "max_host_memory", None)
        if budget is None:
            return
        components: dict[int, tuple[Any, dict[int, list[str]], dict[int, str]]] = {}
        candidates: list[HostCandidate] = []
        owners: dict[int, Any] = {}  # id(PackedWeights) → its component, for blocks that may be read from disk
        groups = {id(c.module): 0 for c in state.topology.alternating}
        views = self._file_views(state)
        mapped: set[int] = set()  # id(PackedWeights) of quantized blocks read back from the files they are views of
        positions: dict[int, int] = {}  # id(component module) → streamed blocks seen so far (load order)
        resident_bytes = 0
        for index, (stack, row, resident_row, kind) in enumerate(
                zip(state.stacks, state.weights, state.resident, state.kinds)):
            component = self._component_of(state, stack)
            if component is not None and id(component.module) not in components:
                components[id(component.module)] = (component, *checkpoint_names(component.module))
            group = groups.get(id(component.module), -1) if component is not None and kind == DIT else -1
            for weights, resident in zip(row, resident_row):
                if weights.empty:
                    continue
                if resident:
                    resident_bytes += weights.nbytes
                    continue
                if component is None:
                    reason = "not part of a pipeline component (its checkpoint is unknown)"
                else:
                    reason, from_views, kept = _disk_refusal(weights, components[id(component.module)][2], views)
                    owners[id(weights)] = component
                    if from_views:
                        mapped.add(id(weights))
                position = 0
                if group >= 0:
                    position = positions.get(id(component.module), 0)
                    positions[id(component.module)] = position + 1
                candidates.append(HostCandidate(weights, weights.path, weights.nbytes, index, kind == ENCODER, reason,
                                                group, position, kept if component is not None else 0))
        fixed = {"phase units": sum(u.weights.nbytes for u in state.units), "resident blocks": resident_bytes}
        count = self._staging_count()
        checkpoints: dict[int, tuple[Any, str]] = {}
        if sum(fixed.values()) + sum(c.nbytes for c in candidates) > budget:
            # Disk is needed: the blocks whose component was not loaded from local safetensors files keep theirs.
            for candidate in candidates:
                component = owners.get(id(candidate.key))
                if candidate.reason or component is None or id(candidate.key) in mapped:
                    continue
                if id(component.module) not in checkpoints:
                    checkpoints[id(component.module)] = find_checkpoint(component.module, component.path)
                checkpoint, why = checkpoints[id(component.module)]
                if checkpoint is None:
                    candidate.reason = f"{component.label!r}: {why}"
        plan = plan_host_memory(candidates, fixed, budget, count)
        if not plan:
            logger.info("layerwise offload: max_host_memory %s: every host copy fits", format_bytes(budget))
            return
        files: list = []
        sources: dict[int, BlockSource] = {}
        for candidate in plan.blocks:
            weights = candidate.key
            component, names, _ = components[id(owners[id(weights)].module)]
            if id(weights) in mapped:
                source = view_source(weights.path, component.label, views, files, weights.slots, weights.numel)
                if source is None:  # checked above: every tensor of the block was located
                    raise RuntimeError(f"layerwise offload: block {weights.path!r} is no longer a view of its file")
                sources[id(weights)] = source
                continue
            checkpoint, _ = checkpoints[id(component.module)]
            sources[id(weights)] = block_source(weights.path, component.label, checkpoint, files, names,
                                                weights.slots, weights.numel)
        reader = DiskReader(files)
        journal.record("close the checkpoint files", reader.close)
        total = sum(s.read_bytes for s in sources.values())
        # views: tensors that are views of these very files need no comparison
        with byte_progress(total, "layerwise offload: checking disk-backed blocks against their files",
                           self.config.show_progress, state.target) as bar:
            for source in sources.values():
                verify_block(source, reader, views)
                bar.update(source.read_bytes)
        state.disk, state.disk_reader = sources, reader
        state.shared = [[sources[id(c.key)] for c in group] for group in plan.shared]
        ring = min(count, len(plan.disk))
        stats = state.stats
        stats.disk_blocks = len(plan.disk)
        stats.disk_bytes_per_pass = sum(sources[id(c.key)].read_bytes for c in plan.disk)
        stats.staging_bytes = ring * max((sources[id(c.key)].nbytes for c in plan.disk), default=0)
        stats.shared_buffers = len(plan.shared)
        stats.shared_blocks = sum(len(group) for group in plan.shared)
        stats.shared_bytes = sum(max(s.nbytes for s in group) for group in state.shared)
        where = ", ".join(sorted({str(f.parent) for f in files}))
        if plan.disk:
            logger.info(
                "layerwise offload: max_host_memory %s: %d of %d streamed blocks (%s per pass) are read from %s at "
                "each load instead of kept in host memory; staging ring %d × %s",
                format_bytes(budget), len(plan.disk), len(candidates), format_bytes(stats.disk_bytes_per_pass), where,
                ring, format_bytes(stats.staging_bytes // ring),
            )
        if plan.shared:
            logger.info(
                "layerwise offload: max_host_memory %s: %d blocks of the alternating DiTs %s share %d host buffers "
                "(%s): a block is read from %s when its DiT runs after the other",
                format_bytes(budget), stats.shared_blocks, [c.label for c in state.topology.alternating],
                stats.shared_buffers, format_bytes(stats.shared_bytes), where,
            )

    @staticmethod
    def _file_views(state: LayerwiseState) -> FileViews:
        """The process's file mappings, read once per enable (checking disk-backed blocks, then packing)."""
        if state.file_views is None:
            state.file_views = FileViews()
        return state.file_views

    @staticmethod
    def _component_of(state: LayerwiseState, stack: Stack):
        """The pipeline component holding ``stack`` (its checkpoint names the block's tensors), or ``None``."""
        for component in state.topology.components:
            if component.module is stack.owner or _holds_any(component.module, {id(stack.owner)}):
                return component
        return None

    def _stage_move_residents(self, state: LayerwiseState, journal: Journal) -> None:
        non_block = {id(t) for t in self._non_block_tensors(state)}
        roots = [(stack.owner, stack.name, non_block) for stack, kind in zip(state.stacks, state.kinds) if kind == DIT]
        roots += [(c.module, c.label, None) for c in state.topology.components
                  if c.role != DIT and c.label not in state.managed]
        done: set[int] = set()
        for root, label, select in roots:  # subclass-aware moves (see tensors.py), each tensor once
            ids = {id(t) for _, t in named_tensors(root)} if select is None else select
            tensors = TensorSet(root, label, ids - done)
            done |= tensors.ids
            journal.record(f"move {label}", tensors.move_to(self.device))

    def _stage_pack_blocks(self, state: LayerwiseState, journal: Journal) -> None:
        state.host_memory = host_memory = HostMemory(self.device, self.config.pin_memory)
        state.stats.host_memory_mode = host_memory.mode
        journal.record("release host memory", lambda: host_memory.release(self.device))
        total = sum(w.nbytes for stack in state.weights for w in stack if id(w) not in state.disk)
        total += sum(u.weights.nbytes for u in state.units)
        # Weights that are views of checkpoint files (load_transformer_mmap) give their pages back once packed.
        release = self._file_views(state).release
        with byte_progress(total, "layerwise offload: packing blocks", self.config.show_progress,
                           state.target) as bar:
            for stack_weights, stack_resident in zip(state.weights, state.resident):
                streamed_row: list[_StreamedBlock | None] = []
                for weights, resident in zip(stack_weights, stack_resident):
                    source = state.disk.get(id(weights)) if state.disk else None
                    if source is not None:
                        streamed_row.append(self._pack_disk(weights, source, journal))
                        continue
                    streamed_row.append(self._pack_one(weights, resident, host_memory, journal, release))
                    bar.update(weights.nbytes)
                state.streamed.append(streamed_row)
            for unit in state.units:
                weights = unit.weights
                journal.record(f"restore {weights.path}",
                               lambda w=weights: w.undo_pack(host_memory.needs_clone_on_release))
                weights.pack(host_memory, release)
                if unit.resident:
                    unit.onload(self.device)
                bar.update(weights.nbytes)
        state.stats.host_bytes = total
        release_freed_host_memory()
        release_freed_device_memory(self.device)

    def _pack_one(
        self, weights: PackedWeights, resident: bool, host_memory: HostMemory, journal: Journal,
        release: Callable[[list[torch.Tensor]], Any] | None = None,
    ) -> _StreamedBlock | None:
        if weights.empty:
            return None
        clone = host_memory.needs_clone_on_release
        # Recorded first: a pack that fails part-way has already rebound some tensors.
        journal.record(f"restore {weights.path}", lambda: weights.undo_pack(clone))
        weights.pack(host_memory, release)
        if resident:
            _, views = weights.device_buffers(self.device)
            for host_view, view in zip(weights.host_views, views):
                view.copy_(host_view)
            weights.bind(views)
            return None
        block = _StreamedBlock(weights, self.device)
        weights.park(block.placeholders)
        return block

    def _pack_disk(self, weights: PackedWeights, source: BlockSource, journal: Journal) -> _StreamedBlock:
        """A block with no host copy: its tensors become placeholders at once; the rollback of a failed enable
        gives them their own data back (kept until enable returns, then freed: its bytes are the files')."""
        block = _StreamedBlock(weights, self.device)
        block.disk = source
        source.owner = block
        originals = weights.tensors.current()
        journal.record(f"restore {weights.path}", lambda: weights.park(originals))
        weights.park(block.placeholders)
        return block

    def _stage_allocate_slots(self, state: LayerwiseState, journal: Journal) -> None:
        blocks = [b for row in state.streamed for b in row if b is not None]
        state.transfers = Transfers(self.device)
        count = self.config.prefetch_depth + 1 if blocks else 0
        state.stats.slot_count = count
        state.stats.slot_bytes = max((b.weights.nbytes for b in blocks), default=0)
        state.stats.in_flight_capacity = count * state.stats.slot_bytes
        # Without a budget, hold no more blocks than Diffusers' group offload would (running + prefetched); with one,
        # the reserve is paid for, so smaller blocks fill it.
        state.stats.in_flight_blocks = count if self.max_device_memory is None else None
        if state.disk:
            state.streamer = _DiskStreamer(state.stats.in_flight_capacity, state.transfers, state.stats,
                                           self._start_staging(state, journal),
                                           max_blocks=state.stats.in_flight_blocks)
        else:
            state.streamer = _Streamer(state.stats.in_flight_capacity, state.transfers, state.stats,
                                       max_blocks=state.stats.in_flight_blocks)
        logger.info(
            "layerwise offload: up to %s of blocks on %s at once (%d × the largest block, %s; %s; prefetch depth %d)",
            format_bytes(state.stats.in_flight_capacity),
            self.device,
            count,
            format_bytes(state.stats.slot_bytes),
            "as many smaller blocks as fit" if state.stats.in_flight_blocks is None
            else f"at most {count} blocks",
            self.config.prefetch_depth,
        )

    def _start_staging(self, state: LayerwiseState, journal: Journal) -> StagingRing:
        """The staging ring of the disk-backed blocks and the buffers shared by the alternating DiTs' blocks:
        page-locked buffers from the offload's ``HostMemory`` (so they are unregistered with the rest, before they
        are freed) and the reader thread, stopped and joined by ``disable``, by the rollback of a failed enable, or
        when this backend is garbage collected. Each disk-backed block learns the disk-backed blocks that load
        after it (a DiT's wrap around to the next step)."""
        ahead = self._staging_count()
        shared = {id(source) for group in state.shared for source in group}
        count = min(ahead, sum(1 for source in state.disk.values() if id(source) not in shared))
        size = state.stats.staging_bytes // count if count else 0
        buffers = []
        for nbytes in [size] * count + [max(s.nbytes for s in group) for group in state.shared]:
            buffer = state.host_memory.allocate(nbytes, torch.uint8)
            state.host_memory.pin(buffer)
            buffers.append(buffer)
        events = [state.transfers.new_event() for _ in buffers]
        for index, source in enumerate(state.disk.values()):
            source.index = index
        ring = StagingRing(state.disk_reader, buffers[:count], events[:count], state.stats, self.device,
                           _source_loaded, len(state.disk), ahead,
                           shared=list(zip(buffers[count:], events[count:], state.shared)))
        state.staging = ring
        state.stop_reader = weakref.finalize(self, ring.close)
        journal.record("stop the disk reader", state.stop_reader)
        for row, kind in zip(state.streamed, state.kinds):
            sources = [b.disk for b in row if b is not None and b.disk is not None]
            for position, source in enumerate(sources):
                if kind == DIT:  # the next step starts over: wrap around
                    following = sources[position + 1:] + sources[:position]
                else:  # an encoder runs once per call
                    following = sources[position + 1:]
                source.next = tuple(following[:ahead])
        if count:
            logger.info("layerwise offload: staging ring of %d × %s (%s host memory) for %d disk-backed blocks",
                        count, format_bytes(size), state.host_memory.mode, len(state.disk) - len(shared))
        return ring

    def _forward_lock(self) -> ForwardLock:
        """The lock every DiT forward of this offload runs under (the window and its slots serve one call at a
        time: concurrent callers wait for their turn)."""
        return ForwardLock("layerwise offload")

    def _inference_only(self, state: LayerwiseState, label: str) -> str:
        """The error a backward through ``label``'s streamed forward raises (see ``LockedCallbackHook``)."""
        pipeline = not isinstance(state.target, nn.Module)
        way_out = "pipe.disable_omni_offload()" if pipeline else "backend.disable()"
        return inference_only_message(str(self.strategy), label, way_out)

    def _stage_install_hooks(self, state: LayerwiseState, journal: Journal) -> None:
        journal.record("remove hooks", state.hooks.remove_all)
        state.lock = self._forward_lock()
        depth = self.config.prefetch_depth
        capacity = state.stats.in_flight_capacity
        limit = state.stats.in_flight_blocks
        streamer = state.streamer
        for index, (stack, row, kind) in enumerate(zip(state.stacks, state.streamed, state.kinds)):
            ring = [b for b in row if b is not None]
            unit = state.stack_units.get(index)
            if not ring:
                if unit is not None and not unit.resident:  # every block resident: only its other weights swap
                    state.hooks.install(stack.owner, LockedCallbackHook(
                        state.lock, stack.name, before=partial(self._enter_phase, unit),
                        after=partial(self._leave_phase, unit)), LAYERWISE_ENTRY_HOOK)
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
                lookahead = _lookahead(row, position, capacity, limit, wrap=wrap)
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
                before = partial(self._enter_stack, ring, first, own)
            else:
                before = partial(self._enter_encoder, unit, ring, first, own)
                end_last = partial(self._leave_phase, None if unit is None or unit.resident else unit)
            state.hooks.install(
                stack.owner,
                LockedCallbackHook(state.lock, stack.name, before=before,
                                   after=end_last, inference_only=self._inference_only(state, stack.name)),
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
                after = partial(self._leave_phase, unit) if unit.per_call and position == 0 else None
                state.hooks.install(part, LockedCallbackHook(
                    state.lock, unit.label, before=partial(self._enter_phase, unit), after=after),
                    LAYERWISE_ENTRY_HOOK)
        refresh_registry_caches(roots)
        journal.record("refresh registry caches", lambda: refresh_registry_caches(roots))

    # Phases -------------------------------------------------------------------------------------------------

    @torch.compiler.disable(reason=EAGER_ONLY)
    def _enter_phase(self, unit: _PhaseUnit | None, own: frozenset[int] = frozenset()) -> None:
        """A phase starts: units of other phases go back to the host, in-flight blocks of other stacks are freed,
        and ``unit`` (``None``: a DiT's phase) comes onto the device."""
        state = self._state
        for other in state.units:
            if other is not unit and other.onloaded and not other.resident:
                other.park()
        if state.streamer is not None:
            state.streamer.release_idle(own)
        if unit is not None and not unit.onloaded:
            unit.onload(self.device)
            state.stats.phase_onloads += 1
            state.stats.phase_onloaded_bytes += unit.weights.nbytes

    @torch.compiler.disable(reason=EAGER_ONLY)
    def _leave_phase(self, unit: _PhaseUnit | None) -> None:
        if unit is not None and unit.onloaded and not unit.resident:
            unit.park()

    def _enter_stack(self, ring: list[_StreamedBlock], first: tuple[_StreamedBlock, ...],
                     own: frozenset[int]) -> None:
        if self._state.units:
            self._enter_phase(None, own)
        self._state.streamer.enter_stack(ring, first)

    def _enter_encoder(self, unit: _PhaseUnit | None, ring: list[_StreamedBlock], first: tuple[_StreamedBlock, ...],
                       own: frozenset[int]) -> None:
        self._enter_phase(None if unit is None or unit.resident else unit, own)
        self._state.streamer.enter_stack(ring, first)

    def _on_use(self, state: LayerwiseState, module: nn.Module) -> Callable[[], None] | None:
        for unit in state.units:
            if unit.module is module and not unit.per_call and not unit.resident:
                return partial(self._use_unit, unit)
        return None

    def _use_unit(self, unit: _PhaseUnit) -> None:
        state = self._state
        if state is None or state.lock is None:
            return
        with state.lock:
            self._enter_phase(unit)

    def end_of_call(self) -> None:
        """The pipeline call returned: the last phase's unit (the VAE) and prefetched blocks leave the device, so
        between calls only the DiTs' non-block weights and resident blocks stay there."""
        state = self._state
        if state is None or not state.units or state.lock is None:
            return
        with state.lock:
            self._enter_phase(None)

    def _stage_install_guards(self, state: LayerwiseState, journal: Journal) -> None:
        super()._stage_install_guards(state, journal)
        self._refuse_pickling(state)
        for component in state.topology.vaes:  # a VAE phase that does not fit untiled runs in tiles
            if component.label in state.managed:
                vae_tiling.install(component.module, component.label, self._guards.set, self._guards.on_remove,
                                   state.stats.tiled_vaes.append)
        # state_dict() (save_pretrained, LoRA and PEFT helpers) reads streamed blocks from their host copies: their
        # own tensors are empty placeholders between uses. The block is bound to its host views for the duration of
        # its state_dict() (quantized weights included: wrapper subclasses are rebuilt around the host views,
        # bitsandbytes' quant_state tensors rebound), then put back exactly as it was.
        for stack, row in zip(state.stacks, state.streamed):
            for (path, module), block in zip(stack.blocks, row):
                if block is not None:
                    modules = [module] + [m for _, m in state.tails.get(path, ())]
                    for owner in modules:
                        before, after = self._state_dict_hooks(block.weights, block.disk, state.disk_reader)
                        for handle in (owner.register_state_dict_pre_hook(before),
                                       owner.register_state_dict_post_hook(after)):
                            self._guards.on_remove(handle.remove)

    def _refuse_pickling(self, state: LayerwiseState) -> None:
        """Pickling or deep-copying the pipeline or any of its components raises a clear ``TypeError`` while the
        offload is enabled (see ``hooks.NO_PICKLE``)."""
        objects = [state.target] + [c.module for c in state.topology.components] + [s.owner for s in state.stacks]
        refuse_pickling(objects, self._guards.set)

    @staticmethod
    def _state_dict_hooks(weights: PackedWeights, source: BlockSource | None = None,
                          reader: DiskReader | None = None):
        """A block without a host copy (``source``) is read from its files into fresh pageable tensors instead,
        dropped once ``state_dict()`` is done with them."""
        saved: list[list[torch.Tensor]] = []

        def bind_host_copies(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            views = weights.host_views if source is None else weights.views_into(reader.read_pageable(source))
            saved.append(weights.tensors.current())
            weights.bind(views)

        def put_back(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
            if saved:
                weights.park(saved.pop())

        return bind_host_copies, put_back

    def _stage_prime(self, state: LayerwiseState, journal: Journal) -> None:
        for row, kind in zip(state.streamed, state.kinds):
            if kind != DIT:
                continue  # an encoder's first blocks load when it is called
            ring = [b for b in row if b is not None]
            if ring:
                state.streamer.enter_stack(ring, tuple(ring[: self.config.prefetch_depth]))

    # Disable ----------------------------------------------------------------------------------------------

    def _disable(self) -> None:
        state = self._state
        if state.lock is not None:  # a forward running in another thread finishes first
            with state.lock:
                self._disable_locked(state)
        else:
            self._disable_locked(state)

    def _disable_locked(self, state: LayerwiseState) -> None:
        if state.transfers is not None:
            state.transfers.synchronize()
        if state.streamer is not None:
            state.streamer.release_all()
        if state.stop_reader is not None:
            state.stop_reader()  # the reader thread is joined before its staging buffers are unpinned
        state.hooks.remove_all()
        refresh_registry_caches([stack.owner for stack in state.stacks])
        clone = state.host_memory.needs_clone_on_release
        unread: list[str] = []
        for stack_weights in state.weights:
            for weights in stack_weights:
                if weights.empty:
                    continue
                source = state.disk.get(id(weights)) if state.disk else None
                if source is None:
                    weights.restore(clone=clone, to_original_device=False)
                    continue
                try:  # no host copy: read back from the checkpoint into ordinary host tensors
                    weights.park(weights.views_into(state.disk_reader.read_pageable(source)), final=True)
                except Exception as error:  # noqa: BLE001 - the rest is restored first, then this is raised
                    unread.append(f"{weights.path!r} ({type(error).__name__}: {error})")
        for unit in state.units:
            if unit.onloaded:
                unit.park()
            unit.weights.restore(clone=clone, to_original_device=False)
        if state.disk_reader is not None:
            state.disk_reader.close()
        state.host_memory.release(self.device)
        if unread:
            raise DiskReadError(
                f"layerwise offload disabled, but {len(unread)} disk-backed blocks could not be read back from their "
                f"checkpoint files, so their tensors are empty: {'; '.join(unread[:3])}"
                + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
                + "; load the model again from its files"
            )
        logger.info("layerwise offload disabled: block weights are ordinary host tensors again")


_QUANTIZED_KEEP = ("quantized weights are read from disk only while they are views of the file they were loaded "
                   "from, as load_gguf_mmap loads a GGUF file and from_pretrained maps a torchao checkpoint; these are "
                   "copies, so they keep their host copy")


def _disk_refusal(weights: PackedWeights, transient: dict[int, str], views: FileViews) -> tuple[str, bool, int]:
    """Why a block cannot be read from disk (``""``: it can), whether it is read from where its tensors are mapped
    (``disk.view_source``) rather than by name from its checkpoint, and the bytes it then keeps on the host.
    Non-persistent buffers are not in any file and a permuted layout is not a file's order. Quantized weights
    (tensor subclasses: torchao, GGUF, bitsandbytes) are not stored as a safetensors checkpoint holds them (torchao's
    is pickled, GGUF is converted while loading, bitsandbytes packs its quantization state): they can be read back
    only from the mapped file their packed bytes still are views of (``load_gguf_mmap``, a torchao ``.bin`` that
    ``from_pretrained`` maps); the block's plain tensors that are not views keep a host copy, if they are the
    smaller part of it."""
    quantized = ""
    for wrapper in weights.tensors.wrappers:
        quantized = f"its weights are {type(wrapper.original).__name__} tensor subclasses ({_QUANTIZED_KEEP})"
        break
    for leaf in weights.tensors.leaves:
        for target in leaf.targets:
            if type(target) not in PLAIN_TENSOR_TYPES and not quantized:
                quantized = f"its weights are {type(target).__name__} tensors ({_QUANTIZED_KEEP})"
            if id(target) in transient:
                return "it holds non-persistent buffers (not saved in checkpoints)", False, 0
        if leaf.stride is not None:
            return "it holds tensors in a permuted (non-contiguous) layout", False, 0
    if not quantized:
        return "", False, 0
    kept = located = 0
    for leaf in weights.tensors.leaves:
        nbytes = leaf.shape.numel() * leaf.dtype.itemsize
        if views.locate(leaf.data()) is not None:
            located += nbytes
        elif plain_leaf(leaf):
            kept += nbytes
        else:
            return quantized, False, 0
    if kept > located:
        return quantized, False, 0
    return "", True, kept


def _source_loaded(source: BlockSource) -> bool:
    """Whether a disk-backed block is on the device (its read is not needed until it leaves)."""
    return source.owner is not None and source.owner.slot is not None


def _holds_any(module: nn.Module, ids: set[int]) -> bool:
    return any(id(m) in ids for m in module.modules())


def _owner_path(owner: nn.Module, block_path: str, block: nn.Module) -> str:
    """The dotted path of ``owner``, given one of its blocks and its path (``"transformer.blocks.3"`` gives
    ``"transformer"``)."""
    relative = next(name for name, module in owner.named_modules() if module is block)
    return block_path[: len(block_path) - len(relative)].rstrip(".")


def _lookahead(row: list[_StreamedBlock | None], position: int, capacity: int,
               limit: int | None = None, wrap: bool = True) -> tuple[_StreamedBlock, ...]:
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


def stack_modules(backend: LayerwiseOffloadBackend) -> list[nn.Module]:
    """Block modules under the backend's control (for tests and reports)."""
    state = backend._state
    return [] if state is None else [m for stack in state.stacks for _, m in stack.blocks]
