"""Distributed layerwise offload: the layerwise ring on every rank of a ``torch.distributed`` group.

AllGather mode (default). Every block's per-dtype flat buffer (the ``PackedWeights`` layout of the single-device
backend) is ceil-padded to a multiple of the group size N and cut into N equal shards; rank ``r`` keeps only shard
``r`` in host memory (pinned), so host weights per rank are ≈ model ÷ N. Two fixed device slots per dtype, each
sized for the largest padded block, receive the gathered blocks; block ``i`` of a ring always uses slot ``i % 2``.
Loading block ``i`` is::

    copy stream:   wait slot.released ─ H2D host shard → slot.staging ─ record slot.staged
    comm stream:   wait slot.staged ─ all_gather_into_tensor(slot buffer, slot.staging) ─ record slot.ready
    compute:       wait slot.ready ─ run block i ─ record slot.released

The next block is loaded when block ``i`` starts, into the other slot. When a ring has an odd length the last
block and the first share slot 0, so the wrap-around load of block 0 (for the next step) is issued when the last
block *ends*, after its ``released`` event is recorded. Device weights are bounded by two blocks whatever the
model size. Collectives gather bytes (``uint8`` views), so every dtype (float8 included) takes the same path and
reconstruction is byte-exact. Every rank must run the same sequence of DiT forwards (lockstep); different prompts
and seeds per rank are fine, see :mod:`.dataparallel`.

No-AllGather mode. Each rank streams its own full host copy exactly as the single-device layerwise backend does;
``resident_layers`` keeps the first blocks of the main DiT on the device.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass, field
from functools import partial
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..config.offload import OffloadStrategy, format_bytes
from ..utils.progress import byte_progress
from ..utils.journal import Journal
from .base import EnableStep, OffloadBackend
from .guards import GuardInstaller, OffloadActiveError
from .hooks import (
    EAGER_ONLY,
    LAYERWISE_BLOCK_HOOK,
    LAYERWISE_ENTRY_HOOK,
    CallbackHook,
    ForwardLock,
    LockedCallbackHook,
    refresh_registry_caches,
)
from .layerwise import LayerwiseOffloadBackend, LayerwiseState, LayerwiseStats
from .memory import (
    HostMemory, PackedWeights, Transfers, placeholder, release_freed_device_memory, release_freed_host_memory,
)

logger = logging.getLogger("diffusers_omni")

SLOT_COUNT = 2


def shard_numel(numel: int, world_size: int) -> int:
    """Elements in each rank's shard of a flat buffer of ``numel`` elements (ceil-padded: ``10, 4`` → ``3``)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} is out of range; allowed: an int >= 1")
    return -(-numel // world_size)


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s shard in the padded flat buffer (may reach past ``numel``: padding)."""
    size = shard_numel(numel, world_size)
    return rank * size, (rank + 1) * size


def all_gather_bytes(output: torch.Tensor, shard: torch.Tensor, group: Any) -> None:
    """Gather every rank's ``shard`` into ``output`` (``world_size × shard`` elements, rank order).

    Both tensors are viewed as ``uint8`` so dtypes the backend does not know (gloo has no float8) travel as bytes.
    Uses the one-tensor collective (``all_gather_into_tensor``, or its successor ``all_gather_single``), which
    NCCL and (since torch 2.x) gloo implement.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output.view(torch.uint8), shard.view(torch.uint8), group=group)


