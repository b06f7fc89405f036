"""The lossless code on disk (``compression_cache_dir``): each streamed block's code written once, read back by later
enables instead of coding again, and read coded at every load by the blocks a host budget keeps off the host. Under
a host budget only those blocks are written (``CodedCache.disk_only``): the others are held coded in host memory,
coded at enable (or read from the folder when an earlier enable wrote them), so an enable writes no more to disk
than the blocks it will read from there.

One safetensors file per block, named after the block's path, holding one uint8 tensor: the block's coded buffer
exactly as the lossless store keeps it in host memory (``coded_block.CodedBlock``). Its metadata holds the layout of
the parts, the code width per dtype, a SHA-256 of the block's weights (their layout and every byte: what the code
must decode to) and a SHA-256 of the coded bytes. An entry is used only when both match: the weights' digest is
taken from the model at every enable (per tensor, in threads: hashing releases the GIL), so a block whose weights
changed since (a fused LoRA, another model in the same folder) is coded again and its file replaced, with a warning;
a file whose bytes changed is refused the same way. One file per block path, written to a temporary name and
renamed: never a second copy beside a stale one, never a half-written file under the block's name. A folder serves
one model (point each model at its own).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .coded_block import PART_ALIGN, CodedBlock, code_block, coding_device
from .decode_kernel import GROUP
from .disk import read_pieces, safetensors_entries

logger = logging.getLogger("diffusers_omni")

FORMAT = "diffusers-omni lossless block"
# Bumped whenever the code's bytes or their layout change (a file of another version is coded again).
VERSION = "1"
TENSOR = "coded"
# What else fixes the code's bytes: a file written under other values is coded again.
CODE_LAYOUT = {"group": GROUP, "part_align": PART_ALIGN}
STALE_SECONDS = 3600  # a temporary file older than this is from a write that did not finish
_READ_CHUNK = 64 << 20  # bytes read (and hashed) at a time when loading an entry
_POOL_LOCK = threading.Lock()
_POOL: concurrent.futures.ThreadPoolExecutor | None = None


class CacheError(RuntimeError):
    """The cache folder cannot be used (not writable, a file in the way)."""


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 1),
                                                          thread_name_prefix="omni-digest")
        return _POOL


def _sha256(data: torch.Tensor) -> bytes:
    """SHA-256 of a contiguous 1-D uint8 host tensor's bytes."""
    return hashlib.sha256(memoryview(data.numpy())).digest() if data.numel() else hashlib.sha256().digest()


def _leaf_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8)


def tensor_digests(tensors: list[torch.Tensor]) -> list[bytes]:
    """SHA-256 of each tensor's bytes (hashed in threads): what ``load_dfloat11`` records and later checks."""
    return list(_pool().map(_sha256, [_leaf_bytes(tensor) for tensor in tensors]))


def weights_digest(weights: Any) -> str:
    """SHA-256 of a block's weights (a ``memory.PackedWeights``): the cache version, its path, each tensor's dtype,
    shape and place in the layout, and each tensor's bytes (hashed per tensor in threads, then combined)."""
    slots = weights.slots
    leaves = [_leaf_bytes(slot.flat_source()) for slot in slots]
    digests = list(_pool().map(_sha256, leaves))
    head = json.dumps([VERSION, weights.path, [[str(s.dtype), list(s.shape), s.offset] for s in slots],
                       {str(dtype): numel for dtype, numel in weights.numel.items()}]).encode()
    combined = hashlib.sha256(head)
    for digest in digests:
        combined.update(digest)
    return combined.hexdigest()


def _combine(chunk_digests: list[bytes]) -> str:
    """The coded bytes' digest: SHA-256 over the SHA-256 of each ``_READ_CHUNK`` of them (the chunks hash in
    parallel, as they are read)."""
    combined = hashlib.sha256(f"{VERSION}:{_READ_CHUNK}".encode())
    for digest in chunk_digests:
        combined.update(digest)
    return combined.hexdigest()


def _buffer_digest(buffer: torch.Tensor) -> str:
    """The digest of a coded buffer (``_combine``), its chunks hashed in threads."""
    chunks = [buffer.narrow(0, start, min(_READ_CHUNK, buffer.numel() - start))
              for start in range(0, buffer.numel(), _READ_CHUNK)]
    return _combine(list(_pool().map(_sha256, chunks)))


def _read_hashed(entry: "Entry", buffer: torch.Tensor, hashed: bool = True) -> str | None:
    """Read an entry's coded bytes into ``buffer`` (uint8, host, at least ``entry.nbytes``) and return their digest
    (``_combine``): each chunk is hashed in the pool while the next one is read (``hashed=False``: only read)."""
    futures = []
    with open(entry.file, "rb", buffering=0) as handle:
        fd = handle.fileno()
        for start in range(0, entry.nbytes, _READ_CHUNK):
            chunk = buffer.narrow(0, start, min(_READ_CHUNK, entry.nbytes - start))
            read_pieces(fd, entry.offset + start, [(chunk.data_ptr(), chunk.numel())])
            if hashed:
                futures.append(_pool().submit(_sha256, chunk))
    return _combine([future.result() for future in futures]) if hashed else None


