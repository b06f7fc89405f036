"""Weights as the plain tensors that hold their bytes: plain tensors, quantized tensor subclasses, and their metadata.

Offload moves bytes, so every parameter and buffer is reduced to *leaves*: plain tensors whose ``.data`` can be
rebound to a host view, a device view or an empty placeholder. Three kinds of weights are understood:

- Plain tensors (``torch.Tensor``, ``nn.Parameter``): the tensor is its own leaf.
- Storage-carrying subclasses made with ``torch.Tensor._make_subclass`` (Diffusers' ``GGUFParameter``,
  bitsandbytes' ``Params4bit`` and ``Int8Params``): the object holds the packed bytes itself, so rebinding its
  ``.data`` keeps the object, its class and its attributes (``quant_type``, ``quant_state``...). Tensors hanging off
  it (``Params4bit.quant_state.absmax``/``code``/``offset``, the nested ``state2``, ``Int8Params.CB``/``SCB``) and,
  for bitsandbytes 8-bit, off its module's ``state`` are leaves too, rebound the same way.
- Wrapper subclasses with ``__tensor_flatten__``/``__tensor_unflatten__`` (torchao ``Float8Tensor``, ``Int8Tensor``,
  ``Int4*Tensor``, ``AffineQuantizedTensor``...): the object has no bytes of its own; its inner tensors (nested
  wrappers included) are the leaves. A wrapper cannot change device in place, so to compute on the device it is
  rebuilt around the device views with ``__tensor_unflatten__`` (same outer metadata, the original's extra
  attributes such as ``_is_param`` copied, same ``requires_grad``) and set on every module that holds it. While
  *parked* (host copy, empty placeholder) the original object is set back with its inner tensors rebound, so after
  offload is disabled the weights are the same objects as before.

Anything else (a ``__torch_dispatch__`` subclass without the flatten protocol, tensor subclasses or tensors in
containers hanging off a weight) is refused with ``UnsupportedTensorError`` before anything is changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

SUPPORTED = (
    "plain tensors; storage-carrying subclasses such as Diffusers' GGUFParameter and bitsandbytes' "
    "Params4bit/Int8Params (their tensor attributes and quant_state stream with them); wrapper subclasses that "
    "implement __tensor_flatten__/__tensor_unflatten__ over plain tensors, such as torchao's Float8Tensor, "
    "Int8Tensor, Int4 tensors and AffineQuantizedTensor"
)

_PLAIN = (torch.Tensor, nn.Parameter)
_SCAN_DEPTH = 3


class UnsupportedTensorError(ValueError):
    """A parameter or buffer whose bytes offload cannot stream (nothing was changed)."""


def _refuse(where: str, tensor: Any, why: str) -> UnsupportedTensorError:
    module, _, name = where.rpartition(".")
    return UnsupportedTensorError(
        f"cannot offload parameter {name!r} of module {module or '<root>'!r}: it is a "
        f"{type(tensor).__module__}.{type(tensor).__qualname__}, which {why}; offload can stream {SUPPORTED}"
    )


def _plain_data(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.data`` as a plain ``torch.Tensor`` (a subclass's ``__torch_function__`` would re-wrap it)."""
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.data


