"""Host copies of weights packed into flat buffers, and the streams/events that move them.

A ``PackedWeights`` holds every parameter and buffer of a module in one contiguous host buffer per dtype. The
tensors keep their identity; only their ``.data`` is rebound (to host views, device views or empty placeholders).
Quantized tensor subclasses stream their packed storage: see :mod:`.tensors`.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from .tensors import Leaf, TensorSet

logger = logging.getLogger("diffusers_omni")

# Offsets inside flat buffers are multiples of this, so views are as aligned as fresh allocations (CPU kernels
# may round differently on misaligned data; CUDA allocations are 512-byte aligned).
ALIGN_BYTES = 512
_PAGE = 4096


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

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def view_of(self, buffer: torch.Tensor) -> torch.Tensor:
        flat = buffer.narrow(0, self.offset, self.shape.numel())
        return flat.view(self.shape) if self.stride is None else flat.as_strided(self.shape, self.stride)

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

    def __init__(self, path: str, module: nn.Module) -> None:
        self.path = path
        self.tensors = TensorSet(module, path)
        self.slots: list[TensorSlot] = []
        self.numel: dict[torch.dtype, int] = {}
        for leaf in self.tensors.leaves:
            offset = self.numel.get(leaf.dtype, 0)
            self.slots.append(
                TensorSlot(leaf.targets[0], leaf.dtype, offset, leaf.shape, leaf.device, leaf.stride, leaf)
            )
            self.numel[leaf.dtype] = offset + _aligned(leaf.shape.numel(), leaf.dtype)
        self.host: dict[torch.dtype, torch.Tensor] = {}
        self.host_views: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(n * torch.empty(0, dtype=d).element_size() for d, n in self.numel.items())

    @property
    def empty(self) -> bool:
        return not self.slots

    def views_into(self, buffers: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Views of ``buffers`` (one flat tensor per dtype, at least as long as this layout) shaped like each
        leaf, in ``slots`` order."""
        return [s.view_of(buffers[s.dtype]) for s in self.slots]

    def pack(self, host_memory: "HostMemory") -> None:
        """Copy every tensor into fresh host buffers and rebind it to its host view, tensor by tensor, so the
        original storage can be freed as we go (no second full copy)."""
        self.host = {dtype: host_memory.allocate(numel, dtype) for dtype, numel in self.numel.items()}
        self.host_views = self.views_into(self.host)
        for slot, view in zip(self.slots, self.host_views):
            view.copy_(slot.leaf.data())
            with torch._C.DisableTorchFunctionSubclass():
                for target in slot.leaf.targets:
                    target.data = view
        self.tensors.park(self.host_views)
        for buffer in self.host.values():
            host_memory.pin(buffer)

    def bind(self, views: list[torch.Tensor]) -> None:
        """Compute on ``views`` (device views): tensors are rebound, wrapper subclasses rebuilt around them."""
        self.tensors.bind(views)

    def park(self, views: list[torch.Tensor], final: bool = False) -> None:
        """Hold ``views`` (host views, placeholders): tensors are rebound, wrapper subclasses are their original
        objects (see ``TensorSet.park`` for ``final``)."""
        self.tensors.park(views, final)

    def restore(self, clone: bool, to_original_device: bool) -> None:
        """Rebind every tensor to its host view (a private copy of it with ``clone``); with ``to_original_device``
        move it back to the device it had before packing."""
        views = []
        for slot, view in zip(self.slots, self.host_views):
            if to_original_device and slot.original_device.type != "cpu":
                views.append(view.to(slot.original_device))
            else:
                views.append(view.clone() if clone else view)
        self.tensors.park(views, final=not to_original_device)
        self.host = {}
        self.host_views = []