def require_process_group(group: Any = None) -> Any:
    """The group to shard over (``None`` → the default group); raises when torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "distributed layerwise offload needs an initialised torch.distributed process group; launch with "
            "`torchrun --nproc-per-node N ...` (or accelerate launch) and call "
            "torch.distributed.init_process_group('nccl' on GPUs, 'gloo' on CPU) before enabling it; for one "
            "process use enable_layerwise_offload()"
        )
    return group if group is not None else dist.group.WORLD


class _GatherTransfers(Transfers):
    """H2D copies on the copy stream, all-gathers on a communication stream; synchronous with ``device='cpu'``."""

    def __init__(self, device: torch.device, group: Any) -> None:
        super().__init__(device)
        self.group = group
        if self.asynchronous:
            self.comm_stream = self._module.Stream(device)

    def gather(self, h2d: list[tuple[torch.Tensor, torch.Tensor]], gathers: list[tuple[torch.Tensor, torch.Tensor]],
               wait_for=None, staged=None, done=None) -> None:
        if not self.asynchronous:
            for src, dst in h2d:
                dst.copy_(src)
            for output, shard in gathers:
                all_gather_bytes(output, shard, self.group)
            return
        with self._module.stream(self.copy_stream):
            if wait_for is not None:
                self.copy_stream.wait_event(wait_for)
            for src, dst in h2d:
                dst.copy_(src, non_blocking=True)
            staged.record(self.copy_stream)
        with self._module.stream(self.comm_stream):
            self.comm_stream.wait_event(staged)
            # async_op=False: the collective is ordered on (and completes before later work of) the comm stream;
            # the host does not wait for it.
            for output, shard in gathers:
                all_gather_bytes(output, shard, self.group)
            done.record(self.comm_stream)


class _GatherSlot:
    """One fixed device slot: a full-block buffer and a one-shard staging buffer per dtype, and its events."""

    def __init__(self, index: int, sizes: dict[torch.dtype, int], shards: dict[torch.dtype, int],
                 device: torch.device, transfers: _GatherTransfers) -> None:
        self.index = index
        self.buffers = {d: torch.zeros(n, dtype=d, device=device) for d, n in sizes.items()}
        self.staging = {d: torch.zeros(n, dtype=d, device=device) for d, n in shards.items()}
        self.staged = transfers.new_event()
        self.ready = transfers.new_event()
        self.released = transfers.new_event()
        self.owner: _ShardedBlock | None = None


class _ShardedBlock:
    """One block whose host copy is this rank's shard of each per-dtype flat buffer."""

    def __init__(self, weights: PackedWeights, world_size: int, rank: int, device: torch.device) -> None:
        self.weights = weights
        self.world_size = world_size
        self.rank = rank
        self.shard = {d: shard_numel(n, world_size) for d, n in weights.numel.items()}
        self.host: dict[torch.dtype, torch.Tensor] = {}
        self.placeholders = [placeholder(s.dtype, device) for s in weights.slots]
        self.slot: _GatherSlot | None = None
        self.views: list[torch.Tensor] = []
        self.h2d: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.gathers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.running = False

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def pack(self, host_memory: HostMemory) -> None:
        """Copy this rank's slice of every tensor into its shard buffers (zero padding elsewhere)."""
        self.host = {d: host_memory.allocate(n, d) for d, n in self.shard.items()}
        for buffer in self.host.values():
            buffer.zero_()
        # As in ``PackedWeights.pack``: slices on an accelerator go by DMA into buffers page-locked first.
        devices = {s.leaf.data().device for s in self.weights.slots} - {torch.device("cpu"), torch.device("meta")}
        direct = bool(devices) and host_memory.page_locked
        if direct:
            for buffer in self.host.values():
                host_memory.pin(buffer)
        sources = []
        for slot in self.weights.slots:
            start, end = shard_range(self.weights.numel[slot.dtype], self.world_size, self.rank)
            numel = slot.shape.numel()
            lo, hi = max(slot.offset, start), min(slot.offset + numel, end)
            if lo < hi:
                source = slot.flat_source()[lo - slot.offset : hi - slot.offset]
                self.host[slot.dtype][lo - start : hi - start].copy_(source, non_blocking=direct)
                sources.append(source)
        if direct:  # ``sources`` keeps the device memory (and reshaped copies) alive until the copies are done
            for device in devices:
                torch.get_device_module(device).current_stream(device).synchronize()
        else:
            for buffer in self.host.values():
                host_memory.pin(buffer)

    def attach(self, slot: _GatherSlot) -> None:
        self.slot = slot
        self.views = self.weights.views_into(slot.buffers)
        self.h2d = [(self.host[d], slot.staging[d].narrow(0, 0, n)) for d, n in self.shard.items()]
        self.gathers = [
            (slot.buffers[d].narrow(0, 0, n * self.world_size), slot.staging[d].narrow(0, 0, n))
            for d, n in self.shard.items()
        ]


@dataclass
class DistributedStats(LayerwiseStats):
    rank: int = 0
    world_size: int = 1
    use_allgather: bool = True
    gathers: int = 0
    host_bytes_per_dtype: dict = field(default_factory=dict)


