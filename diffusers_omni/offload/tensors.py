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
  offload is disabled the weights are the same objects as before. The rebuilt object is kept for the next bind on
  the same device: it holds tensors of its own as its inner tensors (not the views), so the next bind only rebinds
  their ``.data`` and parking rebinds them to empty placeholders, which releases the device memory. Building a
  wrapper is heavy Python (``AffineQuantizedTensor`` runs its constructor and deprecation checks), and a FLUX step
  binds ~500 of them; a subclass whose ``__tensor_unflatten__`` does not keep the tensors it is given is rebuilt
  on every bind instead.

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

PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)  # a tensor or parameter, not a subclass
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
class Rebuilt:
    """A wrapper subclass rebuilt on one device and kept between binds: ``inner`` pairs each leaf index with the
    plain tensor inside ``tensor`` that holds that leaf's bytes (rebound with ``.data``)."""

    device: torch.device
    tensor: torch.Tensor
    inner: list[tuple[int, torch.Tensor]]
    placeholders: list[torch.Tensor]  # one zero-element tensor per entry of ``inner``, on ``device``

    def rebind(self, views: list[torch.Tensor]) -> torch.Tensor:
        for index, holder in self.inner:
            holder.data = views[index]
        return self.tensor

    def release(self) -> None:
        """Point the inner tensors at empty placeholders, so the kept object holds no device memory."""
        for (_, holder), empty in zip(self.inner, self.placeholders):
            holder.data = empty


@dataclass
class Wrapper:
    """A wrapper subclass weight: how to rebuild it around new inner tensors and where modules hold it."""

    name: str
    original: torch.Tensor
    children: dict[str, "int | Wrapper"]
    context: Any
    extras: dict[str, Any] = field(default_factory=dict)
    locations: list[tuple[dict, str]] = field(default_factory=list)
    rebuilt: Rebuilt | None = None  # the object last built for computing, while it can be reused
    reusable: bool = True  # False once ``__tensor_unflatten__`` was seen not to keep the tensors it is given
    _indices: list[int] | None = field(default=None, repr=False)

    def build(self, views: "list[torch.Tensor] | dict[int, torch.Tensor]") -> torch.Tensor:
        """A new object of the original's class around ``views`` (indexed by leaf index)."""
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

    def for_views(self, views: list[torch.Tensor]) -> torch.Tensor:
        """The weight to compute on ``views``: the kept object rebound to them when it lives on their device, else
        a new object (kept for the next call when its inner tensors are the ones it was given)."""
        indices = self.leaf_indices()
        if not indices:
            return self.build(views)
        device = views[indices[0]].device
        rebuilt = self.rebuilt
        if rebuilt is not None and rebuilt.device == device:
            return rebuilt.rebind(views)
        self.drop_rebuilt()
        # Normal (not inference) tensors even when called under inference mode (model-level onload): the object is
        # installed as a parameter and, when kept, reused outside inference mode.
        with torch.inference_mode(False):
            if not self.reusable:
                return self.build(views)
            holders = {index: _holder(views[index]) for index in indices}
            tensor = self.build(holders)
            inner = self._held(tensor, holders)
            if inner is None:
                self.reusable = False
                for holder in holders.values():
                    holder.data = torch.empty(0, dtype=holder.dtype, device=holder.device)
                return self.build(views)
            placeholders = [torch.empty(0, dtype=holder.dtype, device=device) for _, holder in inner]
        self.rebuilt = Rebuilt(device, tensor, inner, placeholders)
        return tensor

    def drop_rebuilt(self) -> None:
        """Release the kept object's views and forget it (``disable``, or binding on another device)."""
        if self.rebuilt is not None:
            self.rebuilt.release()
            self.rebuilt = None

    def leaf_indices(self) -> list[int]:
        """Indices of this wrapper's leaves, nested wrappers included, in flatten order."""
        if self._indices is None:
            self._indices = [i for child in self.children.values()
                             for i in (child.leaf_indices() if isinstance(child, Wrapper) else [child])]
        return self._indices

    def _held(self, tensor: torch.Tensor, holders: dict[int, torch.Tensor]) -> list[tuple[int, torch.Tensor]] | None:
        """(leaf index, inner tensor) for every leaf of ``tensor``; ``None`` when rebinding the holders would not
        be all it takes to move ``tensor`` to new views: an inner tensor is not the holder it was built with (the
        subclass copied or reshaped it) or ``tensor`` keeps another tensor derived from them."""
        found: list[tuple[int, torch.Tensor]] = []
        for name, child in self.children.items():
            inner = getattr(tensor, name, None)
            if isinstance(child, Wrapper):
                if inner is None or type(inner) is not type(child.original):
                    return None
                nested = child._held(inner, holders)
                if nested is None:
                    return None
                found.extend(nested)
            elif inner is holders[child]:
                found.append((child, inner))
            else:
                return None
        names = set(self.children)
        if any(isinstance(value, torch.Tensor) and key not in names for key, value in vars(tensor).items()):
            return None
        return found

    def install(self, tensor: torch.Tensor) -> None:
        for table, key in self.locations:
            table[key] = tensor