class HostMemory:
    """Allocates the flat host buffers and page-locks them.

    On CUDA, buffers are ordinary allocations registered with ``cudaHostRegister``: exact sizes (the caching pinned
    allocator rounds each request up to a power of two, up to 2x the model in RAM), and unregistering leaves
    ordinary host tensors behind, with no copy. Elsewhere ``pin_memory=True`` allocations are used; with
    ``device="cpu"`` or ``pin_memory=False`` buffers stay pageable.
    """

    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self._registered: list[int] = []
        self._torch_pinned: list[torch.Tensor] = []
        self._cudart = None
        if not pin_memory:
            self.mode = "pageable"
            logger.info("offload: host copies stay pageable (pin_memory=False); copies will not overlap compute")
        elif device.type == "cpu":
            self.mode = "pageable"
            logger.info("offload: device='cpu', so host copies are not pinned (pinning needs an accelerator)")
        elif device.type == "cuda" and self._load_cudart():
            self.mode = "registered"
        else:
            self.mode = "pinned"
        logger.info("offload: host memory mode %r", self.mode)

    def _load_cudart(self) -> bool:
        try:
            cudart = torch.cuda.cudart()
        except Exception as error:  # noqa: BLE001 - any failure means "use the pinned allocator"
            logger.info("offload: cudart unavailable (%s); using torch's pinned allocator", error)
            return False
        if not (hasattr(cudart, "cudaHostRegister") and hasattr(cudart, "cudaHostUnregister")):
            logger.info("offload: this torch build exposes no cudaHostRegister; using torch's pinned allocator")
            return False
        self._cudart = cudart
        return True

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.mode == "pinned":
            buffer = torch.empty(numel, dtype=dtype, pin_memory=True)
            self._torch_pinned.append(buffer)
            return buffer
        if self.mode == "pageable":
            return torch.empty(numel, dtype=dtype)
        # Page-aligned start and a page-rounded registered range, so no two registrations share a page.
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = numel * itemsize
        raw = torch.empty(nbytes + 2 * _PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _PAGE
        return raw[start : start + nbytes].view(dtype)

    def pin(self, buffer: torch.Tensor) -> None:
        """Page-lock a buffer from ``allocate`` once it is filled (registering touched pages is faster)."""
        if self.mode != "registered" or buffer.numel() == 0:
            return
        size = (buffer.numel() * buffer.element_size() + _PAGE - 1) // _PAGE * _PAGE
        result = self._cudart.cudaHostRegister(buffer.data_ptr(), size, 0)
        if not _cuda_ok(result):
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed: {result}")
        self._registered.append(buffer.data_ptr())

    def release(self, device: torch.device) -> None:
        """Unpin everything. Tensors still pointing into registered buffers become ordinary host tensors; those in
        torch-pinned buffers must be cloned by the caller first (see ``needs_clone_on_release``)."""
        if self._registered:
            torch.cuda.synchronize(device)
            for ptr in self._registered:
                result = self._cudart.cudaHostUnregister(ptr)
                if not _cuda_ok(result):
                    logger.warning("offload: cudaHostUnregister failed (%s)", result)
            self._registered.clear()
        self._torch_pinned.clear()

    @property
    def needs_clone_on_release(self) -> bool:
        return self.mode == "pinned"


def _cuda_ok(result: object) -> bool:
    value = getattr(result, "value", result)
    return value == 0 or str(result) in ("cudaError.success", "0")


def release_freed_host_memory() -> None:
    """Return freed heap pages to the OS (glibc keeps them otherwise, and RSS stays at two model copies)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Transfers:
    """Copies onto the device and the events that order them. On an accelerator, copies run on a dedicated
    stream; with ``device="cpu"`` they run synchronously and events are ``None``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asynchronous = device.type != "cpu"
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

    def used_by_copy_stream(self, tensors) -> None:
        """Tell the caching allocator that the copy stream used ``tensors`` (allocated on the compute stream)."""
        if self.asynchronous:
            for tensor in tensors:
                tensor.record_stream(self.copy_stream)

    def compute_waits_for(self, event) -> None:
        if event is not None:
            self._module.current_stream(self.device).wait_event(event)

    def record_on_compute(self, event) -> None:
        if event is not None:
            event.record(self._module.current_stream(self.device))

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
