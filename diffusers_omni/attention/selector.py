"""Per-role backend resolution.

Order for an attention call with ``role`` and ``category``: ``per_role[role]`` → ``per_role[category]`` →
``default`` → environment variable ``DIFFUSION_ATTENTION_BACKEND`` → environment variable ``DIFFUSERS_ATTN_BACKEND``
(Diffusers' own, in Diffusers' names) → platform default. An explicit backend is
validated and raises ``BackendNotSupportedError`` with every reason when it cannot run the call; the platform
default walks its routing table and takes the first candidate that can. Each result carries the trace that
``diffusers-omni explain`` prints.

Roles resolve from an ``AttentionPlan`` (``attention/plan.py``): the config parsed and checked once per enable call,
with the environment and deterministic mode read then. ``resolve`` is a public entry: it accepts anything
``AttentionConfig.parse`` accepts (or a plan) and builds the plan itself; everything else here (``resolve_role``,
``select_spec``, ``check_per_role_keys``) takes a plan only (``require_plan``).
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..config.attention import AttentionConfig, AttentionSpec
from .backends.base import AttentionCall
from .plan import (
    ENV_BACKEND,
    ENV_DETERMINISTIC,
    ENV_DIFFUSERS_BACKEND,
    AttentionPlan,
    clear_logged,
    deterministic_requested,
    environment_backend,
)
from .platform import Platform
from .registry import get_backend_class, is_registered, registry_generation
from .routing import (
    active_table,
    failed_conditions,
    lossy_allowed,
    platform_routes,
    ranked_alternatives,
    route_margins,
    table_label,
)

logger = logging.getLogger("diffusers_omni.attention")

__all__ = [
    "ENV_BACKEND", "ENV_DETERMINISTIC", "ENV_DIFFUSERS_BACKEND", "AttentionPlan", "BackendNotSupportedError",
    "Candidate", "Resolution", "check_per_role_keys", "clear_resolution_cache", "deterministic_requested",
    "environment_backend", "require_plan", "resolve", "resolve_role", "select_spec",
]


class BackendNotSupportedError(ValueError):
    """An explicitly selected backend cannot run an attention call here."""


@dataclass(frozen=True)
class Candidate:
    backend: str
    reasons: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"backend": self.backend, "reasons": list(self.reasons)}


@dataclass(frozen=True)
class Resolution:
    """The backend chosen for one role, where the choice came from, and what was rejected on the way."""

    role: str
    category: str
    backend: str
    spec: AttentionSpec | None
    source: str
    call: AttentionCall
    candidates: tuple[Candidate, ...] = ()
    # Platform defaults only: backends the committed routing table ranks first for some call shapes of this role;
    # ``backend`` still runs every shape the table does not cover.
    shape_routed: tuple[str, ...] = ()
    # Platform defaults only: the routing table that decided (tuned on this GPU, or the shipped one) and, per shape
    # class this role can hit, what it routes there and by what measured margin.
    routing_table: str = ""
    margins: tuple[str, ...] = ()

    @property
    def lossy(self) -> bool:
        """Whether the chosen backend under this spec approximates attention (quantised or block-sparse)."""
        return get_backend_class(self.backend).is_lossy(self.spec)

    def quality_note(self) -> str:
        """One line on what a lossy choice approximates, and how to measure it."""
        if not self.lossy:
            return "exact"
        spec = self.spec
        if spec is not None and spec.quant is not None:
            what = f"quantised ({self.backend} quant {spec.quant.dtype_qk}/{spec.quant.dtype_vo})"
        elif spec is not None and spec.block_sparse is not None:
            what = f"block-sparse ({self.backend} {spec.block_sparse.describe()})"
        else:
            what = f"lossy kernel ({self.backend})"
        return f"{what}; measure against an exact config with `diffusers-omni align --a ... --b TORCH_SDPA`"

    def describe_backend(self) -> str:
        if not self.shape_routed:
            return self.backend
        return f"{self.backend}, shape-routed to {', '.join(self.shape_routed)} where the routing table ranks them first"

    def to_dict(self) -> dict:
        return {
            "role": self.role,
            "category": self.category,
            "backend": self.backend,
            "shape_routed": list(self.shape_routed),
            "routing_table": self.routing_table,
            "margins": list(self.margins),
            "source": self.source,
            "lossy": self.lossy,
            "spec": self.spec.to_dict() if self.spec else None,
            "call": self.call.describe(),
            "rejected": [c.to_dict() for c in self.candidates if c.reasons],
        }


def require_plan(plan: Any, where: str) -> AttentionPlan:
    """``plan`` when it is an ``AttentionPlan``; else a ``TypeError`` naming ``where``: below the entry points
    (``apply_attention``, ``enable_omni_attention``, ``resolve``, the CLI), which parse a config once, everything
    takes the plan."""
    if not isinstance(plan, AttentionPlan):
        raise TypeError(
            f"{where} takes an AttentionPlan, got {type(plan).__name__}; build one once at the entry point with "
            "AttentionPlan.build(config)"
        )
    return plan


def select_spec(plan: AttentionPlan, role: str, category: str) -> tuple[AttentionSpec | None, str]:
    """The configured spec for a role and a label for where it came from (``None`` → platform default)."""
    return require_plan(plan, "select_spec").spec_for(role, category)


def check_per_role_keys(
    plan: AttentionPlan,
    declared: Iterable[tuple[str, str]],
    present: Iterable[tuple[str, str]],
    owner: str,
) -> None:
    """Match the ``per_role`` keys of ``plan``'s config against a model's roles, as ``select_spec`` will.

    Args:
        declared: ``(role, category)`` pairs the model's architecture declares.
        present: ``(role, category)`` pairs of the attention calls the model makes now.
        owner: the model(s), for messages (e.g. ``"FluxTransformer2DModel"``).

    Raises ``ValueError`` for a key that names no declared or present role or category, with "did you mean" for
    near misses and the roles and categories it could have named: such a key would otherwise be ignored. A key
    naming only roles the architecture declares but the model does not use now (FLUX's ``"cross"`` is its IP-Adapter
    role, present once an IP-Adapter is loaded) is accepted with a warning, once per key and owner.
    """
    config = require_plan(plan, "check_per_role_keys").config
    if not config.per_role:
        return
    present = set(present)
    known = set(declared) | present
    roles = sorted({role for role, _ in known})
    categories = sorted({category for _, category in known})
    vocabulary = sorted(set(roles) | set(categories))
    unknown = [key for key in config.per_role if key not in vocabulary]
    if unknown:
        described = []
        for key in unknown:
            close = difflib.get_close_matches(key, vocabulary, n=3, cutoff=0.7)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            described.append(f"{key!r}{hint}")
        raise ValueError(
            f"per_role key(s) {', '.join(described)} match no attention role or category of {owner}, so they would "
            f"be ignored; roles: {', '.join(roles) or 'none'}; categories: {', '.join(categories) or 'none'}"
        )
    in_use = {role for role, _ in present} | {category for _, category in present}
    for key in config.per_role:
        if key in in_use or (key, owner) in _warned_keys:
            continue
        _warned_keys.add((key, owner))
        serves = sorted(role for role, category in known if key in (role, category))
        logger.warning(
            "per_role[%r] matches no attention call %s makes now; it will apply to %s when such calls appear "
            "(e.g. after loading an IP-Adapter, or during a PAG call)",
            key,
            owner,
            ", ".join(serves),
        )


_warned_keys: set[tuple[str, str]] = set()


def _platform_default(call: AttentionCall, platform: Platform) -> tuple[str, tuple[Candidate, ...]]:
    candidates = []
    for route in platform_routes(platform):
        failed = failed_conditions(route, platform, call)
        reasons = [f"routing condition {name!r} does not hold" for name in failed]
        if not reasons:
            reasons = get_backend_class(route.backend).not_supported_reasons(call, platform)
        candidates.append(Candidate(route.backend, tuple(reasons)))
        if not reasons:
            return route.backend, tuple(candidates)
    lines = "; ".join(f"{c.backend}: {' / '.join(c.reasons)}" for c in candidates)
    raise BackendNotSupportedError(f"no attention backend can run {call.describe()} on {platform.describe()}: {lines}")


@functools.lru_cache(maxsize=1024)
def _resolve_cached(
    spec: AttentionSpec | None, where: str, role: str, category: str, call: AttentionCall, platform: Platform
) -> Resolution:
    if spec is not None and not spec.is_auto:
        backend_cls = get_backend_class(spec.backend)
        reasons = backend_cls.not_supported_reasons(call, platform)
        if reasons:
            raise BackendNotSupportedError(
                f"attention backend {spec.backend} (from {where}) cannot run role {role!r} "
                f"({call.describe()}) on {platform.describe()}:\n  - " + "\n  - ".join(reasons)
            )
        return Resolution(role, category, spec.backend, spec, where, call, (Candidate(spec.backend, ()),))
    backend, candidates = _platform_default(call, platform)
    source = f"platform default ({platform.describe()})"
    if spec is not None:
        source = f"{where} auto → {source}"
    table = active_table(platform)
    available = _routable(table, call, platform)
    routed = ranked_alternatives(table, platform.family, call.head_dim, call.has_mask, backend, available)
    margins = route_margins(table, platform.family, call.head_dim, call.has_mask, backend, available)
    return Resolution(role, category, backend, spec, source, call, candidates, routed, table_label(table), margins)


def _routable(table: dict, call: AttentionCall, platform: Platform):
    """Which backends a routing table may send this call to: registered here (the table may name a backend this
    build lacks), able to run the call, and exact unless the table is a tuned one made with ``allow_lossy``."""
    lossy_ok = lossy_allowed(table)

    def available(name: str) -> bool:
        if not is_registered(name):
            return False
        backend_cls = get_backend_class(name)
        if backend_cls.is_lossy(None) and not lossy_ok:
            return False
        return not backend_cls.not_supported_reasons(call, platform)

    return available


_logged: set[tuple[str, str, str]] = set()
_cached_generation = registry_generation()


def resolve(
    config: "AttentionConfig | AttentionPlan | None",
    role: str,
    category: str,
    call: AttentionCall,
    platform: Platform | None = None,
) -> Resolution:
    """Resolve the backend for one attention role: the public entry. ``config``: anything ``AttentionConfig.parse``
    accepts, or an ``AttentionPlan``; it is checked into a plan once here (on ``platform`` when given) and the role
    resolved from it (``resolve_role``)."""
    return resolve_role(AttentionPlan.build(config, platform), role, category, call)


def resolve_role(plan: AttentionPlan, role: str, category: str, call: AttentionCall) -> Resolution:
    """Resolve the backend for one attention role from a plan (on the plan's platform). Logs each (role, backend,
    source) once at INFO."""
    require_plan(plan, "resolve_role")
    if _cached_generation != registry_generation():  # a backend was registered or reset since
        clear_resolution_cache()
    spec, where = plan.spec_for(role, category)
    resolution = _resolve_cached(spec, where, role, category, call, plan.platform)
    key = (role, resolution.describe_backend(), resolution.source)
    if key not in _logged:
        _logged.add(key)
        logger.info("attention role %r → %s (%s)", role, resolution.describe_backend(), resolution.source)
    return resolution


def clear_resolution_cache() -> None:
    global _cached_generation
    _cached_generation = registry_generation()
    _resolve_cached.cache_clear()
    _logged.clear()
    _warned_keys.clear()
    clear_logged()
