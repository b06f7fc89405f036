"""Omni attention processors: how a module's attention calls reach the backend resolved for their role.

Diffusers' processors attend through ``dispatch_attention_fn`` (the DiT families) or
``F.scaled_dot_product_attention`` (the classic ``attention_processor`` family: SDXL's UNet, SD3, PAG,
IP-Adapters), both read as globals of their module. A *routed* processor (``routed_processor_class`` /
``bind_routed``) runs Diffusers' own processor code unchanged, re-created over a namespace in which each of those
calls (``callsites``) goes to the ``RoleAttention`` of the role declared for it: nothing of Diffusers' processor
bodies is copied, so a Diffusers release that changes a processor changes ours with it.

A processor keeps the one it replaced (restored by ``remove_attention``) and holds one ``RoleAttention`` per role
of its module, each bound to the backend resolved for that role.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
import weakref

from typing import Any, Callable

import torch

from . import callsites
from .backends.base import AttentionBackend
from .selector import Resolution

logger = logging.getLogger("diffusers_omni.attention")

DISPATCH_NAME = callsites.DISPATCH_NAME


class MaskPolicy:
    """Drops all-True masks before dispatch, deciding once per mask tensor, and keeps masks derived from a model's
    key-padding mask for as long as that mask lives.

    Models build one mask per forward and pass the same tensor to every block, so remembering the last mask seen
    costs one device-to-host read per forward instead of one per layer. Only weak references are kept: a mask is
    never held alive by the policy. One policy is shared by every processor of a model.
    """

    __slots__ = ("_last", "_keep", "_derived")

    def __init__(self) -> None:
        self._last: weakref.ref | None = None
        self._keep = True
        self._derived: tuple[weakref.ref, tuple, torch.Tensor] | None = None

    def apply(self, attn_mask: torch.Tensor | None) -> torch.Tensor | None:
        if attn_mask is None or attn_mask.dtype != torch.bool or torch.compiler.is_compiling():
            return attn_mask
        if self._last is None or self._last() is not attn_mask:
            self._last = weakref.ref(attn_mask)
            self._keep = not bool(attn_mask.all())
        return attn_mask if self._keep else None

    def derived(self, source: torch.Tensor, key: tuple, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``build()``, computed once per ``(source, key)`` while ``source`` lives (e.g. the dense mask that every
        layer of a forward derives from the same key-padding mask), so every layer gets the same tensor."""
        if torch.compiler.is_compiling():
            return build()
        cached = self._derived
        if cached is not None and cached[0]() is source and cached[1] == key:
            return cached[2]
        value = build()
        self._derived = (weakref.ref(source, self._forget_derived), key, value)
        return value

    def _forget_derived(self, _ref: weakref.ref) -> None:
        if self._derived is not None and self._derived[0] is _ref:
            self._derived = None


class _ForwardOnlyAttention(torch.autograd.Function):
    """Runs a forward-only backend inside the graph so that a backward through it raises instead of returning no
    gradient (or a wrong one) for Q, K and V."""

    @staticmethod
    def forward(ctx, run, message, query, key, value):
        ctx.message = message
        return run(query, key, value)

    @staticmethod
    def backward(ctx, grad_output):
        raise RuntimeError(ctx.message)


class RoleAttention:
    """Attention for one role: a resolved backend, called with ``[B, S, H, D]`` tensors.

    When the backend has no backward (``supports_backward = False``) and the call needs gradients, the output is
    produced through ``_ForwardOnlyAttention``: the forward value is the backend's, and a backward raises naming
    the backend and the role.
    """

    __slots__ = ("resolution", "backend", "mask_policy", "_no_backward")

    def __init__(self, resolution: Resolution, backend: AttentionBackend, mask_policy: MaskPolicy | None = None) -> None:
        self.resolution = resolution
        self.backend = backend
        self.mask_policy = mask_policy or MaskPolicy()
        self._no_backward = None
        if not backend.supports_backward:
            self._no_backward = (
                f"attention backend {resolution.backend} (role {resolution.role!r}) is forward-only "
                "(supports_backward=False) and computes no gradients; backward through it is refused rather than "
                f"returning missing or wrong gradients. Select a backend with a backward pass for role "
                f"{resolution.role!r} when training (e.g. TORCH_SDPA), or run this forward under torch.no_grad()."
            )

    @property
    def role(self) -> str:
        return self.resolution.role

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None:
            attn_mask = self.mask_policy.apply(attn_mask)
            if attn_mask is not None and not self.backend.supports_mask:
                raise ValueError(
                    f"attention role {self.role!r} received an attention mask, but its backend "
                    f"{self.resolution.backend} accepts none (the model declared this role unmasked); select a "
                    "mask-capable backend for this role, e.g. TORCH_SDPA"
                )
        if self._no_backward is not None and torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad
        ):
            backend = self.backend

            def run(q, k, v):
                return backend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)

            return _ForwardOnlyAttention.apply(run, self._no_backward, query, key, value)
        return self.backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def __repr__(self) -> str:
        return f"RoleAttention(role={self.role!r}, backend={self.resolution.backend})"


