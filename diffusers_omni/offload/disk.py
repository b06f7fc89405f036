"""Disk-backed blocks: streamed blocks that keep no host copy and are read from their checkpoint at every load.

Under ``LayerwiseOffloadConfig(max_host_memory=...)`` the streamed blocks that do not fit in the host budget are
read, each time they load, straight from the safetensors files their component was loaded from:

- ``find_checkpoint``: the files of a component, from the folder Diffusers and Transformers record in
  ``module.config._name_or_path`` (a single ``*.safetensors`` file or the shards of a ``*.safetensors.index.json``),
  with the absolute byte range, dtype and shape of every tensor (headers only; nothing else is read);
- ``BlockSource``: where each tensor of one block is (file, byte offset, length) and where it goes in the block's
  flat layout (``PackedWeights``: one region per dtype, as the device buffers have it), grouped into runs that are
  contiguous in a file, so one ``os.preadv`` fills several tensors;
- ``verify_block``: every tensor of a block compared with its file (name, dtype, shape, then its bytes, in chunks)
  before the block loses its host copy; a model whose weights differ from its files is refused. ``FileViews`` tells
  the tensors that are untouched views of the file (mapped, no copied-on-write page): those are not read, and once
  packed their pages are given back to the kernel;
- ``DiskReader``: the open files; reads a block's runs into any host memory (``os.preadv`` releases the GIL);
- ``StagingRing``: a few block-sized page-locked buffers and one reader thread that fills them, in the order the
  blocks will load, as far ahead as free buffers allow. ``take`` hands a block's buffer over once its read is done
  (waiting for it if needed); ``release`` gives it back once the device copy from it is queued: the buffer's event is
  recorded on the copy stream, and the reader waits for that event before it reads into the buffer again. The ring
  also holds the buffers that blocks of alternating DiTs share (``host_plan``): such a buffer keeps the block last
  read into it, so that block loads again without a read until the other DiT's block takes the buffer.
"""

from __future__ import annotations

import bisect
import ctypes
import json
import logging
import os
import threading
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
import torch.nn as nn

from ..config.offload import format_bytes
from .loading import CheckpointError, checkpoint_files, read_safetensors_header
from .tensors import PLAIN_TENSOR_TYPES

logger = logging.getLogger("diffusers_omni")

# The most buffers one ``preadv`` call takes (Linux's IOV_MAX); a run with more tensors is read in several calls.
_IOV_MAX = 1024
# Verification reads a file through a buffer of this size.
_VERIFY_CHUNK = 64 << 20

# Every read of a disk-backed block is checked against a checksum taken when the offload was enabled (after the
# block's bytes were compared with the model's): a CRC-32 of sampled windows of each tensor, its first and last
# ``_SAMPLE_BYTES`` and one window every ``_SAMPLE_EVERY`` bytes between. A rewrite of a file (same size, same
# modification time put back) changes the sampled bytes and is refused, naming the block and the file; a change
# confined to bytes between the windows of one large tensor is not seen. The sampled share (1/16) keeps the check
# at a small fraction of the reader's time.
_SAMPLE_BYTES = 4 << 10
_SAMPLE_EVERY = 64 << 10

WAY_OUT = ("raise max_host_memory so this block keeps its host copy, or save the model with save_pretrained in the "
           "dtype it runs and load it from that folder")


class DiskReadError(RuntimeError):
    """A disk-backed block could not be read from its checkpoint while the offload ran."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its dtype and shape, and its bytes ``[offset, offset + nbytes)``."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def safetensors_entries(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Every tensor of one safetensors file with its absolute byte range. The file is validated by
    ``read_safetensors_header`` (safetensors checks that offsets are contiguous and sizes match shapes)."""
    path = Path(path)
    validated = read_safetensors_header(path)
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot read the safetensors header ({error})") from error
    start = 8 + length
    entries = {}
    for name, (dtype, shape) in validated.items():
        begin, end = header[name]["data_offsets"]
        entries[name] = TensorEntry(path, dtype, shape, start + begin, end - begin)
    return entries