def _identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, modification time) of a file: a file renamed over it or written since has another."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns


def _file_digest(entry: "Entry") -> str:
    """The digest of an entry's coded bytes as they are in its file (read into a fresh buffer, freed after)."""
    return _read_hashed(entry, torch.empty(entry.nbytes, dtype=torch.uint8))


@dataclass
class Entry:
    """A block's file in the cache, checked: where its coded bytes are and their layout."""

    file: Path
    offset: int  # of the coded bytes in the file
    nbytes: int
    meta: dict
    coded_sha256: str


class CodedCache:
    """The folder of one enable's ``compression_cache_dir``: counts what it read and wrote for the report."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CacheError(f"compression_cache_dir={str(self.folder)!r}: cannot create the folder "
                             f"({error.strerror}); allowed: a folder this process may write") from error
        if not os.access(self.folder, os.W_OK):
            raise CacheError(f"compression_cache_dir={str(self.folder)!r}: the folder is not writable; allowed: a "
                             "folder this process may write")
        self._remove_stale_temporaries()
        self.read_blocks = self.written_blocks = self.replaced_blocks = 0
        self.read_bytes = self.written_bytes = 0
        self._digests: dict[int, str] = {}  # id(PackedWeights) → weights_digest, taken once per enable
        # file → its identity when this enable hashed (or wrote) its coded bytes: read again unchanged, not rehashed
        self._checked: dict[Path, tuple[int, int, int] | None] = {}
        # Under a host budget: the blocks read from disk, the only ones whose code is written (``writes``)
        self.disk_only: set[str] | None = None
        self._warned: set[tuple[Path, str]] = set()  # (file, why) of the stale files already logged
        # Where this enable's time went (the report's line): hashing weights, reading files back to check them,
        # coding, writing files and waiting for those writes (``ensure_all`` hashes and writes beside the coding).
        self.seconds = dict.fromkeys(("hashing", "checking", "coding", "writing", "waiting for writes"), 0.0)

    def _remove_stale_temporaries(self) -> None:
        """Delete the temporary files of writes that never finished (a process killed while writing), once they are
        older than ``STALE_SECONDS`` (a write in progress in another process is younger: a block takes seconds)."""
        now = time.time()
        for path in self.folder.glob(".*.safetensors.*.tmp"):
            try:
                if now - path.stat().st_mtime > STALE_SECONDS:
                    path.unlink()
                    logger.info("compression_cache_dir: removed %s, left by a write that did not finish", path)
            except OSError:
                pass

    def digest(self, weights: Any) -> str:
        """``weights_digest`` of a block, taken once per enable."""
        found = self._digests.get(id(weights))
        if found is None:
            started = time.perf_counter()
            found = self._digests[id(weights)] = weights_digest(weights)
            self.seconds["hashing"] += time.perf_counter() - started
        return found

    def ensure_all(self, blocks: list[Any], device: torch.device,
                   progress: Callable[[int], Any] | None = None) -> list[Entry]:
        """Each block's entry, checked (its weights' digest, and every coded byte read back and hashed), or made
        now: coded (on ``device`` when it is an accelerator) and written. A block's weights are hashed in one
        thread while it is coded, and one writer thread writes its file while the next block is hashed and coded
        (at most one coded block waits for it), so the time is about the largest of the three rather than their
        sum. Nothing of a block stays in memory once written; on a failure the write in progress finishes (a whole
        file, or none) before the error is raised. ``progress(nbytes)`` is called with each block's bytes once it
        is checked or coded."""
        entries: list[Entry | None] = [None] * len(blocks)
        writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-cache-write")
        hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-cache-hash")
        pending: concurrent.futures.Future | None = None
        try:
            for index, weights in enumerate(blocks):
                entry = self._checked_entry(weights)
                if entry is None:
                    digest = hasher.submit(self.digest, weights)  # hashed on the host while the block is coded
                    started = time.perf_counter()
                    block = code_block(weights.current_flat(coding_device(device)), device,
                                       lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
                    self.seconds["coding"] += time.perf_counter() - started
                    if pending is not None:
                        self._wait(pending)
                    pending = writer.submit(self._write, entries, index, weights.path, digest.result(), block)
                    del block
                else:
                    entries[index] = entry
                if progress is not None:
                    progress(weights.nbytes)
            if pending is not None:
                self._wait(pending)
        finally:
            hasher.shutdown(wait=True)
            writer.shutdown(wait=True)
        return entries

    def entry_for(self, weights: Any) -> Entry | None:
        """The block's entry when its file holds the code of these weights (``lookup``), its bytes not read yet;
        with no file of the block, ``None`` without hashing its weights."""
        if not self.path_of(weights.path).exists():
            return None
        return self.lookup(weights.path, self.digest(weights))

    def _checked_entry(self, weights: Any) -> Entry | None:
        """The block's entry when its file holds the code of these weights and its bytes are the ones written."""
        entry = self.entry_for(weights)
        if entry is None:
            return None
        started = time.perf_counter()
        same = _file_digest(entry) == entry.coded_sha256
        self.seconds["checking"] += time.perf_counter() - started
        if same:
            self._checked[entry.file] = _identity(entry.file)
            return entry
        logger.warning("compression_cache_dir: %s: its coded bytes are not the ones written (the file was changed "
                       "or damaged); block %r is coded again and the file replaced", entry.file, weights.path)
        return None

    def _wait(self, pending: concurrent.futures.Future) -> None:
        started = time.perf_counter()
        pending.result()
        self.seconds["waiting for writes"] += time.perf_counter() - started

    def _write(self, entries: list[Entry | None], index: int, block: str, digest: str, coded: CodedBlock) -> None:
        started = time.perf_counter()
        entries[index] = self.store(block, digest, coded)
        self.seconds["writing"] += time.perf_counter() - started

    def writes(self, block: str) -> bool:
        """Whether a block coded into host memory has its code written here too: every block, unless a host budget
        limited the folder to the blocks it reads from disk (``disk_only``)."""
        return self.disk_only is None or block in self.disk_only

    def path_of(self, block: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9._-]", "_", block) + ".safetensors")

    def lookup(self, block: str, digest: str) -> Entry | None:
        """The block's entry when its file holds the code of weights with ``digest`` (``None``: no file, or one of
        other weights or another version: logged, the caller codes again and ``store`` replaces it)."""
        path = self.path_of(block)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
            entry = safetensors_entries(path)[TENSOR]
            info = json.loads(meta.get("omni", "{}"))
        except Exception as error:  # any unreadable file is replaced, saying why
            logger.warning("compression_cache_dir: %s cannot be read (%s): block %r is coded again and the file "
                           "replaced", path, error, block)
            return None
        why = None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            why = f"it is {meta.get('format', 'not a lossless block')!r} version {meta.get('version')!r}, not {VERSION!r}"
        elif info.get("code_layout") != CODE_LAYOUT:
            why = f"its code's layout is {info.get('code_layout')}, this version's is {CODE_LAYOUT}"
        elif info.get("block") != block:
            why = f"it holds block {info.get('block')!r}"
        elif info.get("weights_sha256") != digest:
            why = ("it was coded from other weights than the model's (the weights changed since, or another model "
                   "uses this folder: give each model its own)")
        if why:
            if (path, why) not in self._warned:  # a plan and the store that codes the block both look it up
                self._warned.add((path, why))
                logger.warning("compression_cache_dir: %s: %s; block %r is coded again and the file replaced", path,
                               why, block)
            return None
        return Entry(path, entry.offset, entry.nbytes, info, info.get("coded_sha256", ""))

    def read(self, entry: Entry, buffer: torch.Tensor, block: str) -> CodedBlock | None:
        """Read ``entry``'s coded bytes into ``buffer`` (uint8, host, ``entry.nbytes``) and check their digest; the
        block around them, or ``None`` when the bytes are not the ones written (logged: coded again)."""
        checked = self._checked.get(entry.file)
        unchanged = checked is not None and checked == _identity(entry.file)  # hashed by ``ensure`` this enable
        if _read_hashed(entry, buffer, hashed=not unchanged) != entry.coded_sha256 and not unchanged:
            logger.warning("compression_cache_dir: %s: its coded bytes are not the ones written (the file was "
                           "changed or damaged); block %r is coded again and the file replaced", entry.file, block)
            return None
        try:
            coded = CodedBlock.from_metadata(entry.meta, buffer)
        except (KeyError, TypeError, ValueError) as error:
            logger.warning("compression_cache_dir: %s: its layout cannot be used (%s); block %r is coded again and "
                           "the file replaced", entry.file, error, block)
            return None
        self.read_blocks += 1
        self.read_bytes += entry.nbytes
        return coded

    def store(self, block: str, digest: str, coded: CodedBlock) -> Entry:
        """Write ``coded`` as ``block``'s file (replacing any), by a rename of a fully written temporary file."""
        path = self.path_of(block)
        info = dict(coded.metadata(), block=block, weights_sha256=digest, coded_sha256=_buffer_digest(coded.buffer),
                    code_layout=CODE_LAYOUT)
        meta = {"format": FORMAT, "version": VERSION, "omni": json.dumps(info)}
        replaced = path.exists()
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.folder)
        os.close(handle)
        try:
            save_file({TENSOR: coded.buffer.detach()}, temporary, metadata=meta)
            os.replace(temporary, path)
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
        self.written_blocks += 1
        self.written_bytes += coded.nbytes
        self.replaced_blocks += int(replaced)
        entry = safetensors_entries(path)[TENSOR]
        self._checked[path] = _identity(path)  # its bytes are the ones just hashed and written
        return Entry(path, entry.offset, entry.nbytes, info, info["coded_sha256"])

    def counters(self) -> dict[str, int]:
        return {"cache blocks read": self.read_blocks, "cache bytes read": self.read_bytes,
                "cache blocks written": self.written_blocks, "cache bytes written": self.written_bytes,
                "cache files replaced": self.replaced_blocks}
