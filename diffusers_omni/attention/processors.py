"""Pieces shared by every omni attention processor.

A processor replaces a Diffusers processor on one attention module. It keeps the original (restored by
``remove_attention``) and holds one ``RoleAttention`` per attention call it makes, each bound to the backend
resolved for that role. The per-architecture processors live with their model declarations in
``diffusers_omni.models``; they mirror Diffusers' operation order exactly so that ``TORCH_SDPA`` output is
bitwise equal to stock Diffusers.
"""

from __future__ import annotations

import weakref

from typing import Any, Callable

import torch
import torch.nn as nn

from .backends.base import AttentionBackend
from .selector import Resolution


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


class OmniModuleAttnProcessor(OmniAttnProcessor, nn.Module):
    """An ``OmniAttnProcessor`` that is an ``nn.Module`` holding the weights of the processor it replaced (the
    IP-Adapter processors).

    ``original`` and ``attend`` are plain attributes (the original must not become a submodule: its weights would
    appear twice); the original's weight modules are registered under their own names by the subclass, so
    ``state_dict`` keys, ``.to()`` and ``parameters()`` see the same tensors as with the stock processor. ``scale``
    reads and writes the original's, so Diffusers' ``set_ip_adapter_scale`` keeps working.
    """

    def __init__(self, original: Any, attend: dict[str, RoleAttention]) -> None:
        nn.Module.__init__(self)
        object.__setattr__(self, "original", original)
        object.__setattr__(self, "attend", attend)

    def _split_ip_roles(self, suffix: str) -> None:
        """Binds ``_attention`` to the role not named ``*<suffix>`` and ``_ip_attention`` to the one that is (each
        ``None`` when absent: an unbound placeholder)."""
        self._attention = next((ra for role, ra in self.attend.items() if not role.endswith(suffix)), None)
        self._ip_attention = next((ra for role, ra in self.attend.items() if role.endswith(suffix)), None)

    @property
    def scale(self) -> Any:
        return self.original.scale

    @scale.setter
    def scale(self, value: Any) -> None:
        self.original.scale = value

    __repr__ = OmniAttnProcessor.__repr__


def is_omni_processor(processor: Any) -> bool:
    return isinstance(processor, OmniAttnProcessor)