@dataclass
class Checkpoint:
    """The safetensors files one component was loaded from. A name may be in several files (a folder holding a
    checkpoint in two dtypes, ``variant=``): each of its entries is kept, the one matching the model is used."""

    folder: Path
    files: list[Path]
    entries: dict[str, list[TensorEntry]]

    def lookup(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorEntry | None:
        """The entry of ``name`` with this dtype and shape, else its first entry (``None``: not in the files)."""
        found = self.entries.get(name)
        if not found:
            return None
        return next((e for e in found if e.dtype == dtype and e.shape == shape), found[0])


def find_checkpoint(module: nn.Module, attribute: str = "") -> tuple[Checkpoint | None, str]:
    """The checkpoint ``module`` was loaded from, or ``None`` and why not. The folder is ``config._name_or_path``
    (Diffusers and Transformers record it; a pipeline's component records its subfolder), or its ``attribute``
    subfolder (a model loaded with ``subfolder=``)."""
    config = getattr(module, "config", None)
    recorded = getattr(config, "_name_or_path", None)
    if not isinstance(recorded, (str, os.PathLike)) or not str(recorded):
        return None, "it was not loaded from local safetensors files (no config._name_or_path: built in memory?)"
    root = Path(recorded)
    if not root.is_dir():
        return None, (f"its config._name_or_path {str(recorded)!r} is not a local folder (a model loaded from the "
                      "hub by name; load the pipeline from a local folder or the hub's snapshot folder)")
    folders = [root] + ([root / attribute] if attribute and "." not in attribute and (root / attribute).is_dir()
                        else [])
    errors = []
    for folder in folders:
        try:
            files = checkpoint_files(folder)
        except CheckpointError as error:
            several = sorted(folder.glob("*.safetensors"))
            if len(several) < 2 or any(folder.glob("*.safetensors.index.json")):
                errors.append(str(error))
                continue
            files = several  # variants side by side: the entry matching the model is picked per tensor
        entries: dict[str, list[TensorEntry]] = {}
        for file in files:
            for name, entry in safetensors_entries(file).items():
                entries.setdefault(name, []).append(entry)
        return Checkpoint(folder, files, entries), ""
    return None, f"its folder {str(root)!r} holds no usable safetensors checkpoint ({'; '.join(errors)})"


def checkpoint_names(module: nn.Module) -> tuple[dict[int, list[str]], dict[int, str]]:
    """``({id(tensor): names}, {id(buffer): name})``: the names each parameter and persistent buffer of ``module``
    has in its checkpoint (every alias of a tied tensor), and the non-persistent buffers (never saved)."""
    names: dict[int, list[str]] = {}
    transient: dict[int, str] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, tensor in sub._parameters.items():
            if tensor is not None:
                names.setdefault(id(tensor), []).append(dot + key)
        for key, tensor in sub._buffers.items():
            if tensor is None:
                continue
            if key in sub._non_persistent_buffers_set:
                transient.setdefault(id(tensor), dot + key)
            else:
                names.setdefault(id(tensor), []).append(dot + key)
    return names, transient


@dataclass
class Piece:
    """One tensor of a block: ``length`` bytes at ``offset`` in file ``file`` (an index into the reader's files), to
    ``dest`` bytes into the block's flat layout; ``tensor`` is what the model holds (checked at enable)."""

    file: int
    offset: int
    dest: int
    length: int
    name: str
    tensor: torch.Tensor | None = field(default=None, repr=False)


class BlockSource:
    """Where one disk-backed block's bytes are: its pieces, grouped into ``runs`` (file, offset, pieces) contiguous
    in one file, and the layout they are read into (``regions``: byte offset and element count per dtype, in the
    order of the block's ``PackedWeights.numel``; ``nbytes`` in all, padding included). ``index`` (its position
    among the disk-backed blocks), ``next`` (the disk-backed blocks that load after it) and ``owner`` (the streamed
    block) are set by the offload; ``kept``: the few tensors no file holds as the model does (``view_source``),
    as host bytes copied into the layout after each read; ``staged`` is the staging buffer holding or reading it; ``home`` the buffer it
    shares with the blocks of the other alternating DiTs at its position (``None``: it goes through the ring)."""

    def __init__(self, label: str, component: str, numel: dict[torch.dtype, int], pieces: list[Piece],
                 kept: list[tuple[int, torch.Tensor]] | None = None) -> None:
        self.label = label
        # (dest, bytes): tensors that are in no file as the model holds them (a norm cast while loading), kept in
        # host memory and copied into the layout after each read
        self.kept = kept or []
        self.kept_bytes = sum(data.numel() for _, data in self.kept)
        self.component = component
        self.regions: dict[torch.dtype, tuple[int, int]] = {}
        offset = 0
        for dtype, count in numel.items():
            self.regions[dtype] = (offset, count)
            offset += count * dtype.itemsize
        self.nbytes = offset
        self.pieces = pieces
        self.read_bytes = sum(p.length for p in pieces)
        self.runs: list[tuple[int, int, list[tuple[int, int]]]] = []
        for piece in sorted((p for p in pieces if p.length), key=lambda p: (p.file, p.offset)):
            last = self.runs[-1] if self.runs else None
            if last is not None and last[0] == piece.file and last[1] + sum(n for _, n in last[2]) == piece.offset:
                last[2].append((piece.dest, piece.length))
            else:
                self.runs.append((piece.file, piece.offset, [(piece.dest, piece.length)]))
        self.index = 0
        self.next: tuple[BlockSource, ...] = ()
        self.staged: StagingBuffer | None = None
        self.home: StagingBuffer | None = None  # the buffer it shares with other alternating DiTs' blocks
        self.wanted = 0  # the staging ring's mark (``StagingRing._want``)
        self.owner: Any = None
        self.checksum: int | None = None  # of the sampled windows (``sample_checksum``), set once verified
        # coded_block.CodedBlock (its layout; ``None``: the bytes are the block's own): the bytes are the block's
        # lossless code, read from ``compression_cache_dir`` and decoded on the device (``stores.coded_file``)
        self.coded: Any = None

    def drop_tensors(self) -> None:
        """Forget the model's tensors (kept only to verify them)."""
        for piece in self.pieces:
            piece.tensor = None

    def views(self, flat: torch.Tensor) -> dict[torch.dtype, torch.Tensor]:
        """Per dtype, the region of ``flat`` (a 1-D uint8 tensor of at least ``nbytes``) it is read into."""
        return {dtype: flat.narrow(0, start, count * dtype.itemsize).view(dtype)
                for dtype, (start, count) in self.regions.items()}

    def __repr__(self) -> str:
        return f"BlockSource({self.label!r}, {format_bytes(self.read_bytes)} in {len(self.runs)} runs)"


def block_source(label: str, component: str, checkpoint: Checkpoint, files: list[Path], names: dict[int, list[str]],
                 slots: Iterable[Any], numel: dict[torch.dtype, int]) -> BlockSource:
    """The ``BlockSource`` of one block whose layout is ``slots`` (``memory.TensorSlot``s) and ``numel``. Each
    tensor is looked up by its names in ``checkpoint``; ``files`` is the reader's file list (extended here). Raises
    ``CheckpointError`` (naming the tensor, the file and the way out) for a tensor missing from the files or held
    there in another dtype or shape."""
    offsets = {}
    start = 0
    for dtype, count in numel.items():
        offsets[dtype] = start
        start += count * dtype.itemsize
    pieces = []
    for slot in slots:
        tensor = slot.tensor
        aliases = names.get(id(tensor), [])
        entry = next((e for e in (checkpoint.lookup(n, slot.dtype, tuple(slot.shape)) for n in aliases) if e), None)
        shown = aliases[0] if aliases else "<unnamed>"
        where = f"block {label!r} of {component!r}: tensor {shown!r}"
        if entry is None:
            raise CheckpointError(
                f"max_host_memory: {where} is not in the checkpoint {checkpoint.folder} "
                f"({', '.join(f.name for f in checkpoint.files)}): the model is not what its files hold (a LoRA "
                f"loaded into it, renamed or added weights); allowed: {WAY_OUT}"
            )
        name = next(n for n in aliases if n in checkpoint.entries)
        if entry.dtype != slot.dtype:
            raise CheckpointError(
                f"max_host_memory: {where} is {slot.dtype} in the model but {entry.dtype} in {entry.file} (loaded "
                f"with torch_dtype, or cast after loading); blocks are read from the files as they are, so the "
                f"model must run in the files' dtype; allowed: {WAY_OUT}"
            )
        if entry.shape != tuple(slot.shape):
            raise CheckpointError(
                f"max_host_memory: {where} has shape {list(slot.shape)} in the model but {list(entry.shape)} in "
                f"{entry.file}; allowed: {WAY_OUT}"
            )
        if slot.stride is not None:
            raise CheckpointError(f"max_host_memory: {where} is not contiguous in the model; allowed: {WAY_OUT}")
        if entry.file not in files:
            files.append(entry.file)
        dest = offsets[slot.dtype] + slot.offset * slot.dtype.itemsize
        pieces.append(Piece(files.index(entry.file), entry.offset, dest, entry.nbytes, name, slot.leaf.data()))
    return BlockSource(label, component, numel, pieces)


def view_source(label: str, component: str, views: FileViews, files: list[Path], slots: Iterable[Any],
                numel: dict[torch.dtype, int]) -> BlockSource | None:
    """The ``BlockSource`` of a block of quantized weights whose packed bytes are untouched views of a mapped file
    (``views.locate``): each such tensor (a wrapper's inner tensors included) is read back from where it is mapped
    from, whatever the file's format. Plain tensors that are not views (a norm or bias converted while loading:
    a small part of a block) keep a host copy (``BlockSource.kept``). ``None`` when a quantized tensor is not such
    a view or a tensor is not contiguous. ``files`` is extended as in ``block_source``."""
    offsets = {}
    start = 0
    for dtype, count in numel.items():
        offsets[dtype] = start
        start += count * dtype.itemsize
    pieces, kept = [], []
    for slot in slots:
        if slot.stride is not None:
            return None
        data = slot.leaf.data()
        dest = offsets[slot.dtype] + slot.offset * slot.dtype.itemsize
        found = views.locate(data)
        if found is None:
            if not plain_leaf(slot.leaf):
                return None
            kept.append((dest, data.detach().reshape(-1).view(torch.uint8).clone()))
            continue
        path, offset = found
        if path not in files:
            files.append(path)
        pieces.append(Piece(files.index(path), offset, dest, slot.numel * slot.dtype.itemsize, slot.leaf.name, data))
    return BlockSource(label, component, numel, pieces, kept)


def plain_leaf(leaf: Any) -> bool:
    """A leaf that is a plain tensor of its own (not a quantized subclass, nor a wrapper's inner tensor)."""
    return not leaf.inner and all(type(t) in PLAIN_TENSOR_TYPES for t in leaf.targets)


class DiskReader:
    """The checkpoint files of every disk-backed block, opened once. ``read`` fills a block's layout at a host
    address; each read checks first that no file changed since it was opened (size, modification time)."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self.fds: list[int] = []
        self._signatures: list[tuple[int, int, int]] = []
        self._file_maps: dict[int, torch.UntypedStorage] = {}  # file → its private mapping (``mapped_views``)
        try:
            for file in files:
                fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self.fds.append(fd)
                status = os.fstat(fd)
                self._signatures.append((status.st_ino, status.st_size, status.st_mtime_ns))
        except OSError as error:
            self.close()
            raise CheckpointError(f"max_host_memory: cannot open {error.filename}: {error.strerror}") from error
        self._finalizer = weakref.finalize(self, _close_all, list(self.fds))

    def close(self) -> None:
        fds, self.fds = self.fds, []
        self._file_maps = {}  # the views given back keep their mappings
        _close_all(fds)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()

    def read(self, source: BlockSource, address: int) -> None:
        """Read ``source``'s runs into host memory at ``address`` (``source.nbytes`` bytes of it). A file whose
        identity (inode, size, modification time) changed since it was opened is read all the same; the block's
        checksum decides whether its bytes are still the ones checked at enable (a file put back is accepted)."""
        if not self.fds:
            raise RuntimeError("the checkpoint files are closed (offload disabled)")
        changed = []
        for file, offset, pieces in source.runs:
            fd = self.fds[file]
            if file not in changed:
                status = os.fstat(fd)
                if (status.st_ino, status.st_size, status.st_mtime_ns) != self._signatures[file]:
                    changed.append(file)
            read_pieces(fd, offset, [(address + dest, length) for dest, length in pieces])
        if source.checksum is not None and sample_checksum(source, address) != source.checksum:
            files = ", ".join(sorted({str(self.files[f]) for f, _, _ in source.runs}))
            raise CheckpointError(
                f"block {source.label!r} of {source.component!r}: the bytes read from {files} are not the ones "
                "checked when the offload was enabled (the file was changed after enabling; its blocks are read from "
                "it at every load). Allowed: put the file's original bytes back (they are checked at every read), or "
                "disable the offload (it refuses while a block cannot be read back) and load the model again"
            )
        for dest, data in source.kept:
            ctypes.memmove(address + dest, data.data_ptr(), data.numel())

    def mapped_views(self, source: BlockSource, slots: list[Any]) -> list[torch.Tensor] | None:
        """``source``'s tensors as views of private (copy-on-write) mappings of its files, one per ``slots`` entry
        (``memory.TensorSlot``: dtype, offset, shape, strides), for giving a block back without its bytes in RAM:
        the pages are the page cache's, which the kernel reclaims under a memory cap (reading a model that does not
        fit into RAM on disable would have the process killed there). Tensors no file holds as the model does
        (``kept``) are copies of those bytes. The sampled checksum taken at enable is compared first, from the files
        (``pread``: a sixteenth of the bytes, into the page cache). ``None`` where a view cannot stand for the bytes
        checked at enable: a file changed since it was opened, by its signature or its sampled bytes (``read`` then
        checks the bytes and refuses), a tensor at an offset its dtype cannot start at, a block read coded
        (``compression_cache_dir``: decoded, as ``read_pageable`` gives it)."""
        if not self.fds:
            raise RuntimeError("the checkpoint files are closed (offload disabled)")
        if source.coded is not None:  # the files hold the block's code, not its bytes
            return None
        for file, _, _ in source.runs:
            status = os.fstat(self.fds[file])
            if (status.st_ino, status.st_size, status.st_mtime_ns) != self._signatures[file]:
                return None
        if source.checksum is not None and _file_checksum(source, self) != source.checksum:
            return None  # rewritten in place (its signature put back): ``read`` names the block and refuses
        pieces = {piece.dest: piece for piece in source.pieces if piece.length}
        kept = dict(source.kept)
        views = []
        for slot in slots:
            if slot.dtype not in source.regions:
                return None
            start = source.regions[slot.dtype][0] + slot.offset * slot.dtype.itemsize
            length = slot.numel * slot.dtype.itemsize
            piece = pieces.get(start)
            if piece is not None and piece.length == length and piece.offset % slot.dtype.itemsize == 0:
                storage = self._mapping(piece.file)
                view = torch.empty(0, dtype=slot.dtype).set_(storage, piece.offset // slot.dtype.itemsize,
                                                             slot.shape, slot.strides)
            elif start in kept and kept[start].numel() == length:
                view = kept[start].clone().view(slot.dtype).as_strided(slot.shape, slot.strides)
            elif length == 0:
                view = torch.empty(slot.shape, dtype=slot.dtype)
            else:
                return None
            views.append(view)
        return views

    def _mapping(self, file: int) -> torch.UntypedStorage:
        """A private mapping of the whole of file ``file`` (made once; pages are read as they are touched)."""
        if file not in self._file_maps:
            self._file_maps[file] = torch.UntypedStorage.from_file(str(self.files[file]), False,
                                                                   self._signatures[file][1])
        return self._file_maps[file]

    def read_pageable(self, source: BlockSource) -> dict[torch.dtype, torch.Tensor]:
        """``source``'s bytes in a fresh ordinary (pageable) host buffer: its per-dtype regions."""
        flat = torch.empty(source.nbytes, dtype=torch.uint8)
        self.read(source, flat.data_ptr())
        return source.views(flat)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def read_pieces(fd: int, offset: int, pieces: list[tuple[int, int]]) -> None:
    """Fill each ``(address, length)`` of ``pieces`` in order from the file's bytes starting at ``offset`` (one
    ``os.preadv`` per up to ``_IOV_MAX`` pieces, continued after a short read)."""
    pending = list(pieces)
    index = 0
    while index < len(pending):
        batch = [(ctypes.c_char * length).from_address(address) for address, length in pending[index:index + _IOV_MAX]]
        count = os.preadv(fd, batch, offset)
        if count <= 0:
            raise OSError(f"unexpected end of file at byte {offset}")
        offset += count
        while count:
            address, length = pending[index]
            if count >= length:
                count -= length
                index += 1
            else:
                pending[index] = (address + count, length - count)
                count = 0


