"""The file-backed store: blocks with no host copy, read from their checkpoint files at each load.

Under ``max_host_memory`` the planner (``plan_disk_blocks``) chooses the streamed blocks that keep no host copy of
their own (``host_plan.plan_host_memory``): each is mapped to the pieces of its checkpoint files
(``disk.BlockSource``), checked against them, and read by the reader thread into the staging ring
(``disk.StagingRing``) ahead of its load; blocks of alternating DiTs at one position share one buffer that keeps
the block last read into it. ``FileStore`` fills the device buffers from the staged bytes and reads the block
again, into ordinary host tensors, for ``state_dict()`` and on disable.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ...config.offload import format_bytes
from ...utils.journal import Journal
from ...utils.progress import byte_progress
from ..discovery import DIT, ENCODER, component_of
from ..disk import (
    BlockSource, DiskReader, FileViews, StagingRing, block_source, checkpoint_names, find_checkpoint, plain_leaf,
    verify_block, view_source,
)
from ..host_plan import HostCandidate, plan_host_memory
from ..memory import PackedWeights, Transfers
from ..tensors import PLAIN_TENSOR_TYPES
from .base import BlockStore, StoreContext, register_store

logger = logging.getLogger("diffusers_omni")


@register_store
class FileStore(BlockStore):
    """A block whose bytes are its checkpoint's: read into a staging buffer (or its shared buffer) by the reader
    thread, copied from there to the device; nothing of it stays in host memory between loads."""

    name = "disk"
    priority = 100
    in_host_memory = False

    def __init__(self, weights: PackedWeights, context: StoreContext) -> None:
        super().__init__(weights, context)
        self.source: BlockSource = context.sources[id(weights)]
        self._given: list[torch.Tensor] | None = None  # read back by prepare_give_back, bound by give_back

    @classmethod
    def claims(cls, weights: PackedWeights, context: StoreContext) -> bool:
        return id(weights) in context.sources

    def take(self, journal: Journal) -> None:
        # The tensors become placeholders at once; the rollback of a failed enable gives them their own data back
        # (kept until enable returns, then freed: their bytes are the files').
        weights = self.weights
        originals = weights.tensors.current()
        journal.record(f"restore {weights.path}", lambda: weights.park(originals))

    def fill(self, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for, done) -> None:
        ring = self.context.ring
        staged = ring.take(self.source)
        try:
            self._queue(staged, buffers, transfers, wait_for, done)
        except BaseException:
            transfers.synchronize()  # nothing may still copy from the buffer given back here
            ring.release(staged)
            raise
        # The staging buffer is free once the copies from it queued on the copy stream are done.
        ring.release(staged, transfers.record_on_copy if transfers.asynchronous else None)

    def _queue(self, staged: Any, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for,
               done) -> None:
        """Queue the block's bytes from ``staged`` (its staging buffer) into ``buffers`` on the copy stream."""
        source = self.source
        pairs = staged.pairs[source.index]
        if pairs is None:  # made once per (block, staging buffer): the hot path allocates nothing more
            views = source.views(staged.buffer)
            pairs = staged.pairs[source.index] = [(views[dtype], buffers[dtype]) for dtype in views]
        transfers.copy(pairs, wait_for=wait_for, done=done)

    def _read_back(self) -> dict[torch.dtype, torch.Tensor]:
        """The block's flat per-dtype tensors read from disk into ordinary host memory."""
        return self.context.reader.read_pageable(self.source)

    def host_views(self) -> list[torch.Tensor]:
        # Views of the checkpoint files when they are the ones checked at enable (no RAM: a model bigger than the
        # host budget is shown, saved or given back as pages the kernel may reclaim, as it was loaded); else read
        # and checked against the checksum taken at enable (``DiskReader.read`` refuses changed bytes).
        mapped = self.context.reader.mapped_views(self.source, self.weights.slots)
        return mapped if mapped is not None else self.weights.views_into(self._read_back())

    def prepare_give_back(self) -> None:
        # Got before disable changes anything: a block that cannot be read back refuses the disable instead of being
        # left empty.
        self._given = self.host_views()

    def cancel_give_back(self) -> None:
        self._given = None

    def give_back(self) -> None:
        views, self._given = self._given, None
        self.weights.park(views if views is not None else self.host_views(), final=True)


def request_reads(ring: StagingRing, blocks: list[Any]) -> None:
    """A stack is about to run: its first disk-backed blocks not on the device yet are read now (another stack's
    staged reads give way), while its first blocks load."""
    wanted = []
    for block in blocks:
        store = block.store
        if isinstance(store, FileStore) and block.slot is None:
            wanted.append(store.source)
            if len(wanted) == ring.ahead:
                break
    if wanted:
        ring.want(tuple(wanted))


def file_views(state: Any) -> FileViews:
    """The process's file mappings, read once per enable (checking disk-backed blocks, then packing)."""
    if state.file_views is None:
        state.file_views = FileViews()
    return state.file_views


