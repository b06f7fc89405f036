"""The coded file store: under ``max_host_memory`` with ``compression="lossless"`` and ``compression_cache_dir``, the
blocks that keep no host copy are read from their cache file — their lossless code, about 0.7 of their bytes —
instead of from the checkpoint, and decoded on the device.

``CodedSources`` is what the host planner (``stores.file.plan_disk_blocks``) asks about such blocks: they count at
their coded size (for the host copies the budget keeps and for the staging ring: counted from their keys, not coded,
or the size of their file when the folder holds their code) and need no checkpoint (the cache holds the block's
bytes as the model has them: a model built in memory, non-persistent buffers, a permuted layout). Once the plan is
made, the blocks it reads from disk are written to the cache once (``coded_cache.CodedCache.ensure_all``: coding
the next block while the last one is written), and only those. A disk-backed block's source is then one piece of
its cache file, read by the reader thread into the staging ring as any disk-backed block is; ``CodedFileStore``
copies the staged code to the device and decodes it there (``lossless.upload_and_decode``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from ...utils.journal import Journal
from ..coded_block import CodedBlock, coded_nbytes, coding_device
from ..coded_cache import CodedCache
from ..disk import BlockSource, DiskReader, Piece, take_checksum
from ..memory import PackedWeights, Transfers
from .base import StoreContext, register_store
from .file import FileStore
from .lossless import code_ring, codes, upload_and_decode


class CodedSources:
    """The host planner's view of the blocks the lossless code serves, with a cache folder (see the module)."""

    progress_label = "layerwise offload: sizing the lossless code"
    materialize_label = ("layerwise offload: lossless code of the disk-backed blocks in compression_cache_dir "
                         "(checked, or written once)")

    def __init__(self, cache: CodedCache, device: torch.device) -> None:
        self.cache = cache
        self.device = device
        self._entries: dict[int, Any] = {}  # id(PackedWeights) → coded_cache.Entry

    def claims(self, weights: PackedWeights) -> bool:
        return codes(weights)

    def prepare(self, weights: PackedWeights) -> int:
        """The bytes of the block's code (what it counts at in the plan): the size of its file when the folder holds
        the code of these weights, else counted from its keys without coding it (``coded_block.coded_nbytes``)."""
        entry = self.cache.entry_for(weights)
        if entry is not None:
            return entry.nbytes
        return coded_nbytes(weights.current_flat(coding_device(self.device)), self.device)

    def materialize(self, blocks: list[PackedWeights], progress: Any = None) -> None:
        """The plan reads ``blocks`` from disk: the folder gets their code (checked, or written now), and only
        theirs (the blocks kept in host memory are coded there, ``CodedCache.writes``)."""
        self.cache.disk_only = {weights.path for weights in blocks}
        for weights, entry in zip(blocks, self.cache.ensure_all(blocks, self.device, progress)):
            self._entries[id(weights)] = entry

    def source(self, weights: PackedWeights, component: str, files: list[Path]) -> BlockSource:
        """The block's source: its whole cache file's coded bytes (``files`` is the reader's list, extended)."""
        entry = self._entries[id(weights)]
        if entry.file not in files:
            files.append(entry.file)
        piece = Piece(files.index(entry.file), entry.offset, 0, entry.nbytes, f"{weights.path} (lossless code)")
        source = BlockSource(weights.path, component, {torch.uint8: entry.nbytes}, [piece])
        # The layout only (views of a meta tensor: no memory); loads decode the staged bytes through it.
        source.coded = CodedBlock.from_metadata(entry.meta, torch.empty(entry.nbytes, dtype=torch.uint8,
                                                                        device="meta"))
        return source

    @staticmethod
    def verify(source: BlockSource, reader: DiskReader) -> None:
        """The code was checked by ``prepare``: the checksum later reads are compared with is taken now."""
        take_checksum(source, reader)


@register_store
class CodedFileStore(FileStore):
    """A disk-backed block whose bytes are its lossless code in ``compression_cache_dir``: staged by the reader
    thread, copied to the device coded, decoded there into the block's buffers. Any ``source.coded`` with
    ``decode_into``, ``decoded`` and ``counters`` streams the same way (``dfloat11_file.DFloat11FileStore``)."""

    name = "disk (lossless)"
    priority = 110
    coded_type: ClassVar[type] = CodedBlock  # the ``source.coded`` this store claims

    @classmethod
    def claims(cls, weights: PackedWeights, context: StoreContext) -> bool:
        source = context.sources.get(id(weights))
        return source is not None and isinstance(source.coded, cls.coded_type)

    def take(self, journal: Journal) -> None:
        super().take(journal)
        code_ring(self.context).want(self.source.nbytes)

    def _queue(self, staged: Any, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for,
               done) -> None:
        # The code goes to the device on the copy stream, into the offload's code buffers (the staging buffer is
        # free once it is there), and is decoded there into the block's buffers.
        source = self.source
        upload_and_decode(source.coded, staged.buffer.narrow(0, 0, source.nbytes), buffers, transfers, wait_for, done,
                          code_ring(self.context))

    def _read_back(self) -> dict[torch.dtype, torch.Tensor]:
        return self.source.coded.decoded(self.context.reader.read_pageable(self.source)[torch.uint8])

    def counters(self) -> dict[str, int]:
        return self.source.coded.counters()