class FileViews:
    """The private file mappings of this process that hold no copied-on-write page (``/proc/self/smaps``: the
    ``Anonymous`` count of the mapping is 0), read once: a plain host tensor inside one of them is a view of its
    file's bytes, as ``load_transformer_mmap`` makes them. ``offset_of`` says which file and byte offset; ``release``
    drops a packed tensor's pages from the process (``madvise(MADV_DONTNEED)``: clean file pages, which stay in the
    page cache and would be read again if touched), so the process does not hold both the file's pages and the
    packed copy. Where ``/proc`` or ``madvise`` is missing (not Linux) nothing is a view and nothing is released."""

    _MADV_DONTNEED = 4

    def __init__(self) -> None:
        self._maps: list[tuple[int, int, int, str, int]] = []  # (start, end, file offset of start, path, inode)
        try:
            text = Path("/proc/self/smaps").read_text()
        except OSError:
            return
        current = None
        for line in text.splitlines():
            fields = line.split()
            if not fields:
                continue
            if "-" in fields[0] and len(fields) >= 6 and len(fields[1]) == 4:  # a mapping's header line
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inode = int(fields[4])
                current = (start, end, int(fields[2], 16), " ".join(fields[5:]), inode) if inode else None
            elif fields[0] == "Anonymous:" and current is not None:
                if int(fields[1]) == 0:
                    self._maps.append(current)
                current = None
        self._maps.sort()
        self._starts = [mapping[0] for mapping in self._maps]
        self._libc = None
        self._identities: dict[tuple[Path, ...], list[tuple[str, int] | None]] = {}
        self._inodes: dict[str, int | None] = {}  # mapped path → the inode the path names now (``locate``)

    def _find(self, address: int, nbytes: int) -> tuple[int, int, int, str, int] | None:
        index = bisect.bisect_right(self._starts, address) - 1
        if index >= 0 and address + nbytes <= self._maps[index][1]:
            return self._maps[index]
        return None

    def _identity(self, files: list[Path]) -> list[tuple[str, int] | None]:
        """(resolved path, inode) of each file, once per list of files."""
        key = tuple(files)
        if key not in self._identities:
            found: list[tuple[str, int] | None] = []
            for file in files:
                try:
                    found.append((str(Path(file).resolve()), os.stat(file).st_ino))
                except OSError:
                    found.append(None)
            self._identities[key] = found
        return self._identities[key]

    @staticmethod
    def _plain(tensor: torch.Tensor) -> bool:
        return type(tensor) in PLAIN_TENSOR_TYPES and tensor.device.type == "cpu"

    def _view(self, tensor: torch.Tensor) -> tuple[str, int, int] | None:
        """``(mapped path, its inode, byte offset in the file)`` of a plain contiguous host tensor inside an
        untouched mapping, else ``None``."""
        if not self._maps or not self._plain(tensor) or not tensor.is_contiguous():
            return None
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        mapping = self._find(address, nbytes)
        if mapping is None:
            return None
        start, _, offset, path, inode = mapping
        return path, inode, offset + address - start

    def offset_of(self, tensor: torch.Tensor, files: list[Path]) -> tuple[int, int] | None:
        """``(index into files, byte offset)`` where ``tensor``'s bytes are, if it is an untouched view of one of
        ``files`` (same path and inode), else ``None``."""
        view = self._view(tensor)
        if view is None:
            return None
        path, inode, offset = view
        for index, identity in enumerate(self._identity(files)):
            if identity == (path, inode):
                return index, offset
        return None

    def locate(self, tensor: torch.Tensor) -> tuple[Path, int] | None:
        """``(file, byte offset)`` of a plain contiguous host tensor that is an untouched view of a file's bytes
        (the file still the one mapped: same inode), else ``None``. Quantized weights loaded from a mapped
        checkpoint (torchao's inner tensors from a ``torch.load(mmap=True)`` of a Diffusers ``.bin``) are such
        views: their bytes can be read back from that file whatever its format."""
        view = self._view(tensor)
        if view is None:
            return None
        path, inode, offset = view
        if path not in self._inodes:  # stat once per file, not once per tensor
            try:
                self._inodes[path] = os.stat(path).st_ino
            except OSError:
                self._inodes[path] = None
        return (Path(path), offset) if self._inodes[path] == inode else None

    def release(self, tensors: Iterable[torch.Tensor]) -> int:
        """Drop the whole pages of each untouched file view among ``tensors`` from the process; the bytes
        released."""
        if not self._maps:
            return 0
        if self._libc is None:
            try:
                self._libc = ctypes.CDLL(None, use_errno=True)
                self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            except (OSError, AttributeError):
                self._maps = []
                return 0
        page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        released = 0
        for tensor in tensors:
            if not self._plain(tensor):
                continue
            address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            if self._find(address, nbytes) is None:
                continue
            first = -(-address // page) * page
            last = (address + nbytes) // page * page
            if last > first and self._libc.madvise(first, last - first, self._MADV_DONTNEED) == 0:
                released += last - first
        return released


def _windows(length: int) -> list[tuple[int, int]]:
    """``(start, size)`` of the sampled windows of a tensor of ``length`` bytes."""
    if length <= 2 * _SAMPLE_BYTES:
        return [(0, length)] if length else []
    windows = [(start, _SAMPLE_BYTES) for start in range(0, length - _SAMPLE_BYTES, _SAMPLE_EVERY)]
    windows.append((length - _SAMPLE_BYTES, _SAMPLE_BYTES))
    return windows


def sample_checksum(source: BlockSource, address: int) -> int:
    """CRC-32 of the sampled windows of every piece of ``source``, in layout order, as laid out at ``address``."""
    crc = 0
    for piece in sorted(source.pieces, key=lambda p: p.dest):
        for start, size in _windows(piece.length):
            crc = zlib.crc32((ctypes.c_char * size).from_address(address + piece.dest + start), crc)
    return crc


def _file_checksum(source: BlockSource, reader: DiskReader) -> int:
    """``sample_checksum`` of ``source``'s bytes in its files (read with ``pread``: the windows of a model's tensors
    that are views of the very files are not touched, so no mapped page of theirs is faulted in)."""
    crc = 0
    for piece in sorted(source.pieces, key=lambda p: p.dest):
        for start, size in _windows(piece.length):
            crc = zlib.crc32(os.pread(reader.fds[piece.file], size, piece.offset + start), crc)
    return crc


def take_checksum(source: BlockSource, reader: DiskReader) -> None:
    """Set ``source.checksum`` from its files' bytes, already known to be right (a cache entry just checked):
    every later read is compared with it."""
    source.checksum = _file_checksum(source, reader)
    source.drop_tensors()


def verify_block(source: BlockSource, reader: DiskReader, views: FileViews | None = None) -> int:
    """Compare every tensor of ``source`` with its bytes in the files, in chunks; raises ``CheckpointError`` naming
    the block, the tensor, the file and the way out at the first difference. A tensor that ``views`` shows is an
    untouched view of the very bytes it would be compared with (a model loaded with ``load_transformer_mmap``) is
    not read: it is those bytes. The model's tensors are then forgotten by ``source``. Returns the bytes compared."""
    chunk = torch.empty(min(_VERIFY_CHUNK, max((p.length for p in source.pieces), default=0)) or 1, dtype=torch.uint8)
    compared = 0
    for piece in source.pieces:
        if views is not None and views.offset_of(piece.tensor, reader.files) == (piece.file, piece.offset):
            continue
        compared += piece.length
        data = piece.tensor.detach().reshape(-1).view(torch.uint8)
        done = 0
        while done < piece.length:
            size = min(chunk.numel(), piece.length - done)
            read_pieces(reader.fds[piece.file], piece.offset + done, [(chunk.data_ptr(), size)])
            mine = data[done:done + size]
            if mine.device.type != "cpu":
                mine = mine.cpu()
            if not torch.equal(mine, chunk[:size]):
                raise CheckpointError(
                    f"max_host_memory: block {source.label!r} of {source.component!r}: tensor {piece.name!r} holds "
                    f"other values than in {reader.files[piece.file]} (a fused LoRA, or weights changed after "
                    f"loading); blocks are read from the files at every load, so they must be exactly the files'; "
                    f"allowed: {WAY_OUT}"
                )
            done += size
    source.checksum = _file_checksum(source, reader)  # the files' bytes, just compared with the model's
    source.drop_tensors()
    return compared


# Staging ring ---------------------------------------------------------------------------------------------------

EMPTY, QUEUED, READING, READY, FAILED, IN_USE = "empty", "queued", "reading", "ready", "failed", "in use"


class StagingBuffer:
    """One page-locked buffer of the ring: its state, the block it holds (or is reading), and the event recorded
    after the last device copy from it (the reader waits for it before reading into the buffer again). ``pairs``
    caches, per block (``BlockSource.index``), the offload's copy pairs from this buffer (made on first use)."""

    def __init__(self, index: int, buffer: torch.Tensor, event: Any, sources: int, shared: bool = False) -> None:
        self.index = index
        self.shared = shared  # a shared buffer: keeps its block after the copy (read again only for another one)
        self.kept = False  # a shared buffer holding a block it handed over before (loading it again reads nothing)
        self.buffer = buffer
        self.pairs: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * sources
        self.address = buffer.data_ptr()
        self.event = event
        self.pending = False  # a device copy from it may still run (its event was recorded since the last wait)
        self.state = EMPTY
        self.source: BlockSource | None = None
        self.error: BaseException | None = None
        self.retried = False  # a failed read is read once more when its block is taken


class StagingRing:
    """Block-sized page-locked buffers filled by one reader thread, in the order blocks load.

    ``want(sources)`` says which blocks load next: buffers holding other blocks (not being read, not handed over)
    are reused for them, in that order, as far as buffers are free. ``take(source)`` returns the buffer holding
    ``source`` once read (requesting it first if it was not), counting waits; ``release(buffer, record)`` gives it
    back after the device copy from it is queued (``record(event)`` records the buffer's event on the copy
    stream). ``is_loaded(source)``: the block is on the device already (never requested again before it leaves).
    ``close`` stops and joins the thread and drops the buffers (the ring's views of them included), so the pages
    are freed (and unpinned) as soon as the ring is, also when the offload is garbage collected. ``sources`` is
    the number of disk-backed blocks (``BlockSource.index`` < it); ``ahead`` how many of the blocks that load
    next are read ahead at most. Counters go to ``stats`` (``disk_reads``, ``disk_read_bytes``,
    ``disk_read_seconds``, ``disk_waits``, ``disk_wait_seconds``, ``shared_hits``).

    ``shared``: (buffer, event, blocks) per buffer that blocks of alternating DiTs share (``BlockSource.home``):
    such a buffer keeps the block last read into it, so loading that block again reads nothing; wanting another
    of its blocks reads that one into it (once the device copies from it are done), in load order like the ring's.
    """

    def __init__(self, reader: DiskReader, buffers: list[torch.Tensor], events: list[Any], stats: Any,
                 device: torch.device, is_loaded: Callable[[BlockSource], bool], sources: int, ahead: int,
                 shared: Iterable[tuple[torch.Tensor, Any, list[BlockSource]]] = ()) -> None:
        self.reader = reader
        self.slots = [StagingBuffer(i, b, e, sources) for i, (b, e) in enumerate(zip(buffers, events))]
        self.ahead = ahead
        self.homes = []
        for buffer, event, members in shared:
            home = StagingBuffer(len(self.slots) + len(self.homes), buffer, event, sources, shared=True)
            for source in members:
                source.home = home
            self.homes.append(home)
        self.stats = stats
        self.device = device
        self.is_loaded = is_loaded
        # Re-entrant: a finaliser (``close``) may run in a thread that holds it.
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[StagingBuffer] = deque()
        self._closing = False
        self._generation = 0
        self._thread = threading.Thread(target=self._run, name=f"diffusers-omni disk reader {id(self):#x}",
                                        daemon=True)
        self._thread.start()

    # Main thread ------------------------------------------------------------------------------------------

    def want(self, sources: tuple[BlockSource, ...]) -> None:
        with self._cond:
            self._want(sources)

    def _want(self, sources: tuple[BlockSource, ...]) -> None:
        # The first ``ahead`` of ``sources`` not on the device are marked with this call's generation (no list is
        # built: this runs at every load); ring buffers holding unmarked blocks are reused, in ``sources`` order.
        self._generation += 1
        generation, count = self._generation, 0
        for source in sources:
            if count == self.ahead:
                break
            if source.staged is not None or not self.is_loaded(source):
                source.wanted = generation
                count += 1
        for slot in self.slots:
            if slot.state in (QUEUED, READY, FAILED) and slot.source.wanted != generation:
                self._clear(slot)
        queued = False
        for source in sources:
            if source.wanted != generation:
                continue
            if source.home is not None:
                queued = self._want_home(source) or queued
                continue
            if source.staged is not None:
                continue
            slot = self._empty()
            if slot is None:
                break
            slot.source, slot.state = source, QUEUED
            source.staged = slot
            self._queue.append(slot)
            queued = True
        if queued:
            self._cond.notify_all()

    def _want_home(self, source: BlockSource) -> bool:
        """Read ``source`` into its shared buffer unless that holds it (or reads it) already; a buffer reading or
        handing over another block is left alone (``take`` asks again once it is free). Whether a read was
        queued."""
        home = source.home
        if home.source is source or home.state in (READING, IN_USE):
            return False
        if home.state == QUEUED:
            self._queue.remove(home)
        if home.source is not None and home.source.staged is home:
            home.source.staged = None
        home.source, home.state, home.error, home.retried, home.kept = source, QUEUED, None, False, False
        source.staged = home
        self._queue.append(home)
        return True

    def _empty(self) -> StagingBuffer | None:
        for slot in self.slots:
            if slot.state == EMPTY:
                return slot
        return None

    def _clear(self, slot: StagingBuffer) -> None:
        if slot.state == QUEUED:
            self._queue.remove(slot)
        if slot.source is not None and slot.source.staged is slot:
            slot.source.staged = None
        slot.source, slot.state, slot.error, slot.retried, slot.kept = None, EMPTY, None, False, False

    def take(self, source: BlockSource) -> StagingBuffer:
        """The buffer holding ``source``, read; raises ``DiskReadError`` (naming the block) if its read failed
        twice (a read that failed is read once more when its block is taken)."""
        with self._cond:
            self._check_open()
            if source.staged is None:
                self._want((source,) + source.next)
                while source.staged is None:  # every buffer is being read for other blocks: the first one done
                    self._wait()
                    self._want((source,) + source.next)
            slot = source.staged
            if slot.kept:
                self.stats.shared_hits += 1
            start = None
            while True:
                if slot.state in (QUEUED, READING):
                    if start is None:
                        start = perf_counter()
                        self.stats.disk_waits += 1
                    self._wait()
                elif slot.state == FAILED and not slot.retried:  # e.g. read ahead before a transient error ended
                    slot.retried, slot.state, slot.error = True, QUEUED, None
                    self._queue.appendleft(slot)
                    self._cond.notify_all()
                else:
                    break
            if start is not None:
                self.stats.disk_wait_seconds += perf_counter() - start
            if slot.state == FAILED:
                error = slot.error
                self._clear(slot)
                files = sorted({self.reader.files[f].name for f, _, _ in source.runs})
                raise DiskReadError(
                    f"layerwise offload: reading block {source.label!r} of {source.component!r} from "
                    f"{', '.join(files)} failed ({type(error).__name__}: {error})"
                ) from error
            slot.state = IN_USE
            return slot

    def release(self, slot: StagingBuffer, record: Callable[[Any], None] | None = None) -> None:
        """Give ``slot`` back once the device copy from it is queued; the reads of the blocks after its own are
        requested."""
        with self._cond:
            if slot.event is not None and record is not None:
                record(slot.event)
                slot.pending = True
            source = slot.source
            if slot.shared:
                slot.state, slot.kept = READY, True  # it keeps its block: the next load of it reads nothing
            else:
                self._clear(slot)
            if source is not None and not self._closing:
                self._want(source.next)

    def _wait(self) -> None:
        self._cond.wait(timeout=1.0)
        self._check_open()
        if not self._thread.is_alive():
            raise DiskReadError("layerwise offload: the disk reader thread is gone")

    def _check_open(self) -> None:
        if self._closing:
            raise DiskReadError("layerwise offload: the disk reader was stopped (offload disabled)")

    def close(self) -> None:
        """Stop the reader thread and wait for it (a read in progress completes first)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
            if self._thread.is_alive():
                logger.warning("layerwise offload: the disk reader thread did not stop within 60 s")
        if self._thread.is_alive():
            return  # still reading into a buffer: the buffers stay until it is done
        for slot in self.slots + self.homes:
            self._clear(slot)
            slot.pairs = []
            slot.buffer = None
        self._queue.clear()

    # Reader thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the events are this device's
        cond = self._cond
        while True:
            with cond:
                while not self._closing and not self._queue:
                    cond.wait()
                if self._closing:
                    return
                slot = self._queue.popleft()
                slot.state = READING
                source = slot.source
            error = None
            try:
                if slot.pending:
                    slot.event.synchronize()  # the last device copy from this buffer is done
                    slot.pending = False
                start = perf_counter()
                self.reader.read(source, slot.address)
                elapsed = perf_counter() - start
            except BaseException as caught:  # noqa: BLE001 - handed to the thread that takes the block
                error = caught
            with cond:
                if error is None:
                    slot.state = READY
                    self.stats.disk_reads += 1
                    self.stats.disk_read_bytes += source.read_bytes
                    self.stats.disk_read_seconds += elapsed
                else:
                    slot.state, slot.error = FAILED, error
                cond.notify_all()