class _GatherStreamer:
    """Fixed-slot ring (block ``i`` → slot ``i % 2``). Every rank makes the same calls in the same order."""

    def __init__(self, transfers: _GatherTransfers, stats: DistributedStats) -> None:
        self.transfers = transfers
        self.stats = stats

    def load(self, block: _ShardedBlock) -> None:
        slot = block.slot
        if slot.owner is block:
            return
        if slot.owner is not None and slot.owner.running:
            raise RuntimeError(
                f"distributed layerwise offload: slot {slot.index} still holds running block "
                f"{slot.owner.weights.path!r} while {block.weights.path!r} needs it (are blocks calling each other?)"
            )
        self.transfers.gather(block.h2d, block.gathers, wait_for=slot.released, staged=slot.staged, done=slot.ready)
        slot.owner = block
        self.stats.loads += 1
        self.stats.gathers += len(block.gathers)
        self.stats.copied_bytes += block.host_bytes

    @torch.compiler.disable(reason=EAGER_ONLY)
    def begin(self, block: _ShardedBlock, following: _ShardedBlock | None) -> None:
        if block.slot.owner is not block:
            self.stats.on_demand_loads += 1
            self.load(block)
        self.transfers.compute_waits_for(block.slot.ready)
        block.weights.bind(block.views)
        block.running = True
        if following is not None and following.slot is not block.slot:
            self.load(following)

    @torch.compiler.disable(reason=EAGER_ONLY)
    def end(self, block: _ShardedBlock, following: _ShardedBlock | None) -> None:
        self.transfers.record_on_compute(block.slot.released)
        block.weights.park(block.placeholders)
        block.running = False
        if following is not None and following.slot is block.slot:
            self.load(following)  # odd ring: the wrap-around shares the last block's slot

    @torch.compiler.disable(reason=EAGER_ONLY)
    def enter_stack(self, ring: list[_ShardedBlock]) -> None:
        for block in ring:
            if block.running:  # a forward raised before end(); settle it
                self.end(block, None)
        self.load(ring[0])


