"""Routing policy: which backend serves a platform-default role, and which one serves each call shape.

Platform routes: each kernel family declares where its backends are platform defaults (``Route`` in its
``FAMILY``: the platform families, a priority, and named conditions); ``platform_routes`` joins them per platform
family, lowest priority first, from the registry. The selector walks the list and takes the first candidate whose
conditions hold and which reports no ``not_supported_reasons`` for the call. Conditions are named predicates: the
call-shape ones below, and those a family declares (``FAMILY.conditions``).

Shape routes, from a data table derived from committed benchmark results (``attention.tables``): the KV length of
a call is only known at call time, so a ``ShapeRouter`` holds the candidate backends that can run a role and picks
one per call signature ``(q bucket, kv bucket, head_dim, masked, needs gradients)``: the first call with a signature
reads the table, later calls are a dict lookup. Signatures the table does not cover go to the first candidate (the
platform route's own choice), and calls that need gradients only go to candidates with a backward (FlashInfer
prefill and ``fa3-fwd`` have none).
"""

from __future__ import annotations

from typing import Callable

import torch

from .backends.base import AttentionCall
from .backends.family import Route
from .platform import Platform
from .registry import families
from .tables import (
    BUCKET_EDGES,
    TABLE_PATH,
    active_table,
    fp8_choice,
    is_tuned,
    length_bucket,
    load_table,
    lossy_allowed,
    lossy_key,
    measured_error,
    pick,
    ranked_alternatives,
    route_margins,
    rule_key,
    sparse_dense_above,
    sparse_rules,
    table_choice,
    table_label,
)

__all__ = [
    "BUCKET_EDGES", "CALL_CONDITIONS", "Route", "ShapeRouter", "TABLE_PATH", "active_table", "failed_conditions",
    "fp8_choice", "is_tuned", "length_bucket", "load_table", "lossy_allowed", "lossy_key", "measured_error", "pick",
    "platform_route_table", "platform_routes", "ranked_alternatives", "route_conditions", "route_margins",
    "rule_key", "sparse_dense_above", "sparse_rules", "table_choice", "table_label",
]


class ShapeRouter:
    """A backend-like callable choosing among ``candidates`` (name → backend instance, in routing order) per call."""

    def __init__(self, family: str, candidates: dict, table: dict | None = None) -> None:
        if not candidates:
            raise ValueError("ShapeRouter needs at least one candidate backend")
        self.family = family
        self.candidates = dict(candidates)
        self.table = table if table is not None else active_table()
        self._chosen: dict[tuple, object] = {}
        self.base = next(iter(self.candidates))
        self.supports_mask = all(getattr(b, "supports_mask", True) for b in self.candidates.values())
        # Calls needing gradients only go to candidates with a backward, so the router has one if the base has.
        self.supports_backward = getattr(self.candidates[self.base], "supports_backward", True)

    def choose(self, q_len: int, kv_len: int, head_dim: int, masked: bool, needs_grad: bool = False) -> str:
        candidates = self.candidates
        if needs_grad:
            candidates = {n: b for n, b in candidates.items() if getattr(b, "supports_backward", True)}
        name = table_choice(self.table, self.family, q_len, kv_len, head_dim, masked, candidates, self.base)
        return name or self.base

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        signature = (query.shape[1], key.shape[1], query.shape[-1], attn_mask is not None, needs_grad)
        backend = self._chosen.get(signature)
        if backend is None:
            backend = self.candidates[self.choose(*signature)]
            if not torch.compiler.is_compiling():
                self._chosen[signature] = backend
        return backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def describe(self) -> dict:
        routes = {name: backend.describe() for name, backend in self.candidates.items() if hasattr(backend, "describe")}
        return {
            "backend": f"SHAPE_ROUTED({'|'.join(self.candidates)})",
            "implementation": "diffusers_omni.attention.routing.ShapeRouter: per call shape from "
            f"{table_label(self.table)}; uncovered shapes → {self.base}; calls needing gradients → backward-capable "
            "candidates only",
            "version": None,
            "kernel_repo": None,
            "kernel_revision": None,
            "deterministic": all(r.get("deterministic", False) for r in routes.values()),
            "routes": routes,
        }


# Platform routes ---------------------------------------------------------------------------------------------

# Conditions on the call alone; families add their own (``BackendFamily.conditions``).
CALL_CONDITIONS: dict[str, Callable[[Platform, AttentionCall], bool]] = {
    "model_declares_mask_free_path": lambda platform, call: call.mask_free_path and not call.has_mask,
    "head_dim_128": lambda platform, call: call.head_dim == 128,
}


def route_conditions() -> dict[str, Callable[[Platform, AttentionCall], bool]]:
    """Every condition a route may name: the call-shape ones and those of the registered families."""
    conditions = dict(CALL_CONDITIONS)
    for family in families():
        conditions.update(family.conditions)
    return conditions


def platform_route_table() -> dict[str, tuple[Route, ...]]:
    """Per platform family, the routes of every registered family, lowest priority first (families in registry
    order break ties)."""
    routes: dict[str, list[Route]] = {}
    for family in families():
        for route in family.routes:
            for platform_family in route.platforms:
                routes.setdefault(platform_family, []).append(route)
    return {name: tuple(sorted(found, key=lambda route: route.priority)) for name, found in routes.items()}


def platform_routes(platform: Platform) -> tuple[Route, ...]:
    table = platform_route_table()
    return table.get(platform.family, table.get("cpu", ()))


def failed_conditions(route: Route, platform: Platform, call: AttentionCall) -> list[str]:
    conditions = route_conditions()
    return [name for name in route.when if not conditions[name](platform, call)]


def __getattr__(name: str):
    # Computed from the registry when read, so families registered at run time count.
    if name == "PLATFORM_ROUTES":
        return platform_route_table()
    if name == "ROUTE_CONDITIONS":
        return route_conditions()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