def _dense_stride(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides to keep when ``tensor`` is a permutation of a contiguous layout (``None``: store contiguous)."""
    if tensor.is_contiguous():
        return None
    dims = sorted((d for d in range(tensor.dim()) if tensor.shape[d] != 1), key=lambda d: -tensor.stride(d))
    expected = 1
    for d in reversed(dims):
        if tensor.stride(d) != expected:
            return None
        expected *= tensor.shape[d]
    return tuple(tensor.stride())


@dataclass
class Leaf:
    """One plain tensor's bytes: ``targets`` are the tensor objects (aliases of these bytes) whose ``.data`` is
    rebound; ``inner`` leaves belong to a wrapper subclass and are only rebound while parked."""

    name: str
    targets: list[torch.Tensor]
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...] | None
    device: torch.device
    inner: bool = False

    def data(self) -> torch.Tensor:
        return _plain_data(self.targets[0])

    def flat(self) -> torch.Tensor:
        """The bytes in memory order as a 1-D tensor (the layout a flat buffer holds)."""
        data = self.data()
        if self.stride is None:
            return data.reshape(-1)
        order = sorted(range(data.dim()), key=lambda d: -data.stride(d))
        return data.permute(order).reshape(-1)


@dataclass
class Wrapper:
    """A wrapper subclass weight: how to rebuild it around new inner tensors and where modules hold it."""

    name: str
    original: torch.Tensor
    children: dict[str, "int | Wrapper"]
    context: Any
    extras: dict[str, Any] = field(default_factory=dict)
    locations: list[tuple[dict, str]] = field(default_factory=list)

    def build(self, views: list[torch.Tensor]) -> torch.Tensor:
        inner = {
            name: child.build(views) if isinstance(child, Wrapper) else views[child]
            for name, child in self.children.items()
        }
        original = self.original
        rebuilt = type(original).__tensor_unflatten__(inner, self.context, original.shape, original.stride())
        for key, value in self.extras.items():
            rebuilt.__dict__[key] = value
        if original.requires_grad and not rebuilt.requires_grad:
            rebuilt.requires_grad_(True)
        return rebuilt

    def install(self, tensor: torch.Tensor) -> None:
        for table, key in self.locations:
            table[key] = tensor


class TensorSet:
    """The leaves of a module's parameters and buffers (``select``: only tensors with these ids), in
    ``named_parameters`` then ``named_buffers`` order, and the wrapper subclasses built over them.

    Raises ``UnsupportedTensorError`` (naming module, parameter, type and what is supported) for a weight that
    cannot be streamed.
    """

    def __init__(self, module: nn.Module, label: str = "", select: set[int] | None = None) -> None:
        self.leaves: list[Leaf] = []
        self.wrappers: list[Wrapper] = []
        self._by_alias: dict[tuple, int] = {}
        self._by_id: dict[int, int] = {}
        owners: dict[int, list[tuple[nn.Module, dict, str]]] = {}
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for key, tensor in table.items():
                    if tensor is not None:
                        owners.setdefault(id(tensor), []).append((sub, table, key))
        seen: set[int] = set()
        self.ids = seen  # the selected parameters and buffers
        named = list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if b is not None]
        for name, tensor in named:
            if id(tensor) in seen or (select is not None and id(tensor) not in select):
                continue
            seen.add(id(tensor))
            where = f"{label}.{name}" if label else name
            self._weight = (where, tensor)  # what a refusal names
            self._add_weight(where, tensor, owners[id(tensor)])
        self.direct = [leaf for leaf in self.leaves if not leaf.inner]
        self._direct_index = [i for i, leaf in enumerate(self.leaves) if not leaf.inner]

    # Discovery -------------------------------------------------------------------------------------------------

    def _add_weight(self, where: str, tensor: torch.Tensor, owners: list) -> None:
        if type(tensor) in _PLAIN:
            self._add_leaf(where, tensor, inner=False)
            return
        if is_traceable_wrapper_subclass(tensor):
            wrapper = self._add_wrapper(where, tensor)
            wrapper.locations = [(table, key) for _, table, key in owners]
            self.wrappers.append(wrapper)
            return
        if type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
            raise _refuse(where, tensor, "overrides __torch_dispatch__ without __tensor_flatten__/"
                                         "__tensor_unflatten__, so the tensors holding its bytes cannot be found")
        # A storage-carrying subclass: its own bytes, plus tensors hanging off it (bitsandbytes quant_state).
        self._add_leaf(where, tensor, inner=False)
        self._scan(where, tensor, vars(tensor), _SCAN_DEPTH)
        for module, _, _ in owners:
            state = getattr(module, "state", None)
            if type(tensor).__name__ == "Int8Params" and state is not None:  # bitsandbytes Linear8bitLt
                self._scan(f"{where}<{type(module).__name__}.state>", tensor, vars(state), _SCAN_DEPTH)

    def _scan(self, where: str, weight: torch.Tensor, attributes: dict, depth: int) -> None:
        for key, value in attributes.items():
            path = f"{where}.{key}"
            if isinstance(value, torch.Tensor):
                if type(value) not in _PLAIN:
                    raise _refuse(*self._weight, f"holds a {type(value).__name__} tensor subclass in {path!r}")
                self._add_leaf(path, value, inner=False)
            elif isinstance(value, (list, tuple, dict, set)):
                items = value.values() if isinstance(value, dict) else value
                if any(isinstance(item, torch.Tensor) for item in items) and not isinstance(value, torch.Size):
                    raise _refuse(*self._weight, f"holds tensors inside a {type(value).__name__} in {path!r}")
            elif (
                depth > 0
                and hasattr(value, "__dict__")
                and not isinstance(value, (nn.Module, type))
                and not callable(value)
            ):
                self._scan(path, weight, vars(value), depth - 1)

    def _add_wrapper(self, where: str, tensor: torch.Tensor) -> Wrapper:
        try:
            names, context = tensor.__tensor_flatten__()
        except Exception as error:  # noqa: BLE001 - reported as the refusal's cause
            raise _refuse(*self._weight, f"raised {error!r} from __tensor_flatten__ (at {where!r})") from error
        children: dict[str, int | Wrapper] = {}
        for name in names:
            inner = getattr(tensor, name)
            path = f"{where}.{name}"
            if type(inner) in _PLAIN:
                children[name] = self._add_leaf(path, inner, inner=True)
            elif is_traceable_wrapper_subclass(inner):
                children[name] = self._add_wrapper(path, inner)
            else:
                raise _refuse(*self._weight, f"has an inner tensor {path!r} of type {type(inner).__name__}, "
                                             "neither plain nor flattenable")
        for key, value in vars(tensor).items():
            if isinstance(value, torch.Tensor) and key not in names:
                raise _refuse(*self._weight, f"holds tensor attribute {where}.{key} outside __tensor_flatten__")
        wrapper = Wrapper(where, tensor, children, context)
        current = [leaf.data() for leaf in self.leaves]
        try:
            trial = wrapper.build(current)
        except Exception as error:  # noqa: BLE001 - reported as the refusal's cause
            raise _refuse(*self._weight, f"could not be rebuilt by __tensor_unflatten__ ({error!r})") from error
        wrapper.extras = {k: v for k, v in vars(tensor).items() if k not in vars(trial)}
        return wrapper

    def _add_leaf(self, name: str, tensor: torch.Tensor, inner: bool) -> int:
        if id(tensor) in self._by_id:
            return self._by_id[id(tensor)]
        data = _plain_data(tensor)
        key = None
        if data.numel() > 0 and data.device.type != "meta":
            key = (data.untyped_storage().data_ptr(), data.storage_offset(), data.dtype, tuple(data.shape),
                   tuple(data.stride()), data.device)
        if key is not None and key in self._by_alias:
            index = self._by_alias[key]
            self.leaves[index].targets.append(tensor)
            self.leaves[index].inner = self.leaves[index].inner and inner
        else:
            index = len(self.leaves)
            self.leaves.append(Leaf(name, [tensor], data.dtype, data.shape, _dense_stride(data), data.device, inner))
            if key is not None:
                self._by_alias[key] = index
        self._by_id[id(tensor)] = index
        return index

    # Rebinding ------------------------------------------------------------------------------------------------

    def bind(self, views: list[torch.Tensor]) -> None:
        """Compute on ``views`` (one per leaf): plain leaves are rebound, wrapper subclasses rebuilt around them."""
        with torch._C.DisableTorchFunctionSubclass():
            for index in self._direct_index:
                view = views[index]
                for target in self.leaves[index].targets:
                    target.data = view
        for wrapper in self.wrappers:
            wrapper.install(wrapper.build(views))

    def park(self, views: list[torch.Tensor], final: bool = False) -> None:
        """Hold ``views`` (host copies, placeholders): every leaf is rebound and wrapper subclasses are their
        original objects again. With ``final``, a wrapper whose original object lives on another device than the
        views is rebuilt around them instead (an object cannot change device), so nothing is left inconsistent."""
        with torch._C.DisableTorchFunctionSubclass():
            for leaf, view in zip(self.leaves, views):
                for target in leaf.targets:
                    target.data = view
        for wrapper in self.wrappers:
            if final and views and wrapper.original.device != views[0].device:
                wrapper.install(wrapper.build(views))
            else:
                wrapper.install(wrapper.original)

    def current(self) -> list[torch.Tensor]:
        return [leaf.data() for leaf in self.leaves]

    def move_to(self, device: torch.device) -> Callable[[], None]:
        """Copy every leaf to ``device`` and compute there; returns the undo (original data and objects back)."""
        originals = self.current()
        if all(t.device == device for t in originals) and all(w.original.device == device for w in self.wrappers):
            return lambda: None
        self.bind([t.to(device) for t in originals])

        def undo() -> None:
            self.park(originals)

        return undo

    @property
    def nbytes(self) -> int:
        return sum(leaf.shape.numel() * leaf.dtype.itemsize for leaf in self.leaves)


def move_tensors(module: nn.Module, device: torch.device, select: set[int] | None = None) -> Callable[[], None]:
    """Move ``module``'s parameters and buffers (only ids in ``select``) to ``device``, subclasses included;
    returns the undo."""
    return TensorSet(module, type(module).__name__, select).move_to(device)


def storage_nbytes(module: nn.Module, select: set[int] | None = None) -> int:
    """Bytes actually stored by ``module``'s weights (a quantized weight counts its packed bytes and scales)."""
    return TensorSet(module, type(module).__name__, select).nbytes


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a weight stores: a wrapper subclass counts its inner tensors (packed data and scales), not its
    dequantized size."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()