def plan_disk_blocks(state: Any, budget: int | None, staging_count: int, show_progress: Any,
                     journal: Journal, coded: Any = None) -> None:
    """With ``max_host_memory``: which streamed blocks keep no host copy of their own (``plan_host_memory``:
    read from disk at every load, or sharing a buffer with the blocks of the alternating DiTs at the same
    position), each mapped to its checkpoint files and checked against them (names, dtypes, shapes, bytes),
    before anything changes. ``coded`` (``coded_file.CodedSources``, with ``compression_cache_dir``): the blocks it
    claims are written to the cache first, count at their coded size and, on disk, are read coded from the cache
    (no checkpoint needed)."""
    if budget is None:
        return
    components: dict[int, tuple[Any, dict[int, list[str]], dict[int, str]]] = {}
    candidates: list[HostCandidate] = []
    owners: dict[int, Any] = {}  # id(PackedWeights) → its component, for blocks that may be read from disk
    groups = {id(c.module): 0 for c in state.topology.alternating}
    views = file_views(state)
    mapped: set[int] = set()  # id(PackedWeights) of quantized blocks read back from the files they are views of
    positions: dict[int, int] = {}  # id(component module) → streamed blocks seen so far (load order)
    resident_bytes = 0
    coded_ids: set[int] = set()  # id(PackedWeights) of the blocks read coded from compression_cache_dir
    coding = sum(w.nbytes for row, resident_row in zip(state.weights, state.resident)
                 for w, resident in zip(row, resident_row)
                 if not resident and not w.empty and coded is not None and coded.claims(w))
    label = getattr(coded, "progress_label", "layerwise offload: coded blocks checked")
    with byte_progress(coding, label, show_progress if coding else False, state.target) as bar:
        for index, (stack, row, resident_row, kind) in enumerate(
                zip(state.stacks, state.weights, state.resident, state.kinds)):
            component = component_of(state.topology, stack.owner)
            if component is not None and id(component.module) not in components:
                components[id(component.module)] = (component, *checkpoint_names(component.module))
            group = groups.get(id(component.module), -1) if component is not None and kind == DIT else -1
            for weights, resident in zip(row, resident_row):
                if weights.empty:
                    continue
                if resident:
                    resident_bytes += weights.nbytes
                    continue
                nbytes = weights.nbytes
                if coded is not None and coded.claims(weights):
                    reason, kept = "", 0
                    nbytes = coded.prepare(weights)
                    coded_ids.add(id(weights))
                    if component is not None:
                        owners[id(weights)] = component
                    bar.update(weights.nbytes)
                elif component is None:
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
                candidates.append(HostCandidate(weights, weights.path, nbytes, index, kind == ENCODER, reason,
                                                group, position, kept if component is not None else 0))
    fixed = {"phase units": sum(u.weights.nbytes for u in state.units), "resident blocks": resident_bytes}
    count = staging_count
    checkpoints: dict[int, tuple[Any, str]] = {}
    if sum(fixed.values()) + sum(c.nbytes for c in candidates) > budget:
        # Disk is needed: the blocks whose component was not loaded from local safetensors files keep theirs.
        for candidate in candidates:
            component = owners.get(id(candidate.key))
            if candidate.reason or component is None or id(candidate.key) in mapped | coded_ids:
                continue
            if id(component.module) not in checkpoints:
                checkpoints[id(component.module)] = find_checkpoint(component.module, component.path)
            checkpoint, why = checkpoints[id(component.module)]
            if checkpoint is None:
                candidate.reason = f"{component.label!r}: {why}"
                if torch.bfloat16 in candidate.key.numel:  # the lossless code on disk needs no checkpoint
                    candidate.reason += ("; or compression=\"lossless\" with compression_cache_dir: its bfloat16 "
                                         "blocks are then read coded from that folder")
    plan = plan_host_memory(candidates, fixed, budget, count)
    if coded is not None:  # the code of the blocks read from disk, in the cache folder (checked, or written now)
        disk_coded = [c.key for c in plan.blocks if id(c.key) in coded_ids]
        with byte_progress(sum(w.nbytes for w in disk_coded), getattr(coded, "materialize_label", label),
                           show_progress if disk_coded else False, state.target) as bar:
            coded.materialize(disk_coded, bar.update)
    if not plan:
        logger.info("layerwise offload: max_host_memory %s: every host copy fits", format_bytes(budget))
        return
    files: list = []
    sources: dict[int, BlockSource] = {}
    for candidate in plan.blocks:
        weights = candidate.key
        if id(weights) in coded_ids:
            owner = owners.get(id(weights))
            sources[id(weights)] = coded.source(weights, owner.label if owner is not None else "", files)
            continue
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
                       show_progress, state.target) as bar:
        for source in sources.values():
            if source.coded is not None:
                coded.verify(source, reader)
            else:
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


def start_staging(state: Any, ahead: int, owner: Any, journal: Journal) -> StagingRing:
    """The staging ring of the disk-backed blocks and the buffers shared by the alternating DiTs' blocks:
    page-locked buffers from the offload's ``HostMemory`` (so they are unregistered with the rest, before they
    are freed) and the reader thread, stopped and joined by ``disable``, by the rollback of a failed enable, or
    when ``owner`` (the backend) is garbage collected. Each disk-backed block learns the disk-backed blocks that load
    after it (a DiT's wrap around to the next step)."""
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
    ring = StagingRing(state.disk_reader, buffers[:count], events[:count], state.stats, state.transfers.device,
                       _source_loaded, len(state.disk), ahead,
                       shared=list(zip(buffers[count:], events[count:], state.shared)))
    state.staging = ring
    state.stop_reader = weakref.finalize(owner, ring.close)
    journal.record("stop the disk reader", state.stop_reader)
    for row, kind in zip(state.streamed, state.kinds):
        sources = [b.store.source for b in row if b is not None and isinstance(b.store, FileStore)]
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
