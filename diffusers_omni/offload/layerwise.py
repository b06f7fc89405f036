"""Layerwise offload: DiT blocks stream from where their stores keep them onto the device, one prefetch ring per DiT.

The backend composes the parts: the planners (``residency.plan_residency`` for the device budget,
``stores.file.plan_disk_blocks`` for the host budget), a store per streamed block (``stores``: the pinned host copy,
the checkpoint's files, the rank's shard under AllGather, or any registered store), a transport (``transports``:
copies on the copy stream, or all-gathers of the shards), the streaming window (``streamer``), the phases of
encoders and VAEs (``phases``) and the hooks (``stream_hooks``). A strategy chooses parts (``_shards``,
``_transport``), never stages. What follows is how the default store streams.

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

import contextlib
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from ..config.offload import NO_BUDGET, OffloadStrategy, format_bytes
from ..utils.journal import Journal
from ..utils.progress import byte_progress
from . import budget as machine
from . import vae_tiling
from .base import EnableStep, OffloadBackend
from .budget import AUTO, weights_in_ram
from .coded_cache import CodedCache
from .disk import DiskReadError
from .discovery import (
    DIT,
    ENCODER,
    Stack,
    Topology,
    check_no_foreign_offload,
    check_no_self_rewriting_weights,
    check_topology,
    discover_components,
    named_tensors,
    resolve_stacks,
)
from .hooks import ForwardLock, InstalledHooks, inference_only_message, refresh_registry_caches, refuse_pickling
from .memory import HostMemory, PackedWeights, Transfers, release_freed_device_memory, release_freed_host_memory
from .headroom import Headroom
from .oom_retry import StepShrink
from .phases import Phases, PhaseUnit
from .residency import plan_residency
from .residents import ResidentBlocks
from .stats import LayerwiseStats
from .stores import FileStore, ShardGroup, StoreContext, store_for
from .stores.coded_file import CodedSources
from .stores.dfloat11_file import dfloat11_sources, reads_dfloat11
from .stores.file import file_views, plan_disk_blocks, request_reads, start_staging
from .stores.lossless import LOSSLESS, codes, ring_bytes_planned
from .stream_hooks import guard_state_dict, install_state_dict_guards, install_stream_hooks, rewire_stream_hooks
from .streamer import StreamedBlock, Streamer
from .tensors import TensorSet, tensor_nbytes
from .transports import AllGatherTransfers
from .units import component_units, non_block_tensors, stack_weights

logger = logging.getLogger("diffusers_omni")
_NO_LOCK = contextlib.nullcontext()

__all__ = ["LayerwiseOffloadBackend", "LayerwiseState", "LayerwiseStats", "plan_residency", "stack_modules"]


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
    streamed: list[list[StreamedBlock | None]] = field(default_factory=list)
    streamer: Streamer | None = None
    tails: dict[str, list[tuple[str, nn.Module]]] = field(default_factory=dict)  # last block path → output layers
    hooks: InstalledHooks = field(default_factory=InstalledHooks)
    stats: LayerwiseStats = field(default_factory=LayerwiseStats)
    lock: ForwardLock | None = None  # held for each DiT's whole forward: callers in several threads take turns
    kinds: list[str] = field(default_factory=list)  # per stack: DIT (also extra streamed paths) or ENCODER
    units: list[PhaseUnit] = field(default_factory=list)  # per-phase weights: encoders' non-block parts, VAEs
    stack_units: dict[int, PhaseUnit] = field(default_factory=dict)  # encoder stack index → its non-block unit
    managed: dict[str, str] = field(default_factory=dict)  # component label → how it is managed (for logs)
    # max_host_memory: id(PackedWeights) → where that block's bytes are in its checkpoint (no host copy)
    disk: dict[int, Any] = field(default_factory=dict)  # disk.BlockSource
    disk_reader: Any = None  # disk.DiskReader
    # blocks (one per alternating DiT, same position) that share one host buffer; their sources are in ``disk`` too
    shared: list[list[Any]] = field(default_factory=list)  # disk.BlockSource groups
    staging: Any = None  # disk.StagingRing
    stop_reader: Any = None  # weakref.finalize: stops and joins the reader thread (disable, rollback, or GC)
    file_views: Any = None  # disk.FileViews: the process's file mappings, read once while enabling
    # blocks computing on the CPU keep each tensor's alignment (``memory.RESIDUE_BYTES``): bitwise the model's results
    keep_residues: bool = False
    device_budget: int | None = None  # max_device_memory as planned ("auto" resolved)
    device_limit: int | None = None  # "auto": the most this process may reserve on the device (``headroom``)
    # streamed blocks that stay on the device (``headroom``), by (stack, position): their store still holds them
    kept: dict[tuple[int, int], StreamedBlock] = field(default_factory=dict)
    phases: Phases | None = None  # moves the phase units (made with the hooks)
    stores: StoreContext | None = None  # what the blocks' stores share
    coded_cache: Any = None  # coded_cache.CodedCache of compression_cache_dir


def streams_coded(config: Any, modules: list[nn.Module]) -> bool:
    """Whether blocks may stream coded through the code ring: ``compression="lossless"``, or a host budget with a
    component loaded from a DFloat11 checkpoint (its disk blocks are read as DFloat11's code)."""
    return (getattr(config, "compression", None) == LOSSLESS
            or (getattr(config, "max_host_memory", None) is not None and reads_dfloat11(modules)))


class LayerwiseOffloadBackend(OffloadBackend):
    """Streams every block of every DiT through a few device slots; everything else stays on the device."""

    strategy = OffloadStrategy.LAYERWISE
    # Whether text/image encoders stream and VAEs come in for their phase (``dits_only=False``); the distributed
    # backends keep them on the device.
    manages_components = True
    # Whether a DiT's output layers (its declaration's ``tail_attrs``) stream with its last block.
    fold_tail = True
    # Whether a DiT step that runs out of device memory beside resident blocks streams them and runs again
    # (``oom_retry``); the distributed backends do not: one rank's retry would put its collectives out of step.
    retries_out_of_memory = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self._state: LayerwiseState | None = None

    @property
    def max_device_memory(self) -> int | None:
        """The byte budget of weights on the device (``config.max_device_memory``, with ``"auto"`` resolved when
        enabling); ``None`` streams every block that is not forced resident."""
        if self._state is not None and self._state.device_budget is not None:
            return self._state.device_budget
        value = self.config.max_device_memory
        return None if value == NO_BUDGET else value

    @property
    def stats(self) -> LayerwiseStats:
        """Counters since enable: blocks, slots, bytes copied, on-demand (not prefetched) loads."""
        if self._state is None:
            raise RuntimeError("layerwise offload is not enabled")
        return self._state.stats

    def _new_state(self, target: Any) -> LayerwiseState:
        self._state = LayerwiseState(target, keep_residues=self.device.type == "cpu")
        return self._state

    def _forget(self) -> None:
        self._state = None

    def _enable_steps(self) -> Sequence[EnableStep]:
        return (self._discover, self._plan_host, self._move_residents, self._pack_blocks, self._allocate_slots,
                self._install_hooks, self._install_guards, self._prime)

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

    # Enable steps -----------------------------------------------------------------------------------------

    def _discover(self, state: LayerwiseState, journal: Journal) -> None:
        plan = self.config.plan
        state.topology = discover_components(state.target, plan)
        check_topology(state.topology)
        check_no_foreign_offload(state.topology, "layerwise")
        check_no_self_rewriting_weights(state.topology, self.device)
        state.stacks = resolve_stacks(state.target, state.topology, plan)
        state.kinds = [DIT] * len(state.stacks)
        if self._manage_components:
            component_units(state)
        forced_paths = {c.path for c in state.topology.residents}
        state.weights = [stack_weights(stack, state, kind, self.fold_tail)
                         for stack, kind in zip(state.stacks, state.kinds)]
        flat = [w for stack in state.weights for w in stack]
        never = [kind == ENCODER for stack, kind in zip(state.weights, state.kinds) for _ in stack]
        forced = [w.path in forced_paths or w.empty for w in flat]
        dit_bytes = sum(tensor_nbytes(t) for t in non_block_tensors(state))
        unit_bytes = max((u.weights.nbytes for u in state.units), default=0)
        budget = state.device_budget = self._resolve(state, self.max_device_memory)
        everything = dit_bytes + sum(w.nbytes for w in flat) + sum(u.weights.nbytes for u in state.units)
        units_resident = budget is not None and everything <= budget
        largest_unit = max(state.units, key=lambda u: u.weights.nbytes).label if state.units else ""
        ring = self._code_ring_planned(state, flat, forced)
        resident = plan_residency(
            [w.nbytes for w in flat], forced, dit_bytes + (0 if units_resident else unit_bytes), budget,
            self._window_blocks, never=never, labels=[w.path for w in flat],
            fixed_detail=(f" (the DiTs' {format_bytes(dit_bytes)} + the largest phase, {largest_unit!r}, "
                          f"{format_bytes(unit_bytes)})" if unit_bytes and not units_resident else ""),
            stream_extra=ring, stream_extra_detail="for the lossless code's device buffers (at the bf16 size)",
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

    @property
    def _window_blocks(self) -> int:
        """Streamed blocks on the device at once, at most: the running one and ``prefetch_depth`` ahead."""
        return self.config.prefetch_depth + 1

    def _code_ring_planned(self, state: LayerwiseState, flat: list[PackedWeights], forced: list[bool]) -> int:
        """Device bytes the plan reserves for the code ring when blocks may stream coded (0 on the CPU, which
        decodes from the host buffers, and where nothing streams coded)."""
        if self.device.type == "cpu" or not streams_coded(self.config, [c.module for c in state.topology.components]):
            return 0
        return ring_bytes_planned([w.nbytes for w, f in zip(flat, forced) if not f and codes(w)], self._window_blocks)

    def _staging_count(self) -> int:
        """Buffers of the staging ring: one per block the window can hold ahead (``prefetch_depth``), one whose
        copy to the device is draining, and one being read."""
        return self.config.prefetch_depth + 2

    def _plan_host(self, state: LayerwiseState, journal: Journal) -> None:
        """With ``max_host_memory``: which streamed blocks keep no host copy (read from their files, see
        ``stores.file.plan_disk_blocks``), checked against their files before anything changes."""
        cache = self._coded_cache(state)
        coded = CodedSources(cache, self.device) if cache is not None else None
        budget = getattr(self.config, "max_host_memory", None)
        if budget is not None:  # blocks of a model loaded from a DFloat11 checkpoint are read from it, coded
            coded = dfloat11_sources([c.module for c in state.topology.components], self.device, coded)
        auto = budget == AUTO
        if auto:
            views = file_views(state)
            tensors = [slot.leaf.data() for row in state.weights for w in row for slot in w.slots]
            tensors += [slot.leaf.data() for unit in state.units for slot in unit.weights.slots]
            budget = self._resolve(state, AUTO, weights_in_ram(tensors, lambda t: views.locate(t) is not None),
                                   self._device_in_ram(state))
        try:
            plan_disk_blocks(state, budget, self._staging_count(), self.config.show_progress, journal, coded)
        except ValueError as error:
            if not auto:
                raise
            raise ValueError(f"{error}. That budget is what auto found this machine leaves: {state.stats.auto[-1]}"
                             ) from None

    def _device_in_ram(self, state: LayerwiseState) -> int:
        """What the device side takes in RAM when the device is the CPU (0 otherwise): the window's slots (one per
        block it holds, each the largest streamed block's bytes) and a device copy of each resident block."""
        if self.device.type != "cpu":
            return 0
        streamed = [w.nbytes for row, resident_row in zip(state.weights, state.resident)
                    for w, resident in zip(row, resident_row) if not resident and not w.empty]
        resident = sum(w.nbytes for row, resident_row in zip(state.weights, state.resident)
                       for w, resident in zip(row, resident_row) if resident and not w.empty)
        return self._window_blocks * max(streamed, default=0) + resident

    def _coded_cache(self, state: LayerwiseState) -> CodedCache | None:
        """The folder of ``compression_cache_dir`` (opened once per enable; ``None`` without one)."""
        folder = getattr(self.config, "compression_cache_dir", None)
        if folder is not None and state.coded_cache is None:
            state.coded_cache = CodedCache(folder)
        return state.coded_cache

    def _resolve(self, state: LayerwiseState, value: int | str | None, in_ram: int | None = None,
                 device_in_ram: int = 0) -> int | None:
        """A budget as given, or ``"auto"`` read from the machine (``budget.read_machine``): the device budget, or
        with ``in_ram`` (the weights' bytes already in RAM) the host budget, less ``device_in_ram`` (the device's
        share of RAM when it is the CPU). What was read and chosen goes to the stats (``auto``) and the log."""
        if value != AUTO:
            return value
        reading = machine.read_machine(self.device)
        chosen = (machine.device_budget(reading) if in_ram is None
                  else machine.host_budget(reading, in_ram, device_in_ram))
        if in_ram is None:
            state.device_limit = chosen.limit
        state.stats.auto.append(chosen.explain())
        state.stats.auto_readings = reading.describe()
        logger.info("layerwise offload: %s", chosen.explain())
        return chosen.nbytes

    def _move_residents(self, state: LayerwiseState, journal: Journal) -> None:
        non_block = {id(t) for t in non_block_tensors(state)}
        roots = [(stack.owner, stack.name, non_block) for stack, kind in zip(state.stacks, state.kinds) if kind == DIT]
        roots += [(c.module, c.label, None) for c in state.topology.components
                  if c.role != DIT and c.label not in state.managed]
        done: set[int] = set()
        for root, label, select in roots:  # subclass-aware moves (see tensors.py), each tensor once
            ids = {id(t) for _, t in named_tensors(root)} if select is None else select
            tensors = TensorSet(root, label, ids - done)
            done |= tensors.ids
            journal.record(f"move {label}", tensors.move_to(self.device))

    def _pack_blocks(self, state: LayerwiseState, journal: Journal) -> None:
        """Each streamed block goes to the store the planner chooses (``stores.store_for``: its files under a host
        budget, else its pinned host copy, or any registered store that claims it); resident blocks and phase units
        are packed into host memory too, resident ones then copied to the device for good."""
        state.host_memory = host_memory = HostMemory(self.device, self.config.pin_memory)
        state.stats.host_memory_mode = host_memory.mode
        journal.record("release host memory", lambda: host_memory.release(self.device))
        # Weights that are views of checkpoint files (load_transformer_mmap) give their pages back once packed.
        context = state.stores = StoreContext(self.device, host_memory, file_views(state).release, state.disk,
                                              state.disk_reader, compression=getattr(self.config, "compression", None),
                                              shards=self._shards(), cache=self._coded_cache(state),
                                              window_blocks=self._window_blocks)
        rows = [[None if weights.empty or resident else StreamedBlock(weights, self.device,
                                                                      store_for(weights, context))
                 for weights, resident in zip(row_weights, row_resident)]
                for row_weights, row_resident in zip(state.weights, state.resident)]
        resident_bytes = sum(w.nbytes for ws, rs in zip(state.weights, state.resident) for w, r in zip(ws, rs)
                             if r and not w.empty) + sum(u.weights.nbytes for u in state.units)
        # The bar counts the weights' own bytes (a store's host bytes are known once it holds them: coded stores).
        work = resident_bytes + sum(block.weights.nbytes for row in rows for block in row if block is not None)
        with byte_progress(work, self._packing_progress(), self.config.show_progress, state.target) as bar:
            for row_weights, row_resident, row in zip(state.weights, state.resident, rows):
                for weights, resident, block in zip(row_weights, row_resident, row):
                    if block is not None:
                        block.store.take(journal)
                        weights.park(block.placeholders)
                        bar.update(weights.nbytes)
                    elif resident and not weights.empty:
                        self._pack_resident(weights, host_memory, journal, context.release)
                        bar.update(weights.nbytes)
                state.streamed.append(row)
            for unit in state.units:
                weights = unit.weights
                journal.record(f"restore {weights.path}",
                               lambda w=weights: w.undo_pack(host_memory.needs_clone_on_release))
                weights.pack(host_memory, context.release)
                if unit.resident:
                    unit.onload(self.device)
                bar.update(weights.nbytes)
        state.stats.host_bytes = resident_bytes + sum(block.store.host_nbytes for row in rows for block in row
                                                      if block is not None)
        for row in rows:
            for block in row:
                if block is not None:
                    if isinstance(block.store, FileStore):
                        block.store.source.owner = block
                    name = block.store.name
                    state.stats.store_blocks[name] = state.stats.store_blocks.get(name, 0) + 1
                    state.stats.store_bytes[name] = state.stats.store_bytes.get(name, 0) + block.weights.nbytes
                    state.stats.store_host_bytes[name] = (state.stats.store_host_bytes.get(name, 0)
                                                          + block.store.host_nbytes)
                    component = state.stats.store_counters.setdefault(name, {}).setdefault(
                        block.weights.path.split(".")[0], {})
                    for key, value in block.store.counters().items():
                        component[key] = component.get(key, 0) + value
        if state.coded_cache is not None:
            state.stats.cache_dir = str(state.coded_cache.folder)
            state.stats.cache_counters = state.coded_cache.counters()
            state.stats.cache_seconds = dict(state.coded_cache.seconds)
        release_freed_host_memory()
        release_freed_device_memory(self.device)

    def _pack_resident(self, weights: PackedWeights, host_memory: HostMemory, journal: Journal,
                       release: Callable[[list[torch.Tensor]], Any] | None) -> None:
        """A block the budget keeps on the device: packed (its host copy is what disable gives back), then copied
        to device buffers it computes on for good."""
        clone = host_memory.needs_clone_on_release
        # Recorded first: a pack that fails part-way has already rebound some tensors.
        journal.record(f"restore {weights.path}", lambda: weights.undo_pack(clone))
        weights.pack(host_memory, release)
        _, views = weights.device_buffers(self.device)
        for host_view, view in zip(weights.host_views, views):
            view.copy_(host_view)
        weights.bind(views)

    # The parts a strategy's config chooses -----------------------------------------------------------------

    def _shards(self) -> ShardGroup | None:
        """The group whose ranks each keep 1/N of every streamed block (``stores.shard``), or ``None``: blocks are
        held whole."""
        return None

    def _transport(self, state: LayerwiseState) -> Transfers:
        """How bytes reach the device (``transports``): all-gathers of the shards, or copies on the copy stream."""
        shards = state.stores.shards if state.stores is not None else None
        if shards is not None:
            return AllGatherTransfers(self.device, shards.group, shards.rank, state.stats)
        return Transfers(self.device)

    def _packing_progress(self) -> str:
        return "layerwise offload: packing blocks"

    # Enable steps, continued ----------------------------------------------------------------------------------

    def _allocate_slots(self, state: LayerwiseState, journal: Journal) -> None:
        blocks = [b for row in state.streamed for b in row if b is not None]
        state.transfers = self._transport(state)
        count = self._window_blocks if blocks else 0
        state.stats.slot_count = count
        state.stats.slot_bytes = max((sum(n * d.itemsize for d, n in b.store.device_numel.items()) for b in blocks),
                                     default=0)
        state.stats.in_flight_capacity = count * state.stats.slot_bytes
        code = state.stores.code_ring if state.stores is not None else None
        if code is not None and code.nbytes and self.device.type != "cpu":  # the CPU decodes from the host buffer
            state.stats.code_buffers, state.stats.code_buffer_bytes = code.count, code.count * code.nbytes
        # Without a budget, hold no more blocks than Diffusers' group offload would (running + prefetched); with one,
        # the reserve is paid for, so smaller blocks fill it.
        state.stats.in_flight_blocks = count if self.max_device_memory is None else None
        before_stack = None
        if state.disk:
            ring = state.stores.ring = start_staging(state, self._staging_count(), self, journal)
            before_stack = lambda blocks: request_reads(ring, blocks)  # noqa: E731
        state.streamer = Streamer(state.stats.in_flight_capacity, state.transfers, state.stats,
                                  max_blocks=state.stats.in_flight_blocks, before_stack=before_stack)
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

    def _forward_lock(self) -> ForwardLock:
        """The lock every DiT forward of this offload runs under (the window and its slots serve one call at a
        time: concurrent callers wait for their turn)."""
        return ForwardLock("layerwise offload")

    def _inference_only(self, state: LayerwiseState, label: str) -> str:
        """The error a backward through ``label``'s streamed forward raises (see ``LockedCallbackHook``)."""
        pipeline = not isinstance(state.target, nn.Module)
        way_out = "pipe.disable_omni_offload()" if pipeline else "backend.disable()"
        return inference_only_message(str(self.strategy), label, way_out)

    def _install_hooks(self, state: LayerwiseState, journal: Journal) -> None:
        state.lock = self._forward_lock()
        # Resident DiT blocks may leave to make room for a VAE; each DiT's entry hook brings them back. A step that
        # runs out of memory beside the ones the budget chose streams them and runs again; with none, the window
        # drops its prefetched blocks for the retry (``oom_retry``).
        residents = [weights for kind, row_weights, row_resident in zip(state.kinds, state.weights, state.resident)
                     if kind == DIT for weights, resident in zip(row_weights, row_resident)
                     if resident and not weights.empty]
        state.phases = Phases(state.units, state.streamer, self.device, state.stats, state.lock,
                              ResidentBlocks(residents, self.device, state.transfers) if residents else None)
        depth = self.config.prefetch_depth
        inference_only = lambda label: self._inference_only(state, label)  # noqa: E731
        retry = None
        streamed_dits = any(b is not None for row, kind in zip(state.streamed, state.kinds) if kind == DIT
                            for b in row)
        if self.retries_out_of_memory and (residents or streamed_dits):
            guards = self._guards
            shrink = StepShrink(
                state, self.device, depth,
                rewire=lambda retry: rewire_stream_hooks(state, state.phases, depth, inference_only, retry),
                guard=lambda block, path, module: guard_state_dict(state, block, path, module, guards))
            if state.device_limit is not None:  # "auto": the resident set follows each call's shape
                shrink.headroom = Headroom(state, self.device, depth, state.device_limit)
                state.phases.headroom = weakref.ref(shrink.headroom)
            if shrink.possible():
                retry = shrink.retry_for
        install_stream_hooks(state, state.phases, depth, inference_only, journal, retry)

    def _on_use(self, state: LayerwiseState, module: nn.Module) -> Callable[[], None] | None:
        return None if state.phases is None else state.phases.on_use(module)

    def end_of_call(self) -> None:
        """The pipeline call returned: the last phase's unit (the VAE) and prefetched blocks leave the device, so
        between calls only the DiTs' non-block weights and resident blocks stay there."""
        state = self._state
        if state is not None and state.phases is not None:
            state.phases.end_of_call()

    def _install_guards(self, state: LayerwiseState, journal: Journal) -> None:
        super()._install_guards(state, journal)
        self._refuse_pickling(state)
        for component in state.topology.vaes:  # a VAE phase that does not fit untiled runs in tiles
            if component.label in state.managed:
                vae_tiling.install(component.module, component.label, self._guards.set, self._guard_undo,
                                   state.stats.tiled_vaes.append, state.phases.make_room, self.device)
        way_out = self._guard_installer(state, self._guards).way_out
        install_state_dict_guards(state, self._managed_modules(state), way_out, self._guards)

    def _refuse_pickling(self, state: LayerwiseState) -> None:
        """Pickling or deep-copying the pipeline or any of its components raises a clear ``TypeError`` while the
        offload is enabled (see ``hooks.NO_PICKLE``)."""
        objects = [state.target] + [c.module for c in state.topology.components] + [s.owner for s in state.stacks]
        refuse_pickling(objects, self._guards.set)

    def _guard_undo(self, undo: Callable[[], None]) -> None:
        self._guards.record("guard", undo)

    def _prime(self, state: LayerwiseState, journal: Journal) -> None:
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

    def _prepare_disable(self) -> None:
        """Every store gets what giving its tensors back needs (a file-backed block reads itself back) before the
        disable changes anything; if one cannot, the disable is refused and the offload stays enabled, every call
        working as before."""
        state = self._state
        if state is None:
            return
        with state.lock if state.lock is not None else _NO_LOCK:
            stores = [block.store for row in state.streamed for block in row if block is not None]
            stores += [block.store for block in state.kept.values()]
            unread: list[str] = []
            for store in stores:
                try:
                    store.prepare_give_back()
                except Exception as error:  # noqa: BLE001 - every block is tried, then the disable is refused
                    unread.append(f"{store.weights.path!r} ({type(error).__name__}: {error})")
            if unread:
                for store in stores:
                    store.cancel_give_back()
                raise DiskReadError(
                    f"layerwise offload stays enabled: {len(unread)} disk-backed blocks could not be read back from "
                    f"their checkpoint files, and disabling would leave their tensors empty: {'; '.join(unread[:3])}"
                    + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
                    + ". Allowed: put the files' original bytes back (every read is checked against them) and "
                    "disable again, or drop the pipeline and load the model again from its files"
                )

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
        blocks = [block for row in state.streamed for block in row if block is not None] + list(state.kept.values())
        label = next((b.store.give_back_progress for b in blocks if b.store.give_back_progress), None)
        show = self.config.show_progress if label else False  # a bar only where giving back moves bytes (gathers)
        with byte_progress(sum(b.weights.nbytes for b in blocks), label or "", show, self._target) as bar:
            for i, (row_weights, row) in enumerate(zip(state.weights, state.streamed)):
                for j, (weights, block) in enumerate(zip(row_weights, row)):
                    if weights.empty:
                        continue
                    kept = state.kept.get((i, j))
                    if block is None and kept is None:  # resident: its packed host copy
                        weights.restore(clone=clone, to_original_device=False)
                    else:
                        block = block or kept
                        block.store.give_back()  # what could fail was done by _prepare_disable (collective: shards)
                        block.free_device_memory()  # a kept block's (``headroom``); nothing for a streamed one
                        bar.update(block.weights.nbytes)
        if state.phases is not None:
            state.phases.park_all()
        for unit in state.units:
            if unit.onloaded:
                unit.park()
            unit.weights.restore(clone=clone, to_original_device=False)
        if state.disk_reader is not None:
            state.disk_reader.close()
        state.host_memory.release(self.device)
        logger.info("layerwise offload disabled: block weights are ordinary host tensors again")


def stack_modules(backend: LayerwiseOffloadBackend) -> list[nn.Module]:
    """Block modules under the backend's control (for tests and reports)."""
    state = backend._state
    return [] if state is None else [m for stack in state.stacks for _, m in stack.blocks]