def _holder(view: torch.Tensor) -> torch.Tensor:
    """A plain tensor of its own showing ``view``'s bytes (not an autograd view of the buffer: it does not keep the
    buffer object alive once its ``.data`` is rebound)."""
    holder = torch.empty(0, dtype=view.dtype, device=view.device)
    holder.data = view
    return holder


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
        # (tensor, leaf index) of every tensor rebound on each bind / park: flat, for the per-block hot path.
        self._direct_targets = [(t, i) for i in self._direct_index for t in self.leaves[i].targets]
        self._all_targets = [(t, i) for i, leaf in enumerate(self.leaves) for t in leaf.targets]
        self._parked_on: list[torch.Tensor] | None = None  # the views inner leaves were last parked on

    # Discovery -------------------------------------------------------------------------------------------------

    def _add_weight(self, where: str, tensor: torch.Tensor, owners: list) -> None:
        if type(tensor) in PLAIN_TENSOR_TYPES:
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
                if type(value) not in PLAIN_TENSOR_TYPES:
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
            if type(inner) in PLAIN_TENSOR_TYPES:
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
        current = {index: self.leaves[index].data() for index in wrapper.leaf_indices()}
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
        """Compute on ``views`` (one per leaf): plain leaves are rebound, wrapper subclasses rebuilt around them (or
        the object kept from the last bind on that device rebound to them)."""
        with torch._C.DisableTorchFunctionSubclass():
            for target, index in self._direct_targets:
                target.data = views[index]
        for wrapper in self.wrappers:
            wrapper.install(wrapper.for_views(views))

    def park(self, views: list[torch.Tensor], final: bool = False) -> None:
        """Hold ``views`` (host copies, placeholders): every leaf is rebound and wrapper subclasses are their
        original objects again; the objects kept for computing release their views. With ``final``, a wrapper
        whose original object lives on another device than the views is rebuilt around them instead (an object
        cannot change device), so nothing is left inconsistent, and nothing is kept."""
        # Inner leaves (the original wrappers' tensors) change only here, so parking again on the views they
        # already hold (a streamed block's placeholders, every step) rebinds the direct leaves only.
        again = views is self._parked_on and not final
        with torch._C.DisableTorchFunctionSubclass():
            for target, index in self._direct_targets if again else self._all_targets:
                target.data = views[index]
        for wrapper in self.wrappers:
            if final:
                wrapper.drop_rebuilt()
            elif wrapper.rebuilt is not None:
                wrapper.rebuilt.release()
            if final and views and wrapper.original.device != views[0].device:
                wrapper.install(wrapper.build(views))
            else:
                wrapper.install(wrapper.original)
        self._parked_on = None if final else views

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