class DistributedLayerwiseOffloadBackend(LayerwiseOffloadBackend):
    """Layerwise offload on every rank of a process group. This class is the no-AllGather mode (a full host copy
    per rank, streamed as in single-process layerwise offload); ``AllGatherLayerwiseOffloadBackend`` keeps 1/N host
    shards per rank and gathers each block. ``for_config`` picks by ``config.use_allgather``. Enable and disable are
    collective: call them on every rank.
    """

    strategy = OffloadStrategy.DISTRIBUTED_LAYERWISE
    # The DiT's output layers stay resident here (the AllGather ring installs its own hooks, and no last block
    # of it ends with the DiT's forward).
    fold_tail = False
    manages_components = False  # encoders and VAEs stay on each rank's device
    use_allgather: bool = False
    # Whether prime runs a collective (AllGather: it gathers the first block): a rank failing inside it cannot
    # join the agreement after it, since the others may be inside the collective.
    prime_is_collective: bool = False

    @classmethod
    def for_config(cls, config) -> "DistributedLayerwiseOffloadBackend":
        variant = AllGatherLayerwiseOffloadBackend if config.use_allgather else DistributedLayerwiseOffloadBackend
        return variant(config)

    def __init__(self, config) -> None:
        if config.use_allgather != self.use_allgather:
            raise ValueError(
                f"{type(self).__name__} serves use_allgather={self.use_allgather}, got use_allgather="
                f"{config.use_allgather}; build it with DistributedLayerwiseOffloadBackend.for_config(config)"
            )
        super().__init__(config)
        self.group = require_process_group(config.process_group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        backend = str(dist.get_backend(self.group)).lower()
        if self.device.type == "cpu" and backend == "nccl":
            raise ValueError("device='cpu' cannot use an NCCL process group; allowed: a gloo group for CPU runs")

    def _enable_steps(self) -> Sequence[EnableStep]:
        # Every rank runs the local steps between two agreements (``_agree``): discover ends with one, the local
        # steps with ``agree_local`` (before prime, whose AllGather is a collective), prime with ``agree_primed``. A
        # rank that fails in between joins the next agreement with its error (``enable``), so every rank rolls back.
        return (self._discover, self._agree_layout, self._move_residents, self._pack_blocks, self._count_host_bytes,
                self._allocate_slots, self._install_hooks, self._install_step_check, self._install_guards,
                self._agree_local, self._prime, self._agree_primed)

    @property
    def max_device_memory(self) -> None:
        """No byte budget: ``resident_layers`` chooses the resident blocks and every other block streams."""
        return None

    @property
    def stats(self) -> DistributedStats:
        return super().stats

    def _new_state(self, target: Any) -> LayerwiseState:
        state = super()._new_state(target)
        state.keep_residues = False  # every rank must lay blocks out alike (the layout digest, the shards)
        state.stats = DistributedStats(rank=self.rank, world_size=self.world_size, use_allgather=self.use_allgather)
        return state

    # Enable is collective: every rank's failure becomes every rank's failure --------------------------------

    def enable(self, target: Any) -> "DistributedLayerwiseOffloadBackend":
        """Enable on every rank (collective). If any rank fails at any stage, every rank rolls back and raises:
        the failing rank its own error (with a note naming it), the others a ``RuntimeError`` naming the failing
        rank and its error; within one agreement, not after the process group's timeout."""
        # The agreement this rank owes the others if it fails now: discovery is followed by the layout agreement.
        self._pending_agreement: str | None = "agree_layout"
        try:
            return super().enable(target)  # a failing stage is rolled back here (the journal), then re-raised
        except BaseException as error:
            pending, self._pending_agreement = self._pending_agreement, None
            if pending is not None:
                try:
                    self._agree(pending, error)  # the others wait there: tell them, then raise here
                except Exception as agreeing:  # noqa: BLE001 - this rank's own error is the one to raise
                    logger.warning("distributed offload rank %d: telling the other ranks that enabling failed "
                                   "failed too (%s: %s)", self.rank, type(agreeing).__name__, agreeing)
                else:
                    error.add_note(
                        f"distributed layerwise offload: rank {self.rank} of {self.world_size} (this rank) failed "
                        "while enabling; the other ranks were told, and every rank rolled back: none enabled it"
                    )
            raise

    def _agree(self, point: str, error: BaseException | None = None, extra: Any = None) -> list[Any]:
        """Agreement ``point``: all ranks exchange their error text (``None``: this rank succeeded) and ``extra``.
        When any rank failed, every other rank raises here, naming it (a failing rank passes its own ``error``,
        which its caller raises). Returns every rank's ``extra``, in rank order."""
        answers: list[Any] = [None] * self.world_size
        text = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(answers, (point, text, extra), group=self.group)
        failed = [(r, message) for r, (_, message, _) in enumerate(answers) if message is not None]
        if failed and error is None:
            rank, message = failed[0]
            others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
            raise RuntimeError(
                f"distributed layerwise offload: rank {rank}{others} could not enable ({message}); every rank "
                "rolled back, no rank enabled it"
            )
        return [value for _, _, value in answers]

    def _agree_local(self, state: LayerwiseState, journal: Journal) -> None:
        self._pending_agreement = None  # from here on this rank is in the agreement itself
        self._agree("agree_local")
        self._pending_agreement = None if self.prime_is_collective else "agree_primed"

    def _agree_primed(self, state: LayerwiseState, journal: Journal) -> None:
        self._pending_agreement = None
        self._agree("agree_primed")

    # After discovery: local checks, then every rank agrees (a rank that failed in discovery joins this agreement
    # with its error through ``enable``, so no rank is left waiting in a collective).

    def _agree_layout(self, state: LayerwiseState, journal: Journal) -> None:
        """Place ``resident_layers`` and check that every rank discovered the same model (block layouts)."""
        error: BaseException | None = None
        digest = ""
        try:
            self._check_and_place_residents(state)
            digest = _layout_digest(state)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard about it
            error = exc
        self._pending_agreement = None  # from here on this rank is in the agreement itself
        digests = self._agree("agree_layout", error, extra=digest)
        if error is not None:
            raise error
        if len(set(digests)) > 1:
            raise ValueError(
                "distributed layerwise offload: ranks hold different models (block layouts differ: "
                f"{[d[:8] for d in digests]}); every rank must load the same model and pipeline"
            )
        self._pending_agreement = "agree_local"  # the ranks agreed: a failure from here on is told at agree_local

    def _check_and_place_residents(self, state: LayerwiseState) -> None:
        layers = self.config.resident_layers
        if layers:
            main = state.weights[0]
            if layers > len(main):
                raise ValueError(
                    f"resident_layers={layers} exceeds the {len(main)} blocks of {state.stacks[0].name!r}; allowed: "
                    f"0..{len(main)}"
                )
            for i in range(layers):
                state.resident[0][i] = True
        flat = [(w, r) for ws, rs in zip(state.weights, state.resident) for w, r in zip(ws, rs)]
        stats = state.stats
        stats.streamed_blocks = sum(1 for w, r in flat if not r and not w.empty)
        stats.resident_blocks = sum(1 for w, r in flat if r and not w.empty)
        stats.streamed_bytes_per_pass = sum(w.nbytes for w, r in flat if not r)

    def _count_host_bytes(self, state: LayerwiseState, journal: Journal) -> None:
        """Host bytes per dtype of the packed blocks (each rank holds a full host copy in this mode)."""
        state.stats.host_bytes_per_dtype = {
            str(d): n * torch.empty(0, dtype=d).element_size()
            for d, n in _sum_numel(w for ws in state.weights for w in ws if not w.empty).items()
        }

    def _forward_lock(self) -> ForwardLock:
        # Waiting would not help: this rank's collectives (block gathers, the step check) must come in the order of
        # every other rank's, and two threads taking turns on one rank interleave their calls in any order.
        return ForwardLock(
            f"distributed layerwise offload (rank {self.rank}/{self.world_size})",
            refusal=(
                "distributed layerwise offload runs every rank in lockstep (its forwards and step checks are "
                "collectives that must come in the same order on every rank), so each rank's pipeline and DiT calls "
                "must come from one thread at a time; nothing was run for this call. Allowed: call from one "
                "thread per rank (queue concurrent requests to one worker thread), or use "
                "enable_layerwise_offload() in each process, which serves concurrent callers one after another"
            ),
        )

    def _inference_only(self, state: LayerwiseState, label: str) -> str:
        return super()._inference_only(state, label).replace("() first", "() on every rank first")

    def _install_step_check(self, state: LayerwiseState, journal: Journal) -> None:
        from .dataparallel import install_step_check

        remove = install_step_check(state.target, self.group, lock=state.lock)
        if remove is not None:
            journal.record("remove step check", remove)
            self._remove_step_check = remove

    def _guard_installer(self, state: LayerwiseState, guards: Journal) -> GuardInstaller:
        # Disabling and enabling are collective, so nothing may suspend the offload on one rank.
        installer = super()._guard_installer(state, guards)
        installer.suspend = None
        installer.suspend_refusal = ("disabling and enabling distributed offload are collective; do it on every "
                                     "rank")
        installer.way_out = installer.way_out.replace("()", "() on every rank")
        return installer

    # Disable ---------------------------------------------------------------------------------------------

    def disable(self) -> None:
        """Collective, like enable. Refused (``ConcurrentCallError``, nothing changed) while another thread of this
        rank runs a forward: the lock is taken before the guards come off."""
        state = self._state
        if not self._enabled or state is None or state.lock is None:
            return super().disable()
        with state.lock:
            super().disable()

    def _disable(self) -> None:
        self._remove_step_check_hook()
        super()._disable()  # re-enters the forward lock disable() holds

    def _remove_step_check_hook(self) -> None:
        remove = self.__dict__.pop("_remove_step_check", None)
        if remove is not None:
            remove()


class AllGatherLayerwiseOffloadBackend(DistributedLayerwiseOffloadBackend):
    """Distributed layerwise offload in AllGather mode: each rank pins 1/N of every block, and a block is rebuilt
    on the device by an all-gather of the shards before it runs."""

    use_allgather = True
    prime_is_collective = True

    def _enable_steps(self) -> Sequence[EnableStep]:
        # Discovery and the agreements are the no-AllGather mode's; packing, slots, hooks, guards and priming are
        # this mode's own (1/N shards, two gathered slots).
        return (self._discover, self._agree_layout, self._move_residents, self._pack_shards, self._allocate_gather_slots,
                self._install_gather_hooks, self._install_step_check, self._install_shard_guards, self._agree_local,
                self._prime_gather, self._agree_primed)

    def _pack_shards(self, state: LayerwiseState, journal: Journal) -> None:
        state.host_memory = host_memory = HostMemory(self.device, self.config.pin_memory)
        state.stats.host_memory_mode = host_memory.mode
        journal.record("release host memory", lambda: host_memory.release(self.device))
        total = sum(w.nbytes for ws in state.weights for w in ws)
        per_dtype: dict[str, int] = {}
        desc = f"distributed offload rank {self.rank}/{self.world_size}: packing shards"
        with byte_progress(total, desc, self.config.show_progress, state.target) as bar:
            for stack_weights, stack_resident in zip(state.weights, state.resident):
                row: list[_ShardedBlock | None] = []
                for weights, resident in zip(stack_weights, stack_resident):
                    if weights.empty or resident:
                        if resident:  # plan-declared residents: a full device copy (no sharding)
                            journal.record(f"move {weights.path}", weights.tensors.move_to(self.device))
                        row.append(None)
                        continue
                    block = _ShardedBlock(weights, self.world_size, self.rank, self.device)
                    block.pack(host_memory)
                    originals = weights.tensors.current()
                    journal.record(f"restore {weights.path}", partial(weights.park, originals))
                    weights.park(block.placeholders)  # the originals are freed once enable commits
                    for d, t in block.host.items():
                        per_dtype[str(d)] = per_dtype.get(str(d), 0) + t.numel() * t.element_size()
                    row.append(block)
                    bar.update(weights.nbytes)
                state.streamed.append(row)
        state.stats.host_bytes = sum(per_dtype.values())
        state.stats.host_bytes_per_dtype = per_dtype
        release_freed_host_memory()
        release_freed_device_memory(self.device)
        logger.info("distributed offload rank %d/%d: host shards %s (of %s)", self.rank, self.world_size,
                    format_bytes(state.stats.host_bytes), format_bytes(total))

    def _allocate_gather_slots(self, state: LayerwiseState, journal: Journal) -> None:
        blocks = [b for row in state.streamed for b in row if b is not None]
        state.transfers = transfers = _GatherTransfers(self.device, self.group)
        shards: dict[torch.dtype, int] = {}
        for block in blocks:
            for dtype, numel in block.shard.items():
                shards[dtype] = max(shards.get(dtype, 0), numel)
        sizes = {d: n * self.world_size for d, n in shards.items()}
        slots = [_GatherSlot(i, sizes, shards, self.device, transfers) for i in range(SLOT_COUNT)] if blocks else []
        for row in state.streamed:
            ring = [b for b in row if b is not None]
            for position, block in enumerate(ring):
                block.attach(slots[position % SLOT_COUNT])
        state.streamer = _GatherStreamer(transfers, state.stats)
        state.stats.slot_count = len(slots)
        state.stats.slot_bytes = sum(n * torch.empty(0, dtype=d).element_size() for d, n in sizes.items())
        logger.info("distributed offload: %d device slots of %s (+ staging shards of %s)", len(slots),
                    format_bytes(state.stats.slot_bytes),
                    format_bytes(sum(n * torch.empty(0, dtype=d).element_size() for d, n in shards.items())))

    def _install_gather_hooks(self, state: LayerwiseState, journal: Journal) -> None:
        journal.record("remove hooks", state.hooks.remove_all)
        state.lock = self._forward_lock()
        streamer = state.streamer
        for stack, row in zip(state.stacks, state.streamed):
            ring = [b for b in row if b is not None]
            if not ring:
                continue
            state.hooks.install(stack.owner,
                                LockedCallbackHook(state.lock, stack.name, before=partial(streamer.enter_stack, ring),
                                                   inference_only=self._inference_only(state, stack.name)),
                                LAYERWISE_ENTRY_HOOK)
            following = {id(b): ring[(i + 1) % len(ring)] if len(ring) > 1 else None for i, b in enumerate(ring)}
            for (_, module), block in zip(stack.blocks, row):
                if block is None:
                    continue
                nxt = following[id(block)]
                hook = CallbackHook(before=partial(streamer.begin, block, nxt), after=partial(streamer.end, block, nxt))
                state.hooks.install(module, hook, LAYERWISE_BLOCK_HOOK)
        roots = [stack.owner for stack in state.stacks]
        refresh_registry_caches(roots)
        journal.record("refresh registry caches", lambda: refresh_registry_caches(roots))

    def _install_shard_guards(self, state: LayerwiseState, journal: Journal) -> None:
        OffloadBackend._install_guards(self, state, journal)
        self._refuse_pickling(state)
        pipeline = not isinstance(state.target, torch.nn.Module)
        way_out = "pipe.disable_omni_offload()" if pipeline else "backend.disable()"
        message = (
            "{what}: distributed layerwise offload (AllGather) keeps only this rank's 1/N shard of every streamed "
            f"block, so the full weights exist nowhere to read; nothing was written. Allowed: {way_out} on every "
            "rank (collective: it gathers full host copies), then save"
        )
        for stack, row in zip(state.stacks, state.streamed):
            for (path, module), block in zip(stack.blocks, row):
                if block is not None:
                    handle = module.register_state_dict_post_hook(_refuse_state_dict(message, path))
                    self._guards.record("remove a state_dict hook", handle.remove)
        owners = [(label, module) for label, module in self._managed_modules(state)]
        if pipeline:
            owners.append(("pipe", state.target))
        for label, owner in owners:
            original = getattr(owner, "save_pretrained", None)
            if original is not None:
                self._guards.set(owner, "save_pretrained", _refuse_call(message, f"{label}.save_pretrained", original))

    def _prime_gather(self, state: LayerwiseState, journal: Journal) -> None:
        for row in state.streamed:
            ring = [b for b in row if b is not None]
            if ring:
                state.streamer.enter_stack(ring)
        self._pending_agreement = "agree_primed"  # past the collective: a failure now is told at agree_primed

    def _disable(self) -> None:
        state = self._state
        with state.lock:  # refused while another thread of this rank runs a forward
            self._remove_step_check_hook()
            self._disable_locked(state)

    def _disable_locked(self, state: LayerwiseState) -> None:
        state.transfers.synchronize()
        state.hooks.remove_all()
        refresh_registry_caches([stack.owner for stack in state.stacks])
        # Collective: every rank gathers every block once more and keeps full, ordinary host tensors.
        blocks = [block for row in state.streamed for block in row if block is not None]
        total = sum(block.weights.nbytes for block in blocks)
        with byte_progress(total, "distributed offload: gathering blocks to host", self.config.show_progress,
                           self._target) as bar:
            for block in blocks:
                block.slot.owner = None
                state.transfers.gather(block.h2d, block.gathers, wait_for=block.slot.released,
                                       staged=block.slot.staged, done=block.slot.ready)
                state.transfers.synchronize()
                block.weights.park([view.to("cpu", copy=True) for view in block.views], final=True)
                block.host = {}
                bar.update(block.weights.nbytes)
        state.host_memory.release(self.device)
        logger.info("distributed layerwise offload disabled: block weights are full host tensors again")


def _refuse_state_dict(message: str, path: str):
    def refuse(module, state_dict, prefix, local_metadata) -> None:
        raise OffloadActiveError(message.format(what=f"state_dict() of {path!r}"))

    return refuse


def _refuse_call(message: str, what: str, original):
    @functools.wraps(original)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OffloadActiveError(message.format(what=f"{what}(...)"))

    return refuse


def _sum_numel(weights) -> dict[torch.dtype, int]:
    total: dict[torch.dtype, int] = {}
    for w in weights:
        for d, n in w.numel.items():
            total[d] = total.get(d, 0) + n
    return total


def _layout_digest(state: LayerwiseState) -> str:
    """A hash of every block's path, tensor shapes and dtypes: equal on every rank that loaded the same model."""
    h = hashlib.sha256()
    for stack_weights, resident in zip(state.weights, state.resident):
        for w, r in zip(stack_weights, resident):
            h.update(f"{w.path}|{r}|".encode())
            for s in w.slots:
                h.update(f"{s.dtype}:{tuple(s.shape)}:{s.offset};".encode())
    return h.hexdigest()


def host_bytes_per_rank(numel: dict[torch.dtype, int], world_size: int) -> dict[torch.dtype, int]:
    """Bytes one rank pins for a block with ``numel`` elements per dtype: ``ceil(numel / N)`` elements each."""
    return {d: shard_numel(n, world_size) * torch.empty(0, dtype=d).element_size() for d, n in numel.items()}


__all__ = [
    "AllGatherLayerwiseOffloadBackend",
    "DistributedLayerwiseOffloadBackend",
    "all_gather_bytes",
    "host_bytes_per_rank",
    "require_process_group",
    "shard_numel",
    "shard_range",
]