class OmniAttnProcessor:
    """Base class: marks a processor as ours and keeps the one it replaced."""

    def __init__(self, original: Any, attend: dict[str, RoleAttention]) -> None:
        self.original = original
        self.attend = attend

    def __repr__(self) -> str:
        roles = ", ".join(f"{role}={ra.resolution.backend}" for role, ra in self.attend.items())
        return f"{type(self).__name__}({roles})"


def is_omni_processor(processor: Any) -> bool:
    return isinstance(processor, OmniAttnProcessor)


# Routed processors ------------------------------------------------------------------------------------------------


def unbound_error(processor: Any) -> RuntimeError:
    return RuntimeError(
        f"{type(processor).__name__}() was built without a backend (Diffusers re-instantiates processor classes "
        "when it loads or unloads IP-adapters); omni attention re-applies itself at the model's next forward. Call "
        "the model, not the attention module, or call enable_omni_attention() again."
    )


def _rebind(function: types.FunctionType, namespace: dict, code: types.CodeType | None = None) -> types.FunctionType:
    rebound = types.FunctionType(
        code or function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    rebound.__doc__ = function.__doc__
    rebound.__dict__.update(function.__dict__)
    return rebound


def _reads(code: types.CodeType, names: set[str]) -> bool:
    """Whether ``code`` (or code nested in it) reads one of ``names`` as a global."""
    stack = [code]
    while stack:
        code = stack.pop()
        if names & set(code.co_names):
            return True
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False


_HELPERS: dict[str, dict[str, types.FunctionType]] = {}


def _attention_helpers(module: types.ModuleType) -> dict[str, types.FunctionType]:
    """The module-level functions of ``module`` that attend: those holding an attention call and, transitively,
    those calling one of them (FLUX.2's KV-cache attention). Computed once per module."""
    helpers = _HELPERS.get(module.__name__)
    if helpers is None:
        functions = {
            name: value for name, value in vars(module).items()
            if isinstance(value, types.FunctionType) and value.__module__ == module.__name__
        }
        helpers = {name: f for name, f in functions.items() if callsites.has_calls(f)}
        changed = True
        while changed:
            changed = False
            for name, function in functions.items():
                if name not in helpers and _reads(function.__code__, set(helpers)):
                    helpers[name] = function
                    changed = True
        _HELPERS[module.__name__] = helpers
    return helpers


_ROUTE_COUNT = 0


def _shared_mask(policy: MaskPolicy, source: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mask to hand a backend for ``mask``, which a processor derived from key-padding mask ``source`` (the
    same tensor in every module of a forward): ``source`` itself where ``mask`` is only ``source`` viewed as
    ``[B, 1, 1, S]`` (backends read both layouts alike), else the first such derivation of ``source`` with
    ``mask``'s shape (``MaskPolicy.derived``). Every module of a forward then passes the same tensor, so the mask
    policy checks it for all-True once per forward instead of once per module."""
    if torch.compiler.is_compiling() or not isinstance(source, torch.Tensor):
        return mask
    if (
        mask.ndim == 4 and source.ndim == 2 and mask.shape == (source.shape[0], 1, 1, source.shape[1])
        and mask.dtype == source.dtype and mask.device == source.device and mask.data_ptr() == source.data_ptr()
        and (source.shape[0] == 1 or mask.stride(0) == source.stride(0))
        and (source.shape[1] == 1 or mask.stride(3) == source.stride(1))
    ):
        return source
    return policy.derived(source, ("routed", tuple(mask.shape), mask.dtype, mask.device), lambda: mask)


def _sliced(
    attention: RoleAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    slice_size: int,
) -> torch.Tensor:
    """Attention over ``[B, H, S, D]`` tensors in slices of ``slice_size`` of the ``B × H`` rows (how Diffusers'
    ``SlicedAttnProcessor`` slices), one backend call per slice with one head; returns ``[B, H, S, D]``."""
    batch_size, heads, query_len, head_dim = query.shape
    rows = batch_size * heads
    query = query.reshape(rows, query_len, 1, head_dim)
    key = key.reshape(rows, key.shape[2], 1, head_dim)
    value = value.reshape(rows, value.shape[2], 1, head_dim)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(batch_size, heads, -1, -1).reshape(rows, 1, *attn_mask.shape[2:])
    out = torch.empty((rows, query_len, 1, head_dim), device=query.device, dtype=query.dtype)
    for start in range(0, rows, slice_size):
        end = start + slice_size
        mask = None if attn_mask is None else attn_mask[start:end]
        out[start:end] = attention(query[start:end], key[start:end], value[start:end], attn_mask=mask)
    return out.view(batch_size, heads, query_len, head_dim)


class _Route:
    """What a bound routed processor runs: the stock ``__call__`` re-created over a copy of its module's namespace
    in which each attention call written in it (``callsites``) reads a global of its own, bound to the role
    declared for that call.

    ``calls`` maps a call's result name (``callsites.CallSite.result``) to the role it goes to; every other call
    goes to the module's one role that ``calls`` does not name (an error when there is none or several). A call
    whose role the module does not have raises when it runs, naming the call and the role.

    ``mask_source`` names the stock ``__call__``'s argument holding the key-padding mask that every module of a
    forward receives as the same tensor and derives its attention mask from: the masks of the calls are then
    shared across modules (``_shared_mask``). The declaration that names it vouches that the derived mask depends
    only on that tensor and the mask's shape. ``slice_size`` runs each ``F.scaled_dot_product_attention`` call in
    slices of that many ``batch × heads`` rows (Diffusers' attention slicing). ``refuse`` names arguments the stock
    ``__call__`` accepts but ignores: a value for one raises rather than being dropped."""

    __slots__ = ("original", "attend", "call", "real_dispatch", "module_name", "_cp_warned", "mask_source",
                 "mask_index", "source", "slice_size", "refuse", "sites", "where")

    def __init__(self, original: Any, attend: dict[str, RoleAttention], stock_call: types.FunctionType,
                 mask_source: str | None = None, calls: dict[str, str] | None = None, slice_size: int | None = None,
                 refuse: tuple[str, ...] = (), where: str = "") -> None:
        self.original = original
        self.attend = attend
        self._cp_warned = False
        self.mask_source = mask_source
        self.mask_index = -1
        self.source = None
        self.slice_size = slice_size
        self.where = where or type(original).__name__
        parameters = list(inspect.signature(stock_call).parameters)
        for name in (mask_source, *refuse):
            if name is not None and name not in parameters[2:]:
                raise TypeError(f"{name!r} is not an argument of {stock_call.__qualname__}; allowed: {parameters[2:]}")
        if mask_source is not None:
            self.mask_index = parameters.index(mask_source) - 2  # its position after (self, attn)
        self.refuse = tuple((name, parameters.index(name) - 2) for name in refuse)
        module = sys.modules[stock_call.__module__]
        self.real_dispatch = getattr(module, callsites.DISPATCH_NAME, None)
        # The namespace is a module of its own in sys.modules (torch.compile finds a function's globals through
        # their module's name); ``bind_routed`` removes it when the processor is garbage-collected.
        global _ROUTE_COUNT
        _ROUTE_COUNT += 1
        self.module_name = f"{__name__}._routes.{module.__name__.rpartition('.')[2]}_{_ROUTE_COUNT}"
        route_module = types.ModuleType(self.module_name)
        namespace = route_module.__dict__
        namespace.update({k: v for k, v in module.__dict__.items() if k not in ("__name__", "__spec__", "__loader__")})
        sys.modules[self.module_name] = route_module
        # Module-level helpers the processor calls that attend themselves (FLUX.2's KV-cache attention) are
        # re-created over the same namespace, their calls routed too.
        sites: list[callsites.CallSite] = []
        for name, helper in _attention_helpers(module).items():
            patched = callsites.patched(helper)
            sites.extend(patched.sites)
            namespace[name] = _rebind(helper, namespace, patched.code)
        patched = callsites.patched(stock_call)
        sites.extend(patched.sites)
        self.call = _rebind(stock_call, namespace, patched.code)
        self.sites = tuple(sites)
        calls = calls or {}
        unnamed = [role for role in attend if role not in calls.values()]
        for site in self.sites:
            role = calls.get(site.result, unnamed[0] if len(unnamed) == 1 else None)
            attention = attend.get(role) if role is not None else None
            if attention is None:
                function = self._missing(site, role)
            elif site.kind == callsites.DISPATCH:
                function = self._dispatch(attention)
            else:
                function = types.SimpleNamespace(**{callsites.SDPA_NAME: self._sdpa(attention)})
            namespace[site.name] = function

    def _missing(self, site: callsites.CallSite, role: str | None):
        if role is None:
            problem = f"has no declared role (the module's roles: {sorted(self.attend)})"
        else:
            problem = f"goes to role {role!r}, which this module does not have (its roles: {sorted(self.attend)})"
        message = (f"{self.where}: the attention call {site.result!r} of {site.function} (line {site.line}) "
                   f"{problem}")

        def missing(*args, **kwargs):
            if not self.attend:
                raise unbound_error(self.original)
            raise RuntimeError(message)

        if site.kind == callsites.DISPATCH:
            return missing
        return types.SimpleNamespace(**{callsites.SDPA_NAME: missing})

    def _dispatch(self, attention: RoleAttention):
        route = self

        def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
            if parallel_config is not None:
                # Context parallelism lives inside Diffusers' dispatch (ring / Ulysses exchanges around its
                # kernels); an omni backend has no such path, so these calls keep Diffusers' own, said once.
                if not route._cp_warned:
                    route._cp_warned = True
                    logger.warning(
                        "context parallelism is enabled: attention role %r runs through Diffusers' dispatch "
                        "(backend %s), not omni backend %s, which has no context-parallel path",
                        attention.role, backend or "Diffusers' active backend", attention.resolution.backend,
                    )
                return route.real_dispatch(
                    query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa, attention_kwargs=attention_kwargs, backend=backend,
                    parallel_config=parallel_config,
                )
            if attn_mask is not None and route.source is not None:
                attn_mask = _shared_mask(attention.mask_policy, route.source, attn_mask)
            if attention_kwargs:
                raise ValueError(
                    f"attention role {attention.role!r}: Diffusers' processor passed attention_kwargs="
                    f"{sorted(attention_kwargs)}, which omni backends do not take; use TORCH_SDPA through "
                    "Diffusers' own dispatch (disable_omni_attention()) for this model"
                )
            return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

        return dispatch

    def _sdpa(self, attention: RoleAttention):
        slice_size = self.slice_size

        def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False):
            # [B, H, S, D] in and out; the backend gets the [B, S, H, D] views of the very tensors SDPA would get.
            if slice_size:
                return _sliced(attention, query, key, value, attn_mask, slice_size)
            out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                            dropout_p, is_causal, scale, enable_gqa)
            return out.transpose(1, 2)

        return scaled_dot_product_attention

    def check(self, args: tuple, kwargs: dict) -> None:
        for name, index in self.refuse:
            given = kwargs.get(name, args[index] if index < len(args) else None)
            if given is not None:
                raise ValueError(
                    f"{self.where}: Diffusers' {type(self.original).__name__} ignores {name} without a word; omni "
                    f"attention does not drop it silently. Remove {name} (e.g. from the pipeline's attention kwargs)."
                )


class RoutedProcessor(OmniAttnProcessor):
    """Base of the generated routed processor classes (``routed_processor_class``).

    A routed processor is an instance of the Diffusers processor class it stands for (so Diffusers' own checks,
    ``set_ip_adapter_scale``, ``unload_ip_adapter`` and processor-type tests see what they expect) and shares
    its original's attributes: both objects hold the same ``__dict__`` (IP-Adapter weights, ``scale``,
    ``_attention_backend``, ...), so ``state_dict`` keys, ``.to()`` and settings reach the original, which
    ``remove_attention`` puts back. Its ``__call__`` runs the stock ``__call__`` with attention calls routed to
    its roles.

    Built with no arguments (Diffusers does ``type(processor)()`` when it loads or unloads IP-adapters), it is an
    unbound placeholder that refuses to run; omni attention's forward guard replaces it before the model runs.
    """

    __slots__ = ()
    _omni_stock: type = object

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "_omni_route", None)
        self._omni_stock.__init__(self, *args, **kwargs)

    @property
    def original(self) -> Any:
        route = self._omni_route
        if route is not None:
            return route.original
        # An unbound placeholder stands for a stock processor with its own attributes.
        stock = self._omni_stock.__new__(self._omni_stock)
        object.__setattr__(stock, "__dict__", self.__dict__)
        return stock

    @property
    def attend(self) -> dict[str, RoleAttention]:
        route = self._omni_route
        return {} if route is None else route.attend

    def __call__(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
        route = self._omni_route
        if route is None:
            raise unbound_error(self)
        if route.refuse:
            route.check(args, kwargs)
        if route.mask_source is None:
            return route.call(self, attn, *args, **kwargs)
        index = route.mask_index
        route.source = kwargs.get(route.mask_source, args[index] if index < len(args) else None)
        try:
            return route.call(self, attn, *args, **kwargs)
        finally:
            route.source = None  # a mask is never held alive past the call

    def __reduce_ex__(self, protocol: int):
        # Pickled (or deep-copied) as the stock processor it stands for, the very object (routes hold backends and
        # namespaces); the model's omni attention state routes it again at the copy's first forward. Reducing to
        # the original's own reduction would fail pickle's check that a __newobj__ class is the object's class.
        return (_stand_in, (self.original,))

    __repr__ = OmniAttnProcessor.__repr__


_ROUTED_CLASSES: dict[type, type] = {}


def _stand_in(original: Any) -> Any:
    """What a pickled routed processor loads as: the stock processor it stood for."""
    return original


def routed_processor_class(stock: type, name: str | None = None) -> type:
    """The routed processor class standing for Diffusers processor class ``stock`` (one per class, cached)."""
    cls = _ROUTED_CLASSES.get(stock)
    if cls is None:
        if not isinstance(getattr(stock, "__call__", None), types.FunctionType):
            raise TypeError(f"{stock.__name__} has no Python __call__ to route")
        name = name or "Omni" + stock.__name__.removesuffix("2_0")

        def __call__(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
            return RoutedProcessor.__call__(self, attn, *args, **kwargs)

        # Diffusers' attention modules pass a processor only the keyword arguments its __call__'s signature names.
        __call__.__signature__ = inspect.signature(stock.__call__)
        __call__.__qualname__ = f"{name}.__call__"
        cls = type(name, (RoutedProcessor, stock), {
            "__slots__": ("_omni_route",), "_omni_stock": stock, "__module__": __name__, "__call__": __call__,
            "__doc__": f"``{stock.__name__}`` with its attention calls routed to omni backends (see RoutedProcessor).",
        })
        _ROUTED_CLASSES[stock] = cls
    return cls


def routed_classes() -> dict[type, type]:
    """Every routed processor class made so far, by the Diffusers class it stands for."""
    return dict(_ROUTED_CLASSES)


def is_routable(processor_class: type) -> bool:
    """Whether Diffusers processor class ``processor_class`` attends through ``dispatch_attention_fn`` or
    ``F.scaled_dot_product_attention`` (directly or through a helper of its module): the seam routing needs."""
    call = getattr(processor_class, "__call__", None)
    if not isinstance(call, types.FunctionType):
        return False
    module = sys.modules.get(call.__module__)
    if module is None:
        return False
    return callsites.has_calls(call) or _reads(call.__code__, set(_attention_helpers(module)))


def bind_routed(
    processor: Any,
    attend: dict[str, RoleAttention],
    mask_source: str | None = None,
    *,
    calls: dict[str, str] | None = None,
    runs: type | None = None,
    slice_size: int | None = None,
    refuse: tuple[str, ...] = (),
    where: str = "",
) -> RoutedProcessor:
    """A routed processor standing for ``processor`` (a stock Diffusers processor, or a routed one, bound or not),
    each of its attention calls going to the role of ``attend`` declared for it (see ``_Route``: ``calls`` maps
    calls, by the name Diffusers gives their result, to role names). ``processor`` itself is not changed.

    ``runs``: the Diffusers class whose ``__call__`` runs, when it is not the processor's own (Diffusers'
    ``AttnProcessor`` and ``SlicedAttnProcessor`` attend with an explicit softmax, which has no call to route:
    ``AttnProcessor2_0`` runs for them, sliced by ``slice_size`` for the latter). ``mask_source``, ``refuse``: see
    ``_Route``; ``where`` names the module in errors."""
    original = processor.original if isinstance(processor, RoutedProcessor) else processor
    stock = runs or type(original)
    cls = routed_processor_class(stock)
    routed = cls.__new__(cls)
    object.__setattr__(routed, "__dict__", original.__dict__)
    route = _Route(original, attend, stock.__call__, mask_source, calls, slice_size, refuse, where)
    object.__setattr__(routed, "_omni_route", route)
    weakref.finalize(routed, sys.modules.pop, route.module_name, None)
    return routed
