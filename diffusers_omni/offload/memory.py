"""Host copies of weights packed into flat buffers, and the streams/events that move them.

A ``PackedWeights`` holds every parameter and buffer of a module in one contiguous host buffer per dtype. The
tensors keep their identity; only their ``.data`` is rebound (to host views, device views or empty placeholders).
Quantized tensor subclasses stream their packed storage: see :mod:`.tensors`.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn

from .tensors import Leaf, TensorSet

logger = logging.getLogger("diffusers_omni")

# Offsets inside flat buffers are multiples of this, so views are as aligned as fresh allocations (CPU kernels
# may round differently on misaligned data; CUDA allocations are 512-byte aligned).
ALIGN_BYTES = 512
_PAGE = 4096


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


# With ``keep_residues``, a host tensor keeps its address modulo this in the flat buffers (whose bases are aligned to
# it): a model computing on the CPU then computes on views as aligned as its own tensors, so vectorised kernels take
# the same paths and round alike. Loaders hand out tensors at any 8-byte boundary (safetensors 0.8 views of one
# read buffer, say); a copy at a fresh alignment can round differently in the last bit.
RESIDUE_BYTES = 64


def _with_residue(offset: int, leaf: Leaf) -> int:
    """The first offset (in elements) at or after ``offset`` whose address keeps ``leaf``'s own residue modulo
    ``RESIDUE_BYTES``; ``offset`` when the leaf is not on the CPU or its residue is not a whole element."""
    data = leaf.data()
    if data.device.type != "cpu":
        return offset
    size = leaf.dtype.itemsize
    residue = data.data_ptr() % RESIDUE_BYTES
    if residue % size:
        return offset
    return offset + ((residue - offset * size) % RESIDUE_BYTES) // size


def _aligned(numel: int, dtype: torch.dtype) -> int:
    step = max(ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size(), 1)
    return (numel + step - 1) // step * step


@dataclass
class TensorSlot:
    """Where one leaf (a plain tensor holding a weight's bytes, see ``tensors.Leaf``) lives in its dtype's buffer."""

    tensor: torch.Tensor
    dtype: torch.dtype
    offset: int
    shape: torch.Size
    original_device: torch.device
    stride: tuple[int, ...] | None = None  # a permuted dense layout kept as is; None: contiguous
    leaf: Leaf | None = None

    def __post_init__(self) -> None:
        self.strides = self.stride if self.stride is not None else _contiguous_strides(self.shape)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def flat_source(self) -> torch.Tensor:
        """The leaf's current bytes in buffer order, 1-D."""
        return self.leaf.flat()


class PackedWeights:
    """The layout of a module's tensors in flat per-dtype buffers, and its host copy once ``pack`` has run.

    Tensor subclasses are reduced to the plain tensors holding their bytes (``tensors.TensorSet``): quantized
    weights stream their packed storage. ``bind`` makes the module compute on given views (wrapper subclasses are
    rebuilt around them); ``park`` rebinds to views that are only held (host copies, placeholders), with wrapper
    subclasses back to their original objects. Raises ``UnsupportedTensorError`` for weights that cannot stream.
    """

    def __init__(self, path: str, module: nn.Module, select: set[int] | None = None, label: str | None = None,
                 keep_residues: bool = False) -> None:
        """``path`` names the unit; ``module``'s tensors (those in ``select``, when given) are its weights, named
        under ``label`` (default ``path``) in errors. ``keep_residues``: each host tensor keeps its address modulo
        ``RESIDUE_BYTES`` in the buffers (an offload that computes on the CPU: bitwise the model's own results)."""
        self.path = path
        self.tensors = TensorSet(module, path if label is None else label, select)
        self.slots: list[TensorSlot] = []
        self.numel: dict[torch.dtype, int] = {}
        for leaf in self.tensors.leaves:
            offset = self.numel.get(leaf.dtype, 0)
            if keep_residues:
                offset = _with_residue(offset, leaf)
            self.slots.append(
                TensorSlot(leaf.targets[0], leaf.dtype, offset, leaf.shape, leaf.device, leaf.stride, leaf)
            )
            self.numel[leaf.dtype] = offset + _aligned(leaf.shape.numel(), leaf.dtype)
        # (dtype, shape, strides, offset) per slot: ``views_into`` makes each view with one ``as_strided`` (a third
        # of ``narrow`` + ``view`` on the host, which adds up at ~3,500 leaves per bitsandbytes FLUX step).
        self._layout = [(s.dtype, s.shape, s.strides, s.offset) for s in self.slots]
        self.host: dict[torch.dtype, torch.Tensor] = {}
        self.host_views: list[torch.Tensor] = []
        # How many slots (in order) ``pack`` has rebound to host views: what ``restore`` undoes, also after a
        # ``pack`` that failed part-way.
        self.rebound = 0

    @property
    def nbytes(self) -> int:
        return sum(n * torch.empty(0, dtype=d).element_size() for d, n in self.numel.items())

    @property
    def empty(self) -> bool:
        return not self.slots

    def views_into(self, buffers: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Views of ``buffers`` (one flat tensor per dtype, at least as long as this layout) shaped like each
        leaf, in ``slots`` order."""
        bases = {dtype: (buffer.as_strided, buffer.storage_offset()) for dtype, buffer in buffers.items()}
        views = []
        for dtype, shape, strides, offset in self._layout:
            as_strided, base = bases[dtype]
            views.append(as_strided(shape, strides, base + offset))
        return views

    def current_flat(self, device: torch.device | None = None) -> dict[torch.dtype, torch.Tensor]:
        """The tensors' current bytes in this layout: fresh buffers, one per dtype (padding zeroed), ordinary host
        memory or on ``device`` (each tensor copied straight there: no host-side copy of the block first)."""
        flat = {dtype: torch.zeros(numel, dtype=dtype, device=device) for dtype, numel in self.numel.items()}
        for slot, view in zip(self.slots, self.views_into(flat)):
            view.copy_(slot.leaf.data())
        return flat

    def device_buffers(self, device: torch.device, numel: dict[torch.dtype, int] | None = None,
                       ) -> tuple[dict[torch.dtype, torch.Tensor], list[torch.Tensor]]:
        """New (uninitialised) flat buffers on ``device``, one per dtype (``numel`` elements each, by default the
        layout's), and the views of every tensor in them."""
        sizes = self.numel if numel is None else numel
        buffers = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        return buffers, self.views_into(buffers)

    def pack(self, host_memory: "HostMemory", release: Callable[[list[torch.Tensor]], Any] | None = None) -> None:
        """Copy every tensor into fresh host buffers and rebind it to its host view, tensor by tensor, so the
        original storage can be freed as we go (no second full copy). Callers record ``restore`` as the undo
        *before* calling this: if it fails part-way, ``restore`` puts back exactly the tensors already rebound.

        Tensors on an accelerator are copied into buffers page-locked beforehand, asynchronously, with one wait per
        module: into pageable memory every copy is staged by the driver (about 1 GB/s for a FLUX-size quantized
        model on an H200, against tens of GB/s by DMA). Host tensors are copied first and page-locked after
        (a memcpy faults the pages in, and registering touched pages is faster). ``release`` is given the
        original host tensors once they are copied (``disk.FileViews.release`` drops the pages of those that are
        views of a checkpoint file)."""
        self.rebound = 0
        self.host = {dtype: host_memory.allocate(numel, dtype) for dtype, numel in self.numel.items()}
        self.host_views = self.views_into(self.host)
        sources = [slot.leaf.data() for slot in self.slots]
        devices = {source.device for source in sources if source.device.type not in ("cpu", "meta")}
        direct = bool(devices) and host_memory.page_locked
        if direct:
            for buffer in self.host.values():
                host_memory.pin(buffer)
        for slot, view, source in zip(self.slots, self.host_views, sources):
            view.copy_(source, non_blocking=direct)
            with torch._C.DisableTorchFunctionSubclass():
                for target in slot.leaf.targets:
                    target.data = view
            self.rebound += 1
        if direct:  # ``sources`` keeps the device memory alive until the copies are done
            for device in devices:
                torch.get_device_module(device).current_stream(device).synchronize()
        if release is not None:
            release(sources)
        del sources
        self.tensors.park(self.host_views)
        if not direct:
            for buffer in self.host.values():
                host_memory.pin(buffer)

    def bind(self, views: list[torch.Tensor]) -> None:
        """Compute on ``views`` (device views): tensors are rebound, wrapper subclasses rebuilt around them."""
        self.tensors.bind(views)

    def park(self, views: list[torch.Tensor], final: bool = False) -> None:
        """Hold ``views`` (host views, placeholders): tensors are rebound, wrapper subclasses are their original
        objects (see ``TensorSet.park`` for ``final``)."""
        self.tensors.park(views, final)

    def undo_pack(self, clone: bool) -> None:
        """The rollback of ``pack`` when enabling fails: every tensor ``pack`` rebound goes back to its original
        device (``restore``). A unit whose ``pack`` never rebound a tensor (its host allocation failed, say) still
        holds its own data and is left alone."""
        if self.rebound == 0:
            self.host = {}
            self.host_views = []
            return
        logger.info("offload: rolling back %s: %d of %d tensors had been packed; they are back where they were",
                    self.path, self.rebound, len(self.slots))
        self.restore(clone=clone, to_original_device=True)

    def restore(self, clone: bool, to_original_device: bool) -> None:
        """Rebind every tensor to its host view (a private copy of it with ``clone``); with ``to_original_device``
        move it back to the device it had before packing."""
        if self.rebound == 0:  # nothing was packed (or it was restored already): the tensors hold their own data
            self.host = {}
            self.host_views = []
            return
        views = []
        current = self.tensors.current()
        for index, (slot, view) in enumerate(zip(self.slots, self.host_views)):
            if index >= self.rebound:  # ``pack`` failed before this leaf: it still holds its own data
                views.append(current[index])
                continue
            if to_original_device and slot.original_device.type != "cpu":
                views.append(view.to(slot.original_device))
            else:
                views.append(view.clone() if clone else view)
        self.tensors.park(views, final=not to_original_device)
        self.host = {}
        self.host_views = []
        self.rebound = 0


class HostPinner(Protocol):
    """Page-locks host memory ranges for an accelerator: the CUDA runtime's ``cudaHostRegister`` /
    ``cudaHostUnregister``. ``register`` raises when the runtime refuses (a range already registered, say)."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...

    def synchronize(self) -> None:
        """Wait for every copy that may still read a registered range (called before unregistering)."""


class CudaHostPinner:
    """``HostPinner`` on the CUDA runtime of ``device``."""

    def __init__(self, cudart: Any, device: torch.device) -> None:
        self._cudart = cudart
        self.device = device

    def register(self, ptr: int, nbytes: int) -> None:
        result = self._cudart.cudaHostRegister(ptr, nbytes, 0)
        if not _cuda_ok(result):
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed: {result}")

    def unregister(self, ptr: int) -> None:
        result = self._cudart.cudaHostUnregister(ptr)
        if not _cuda_ok(result):
            raise RuntimeError(f"cudaHostUnregister at {ptr:#x} failed: {result}")

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def host_pinner(device: torch.device) -> HostPinner | None:
    """The pinner that registers host buffers for ``device``, or ``None`` (not CUDA, or a torch build without
    ``cudaHostRegister``: torch's pinned allocator is used instead)."""
    if device.type != "cuda":
        return None
    try:
        cudart = torch.cuda.cudart()
    except Exception as error:  # noqa: BLE001 - any failure means "use the pinned allocator"
        logger.info("offload: cudart unavailable (%s); using torch's pinned allocator", error)
        return None
    if not (hasattr(cudart, "cudaHostRegister") and hasattr(cudart, "cudaHostUnregister")):
        logger.info("offload: this torch build exposes no cudaHostRegister; using torch's pinned allocator")
        return None
    return CudaHostPinner(cudart, device)


# Every live registration in the process, so interpreter exit can unregister what garbage collection left.
_LIVE_PAGES: "weakref.WeakSet[_Pages]" = weakref.WeakSet()
_registered_bytes = 0


def registered_host_bytes() -> int:
    """Bytes of host memory this process has registered for offload and not yet unregistered."""
    return _registered_bytes


class _Pages(mmap.mmap):
    """Anonymous page-aligned host memory that owns its registration.

    Tensors made with ``torch.frombuffer`` keep this object alive; when the last of them dies (``disable``,
    garbage collection of a dropped model, or interpreter exit) the registration ends *before* the pages are
    unmapped: ``__del__`` runs ahead of ``mmap``'s own deallocation, which unmaps.
    """

    pinner: HostPinner | None
    nbytes: int

    @property
    def address(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self))

    def register(self, pinner: HostPinner) -> None:
        global _registered_bytes
        address = self.address  # the exported ctypes view is released before the call returns
        pinner.register(address, len(self))
        self.pinner, self.registered_at = pinner, address
        _registered_bytes += len(self)
        _LIVE_PAGES.add(self)

    @property
    def is_registered(self) -> bool:
        return getattr(self, "pinner", None) is not None

    def unregister(self, synchronize: bool = True) -> None:
        global _registered_bytes
        pinner = getattr(self, "pinner", None)
        if pinner is None:
            return
        self.pinner = None
        _registered_bytes -= len(self)
        _LIVE_PAGES.discard(self)
        if synchronize:
            pinner.synchronize()
        pinner.unregister(self.registered_at)

    def __del__(self) -> None:
        try:
            self.unregister()
        except Exception as error:  # noqa: BLE001 - a finaliser must not raise; the pages are unmapped next
            logger.warning("offload: unregistering host memory on release failed (%s)", error)


@atexit.register
def _unregister_at_exit() -> None:
    for pages in list(_LIVE_PAGES):
        try:
            pages.unregister()
        except Exception as error:  # noqa: BLE001 - best effort at exit
            logger.warning("offload: unregistering host memory at exit failed (%s)", error)


class HostMemory:
    """Allocates the flat host buffers and page-locks them.

    On CUDA, buffers are anonymous page-aligned mappings registered with ``cudaHostRegister``: exact sizes (the
    caching pinned allocator rounds each request up to a power of two, up to 2x the model in RAM), and
    unregistering leaves ordinary host tensors behind, with no copy. Each mapping owns its registration: it is
    unregistered by ``release`` (``disable``) or, when a model is dropped without ``disable``, just before its
    pages are unmapped, so freed memory is never still registered. Elsewhere ``pin_memory=True`` allocations are
    used; with ``device="cpu"`` or ``pin_memory=False`` buffers stay pageable.
    """

    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self._pages: "weakref.WeakValueDictionary[int, _Pages]" = weakref.WeakValueDictionary()
        self._torch_pinned: list[torch.Tensor] = []
        self._pinner: HostPinner | None = host_pinner(device) if pin_memory else None
        if not pin_memory:
            self.mode = "pageable"
            logger.info("offload: host copies stay pageable (pin_memory=False); copies will not overlap compute")
        elif self._pinner is not None:
            self.mode = "registered"
        elif device.type == "cpu":
            self.mode = "pageable"
            logger.info("offload: device='cpu', so host copies are not pinned (pinning needs an accelerator)")
        else:
            self.mode = "pinned"
        logger.info("offload: host memory mode %r", self.mode)

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.mode == "pinned":
            buffer = torch.empty(numel, dtype=dtype, pin_memory=True)
            self._torch_pinned.append(buffer)
            return buffer
        if self.mode == "pageable" or numel == 0:
            return torch.empty(numel, dtype=dtype)
        # Whole pages of their own, so no two registrations share a page.
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        pages = _Pages(-1, (nbytes + _PAGE - 1) // _PAGE * _PAGE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:  # fewer page faults while packing, fewer pages to lock when registering
                pages.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        buffer = torch.frombuffer(pages, dtype=dtype, count=numel)
        self._pages[buffer.data_ptr()] = pages
        return buffer

    def pin(self, buffer: torch.Tensor) -> None:
        """Page-lock a buffer from ``allocate`` once it is filled (registering touched pages is faster)."""
        if self.mode != "registered" or buffer.numel() == 0:
            return
        self._pages[buffer.data_ptr()].register(self._pinner)

    def release(self, device: torch.device | None = None) -> None:
        """Unpin everything. Tensors still pointing into registered buffers become ordinary host tensors; those in
        torch-pinned buffers must be cloned by the caller first (see ``needs_clone_on_release``)."""
        registered = [pages for pages in self._pages.values() if pages.is_registered]
        if registered:
            self._pinner.synchronize()
            for pages in registered:
                try:
                    pages.unregister(synchronize=False)
                except RuntimeError as error:
                    logger.warning("offload: %s", error)
        self._pages.clear()
        self._torch_pinned.clear()

    @property
    def registered_bytes(self) -> int:
        return sum(len(p) for p in self._pages.values() if p.is_registered)

    @property
    def needs_clone_on_release(self) -> bool:
        return self.mode == "pinned"

    @property
    def page_locked(self) -> bool:
        """Whether buffers are page-locked (torch-pinned at allocation, or registered by ``pin``)."""
        return self.mode in ("pinned", "registered")


def _cuda_ok(result: object) -> bool:
    value = getattr(result, "value", result)
    return value == 0 or str(result) in ("cudaError.success", "0")


def release_freed_host_memory() -> None:
    """Return freed heap pages to the OS (glibc keeps them otherwise, and RSS stays at two model copies)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def release_freed_device_memory(device: torch.device) -> None:
    """Return the weights' freed device memory to the driver once they are packed on the host. Kept in PyTorch's
    cache, the blocks that held a model packed from the device made the offloaded steps that followed slower on the
    H200 (torchao float8 FLUX: host-bound, three times the step; GGUF Q4_K too: the cache probe of
    ``benchmarks/results/quant-offload-flux/archive/undated-236cdee-quant_offload_h200.md``), and a user offloading
    expects the device memory back."""
    if device.type != "cpu":
        module = torch.get_device_module(device)
        if hasattr(module, "empty_cache"):
            module.synchronize(device)
            module.empty_cache()


class Transfers:
    """Copies onto the device and the events that order them. On an accelerator, copies run on a dedicated
    stream; with ``device="cpu"`` they run synchronously and events are ``None``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asynchronous = device.type != "cpu"
        self._decode_stream = None
        if self.asynchronous:
            self._module = torch.get_device_module(device)
            self.copy_stream = self._module.Stream(device)

    def new_event(self):
        return self._module.Event() if self.asynchronous else None

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], wait_for=None, done=None) -> None:
        """Copy each ``(src, dst)`` on the copy stream after ``wait_for``; record ``done`` when finished."""
        if not self.asynchronous:
            for src, dst in pairs:
                dst.copy_(src)
            return
        with self._module.stream(self.copy_stream):
            if wait_for is not None:
                self.copy_stream.wait_event(wait_for)
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            done.record(self.copy_stream)

    def run(self, work: Callable[[], None], wait_for=None, done=None) -> None:
        """Run ``work`` (copies and kernels) on the copy stream after ``wait_for``; record ``done`` when finished.
        On the CPU it runs at once."""
        if not self.asynchronous:
            work()
            return
        with self._module.stream(self.copy_stream):
            if wait_for is not None:
                self.copy_stream.wait_event(wait_for)
            work()
            done.record(self.copy_stream)

    def run_decode(self, work: Callable[[], None], wait_for=(), done=None) -> None:
        """Run ``work`` (kernels that turn copied bytes into a block's weights) on a second side stream after every
        event in ``wait_for``; record ``done`` when finished. It keeps the copy stream free for the next block's
        copy while this block decodes. On the CPU it runs at once."""
        if not self.asynchronous:
            work()
            return
        if self._decode_stream is None:
            self._decode_stream = self._module.Stream(self.device)
        with self._module.stream(self._decode_stream):
            for event in wait_for:
                if event is not None:
                    self._decode_stream.wait_event(event)
            work()
            done.record(self._decode_stream)

    def compute_waits_for(self, event) -> None:
        if event is not None:
            self._module.current_stream(self.device).wait_event(event)

    def record_on_compute(self, event) -> None:
        if event is not None:
            event.record(self._module.current_stream(self.device))

    def record_on_copy(self, event) -> None:
        """Record ``event`` on the copy stream: it completes once the copies queued so far are done."""
        if event is not None:
            event.record(self.copy_stream)

    def synchronize(self) -> None:
        if self.asynchronous:
            self._module.synchronize(self.device)


def move_tensor(tensor: torch.Tensor, device: torch.device) -> None:
    """Rebind ``tensor`` (parameter or buffer) to a copy on ``device`` without touching its module."""
    if tensor.device != device:
        tensor.data = tensor.data.to(device)


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-element tensor: what an offloaded tensor holds between uses (no bytes materialised)."""
    return torch.empty(0, dtype=dtype, device=device)
