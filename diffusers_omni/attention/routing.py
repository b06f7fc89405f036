"""Routing policy: which backend serves a platform-default role.

Platform routes: each platform family has an ordered list of candidate backends; a candidate may carry conditions,
named by the predicates in ``ROUTE_CONDITIONS``. The selector walks the list and takes the first candidate whose
conditions hold and which reports no ``not_supported_reasons`` for the call.

Shape routes, from a data table derived from committed benchmark results: the KV length of a call is only known at
call time, so a ``ShapeRouter`` holds the candidate backends that can run a role and picks one per call signature
``(q bucket, kv bucket, head_dim, masked, needs gradients)``: the first call with a signature reads
``routing_table.json`` (written by ``python -m benchmarks.derive_routing``), later calls are a dict lookup.
Signatures the table does not cover go to the first candidate (the platform route's own choice), and calls that
need gradients only go to candidates with a backward (FlashInfer prefill and ``fa3-fwd`` have none).

Which table decides: a table tuned on this GPU (``diffusers-omni tune``, ``attention.tuning``) when one measured in
this exact environment is in the cache, the shipped ``routing_table.json`` otherwise (``active_table``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .backends.base import AttentionCall
from .backends.flash import flash_attention_implementations, use_fp8_rules
from .platform import Platform
from .tuning import TABLE_FORMAT, tuned_table

TABLE_PATH = Path(__file__).with_name("routing_table.json")
# Upper bounds of the sequence-length buckets (tokens); longer sequences fall in the last bucket.
BUCKET_EDGES = (1024, 8192, 40960)


def length_bucket(n: int) -> int:
    for i, edge in enumerate(BUCKET_EDGES):
        if n <= edge:
            return i
    return len(BUCKET_EDGES)


def rule_key(q_len: int, kv_len: int, head_dim: int, masked: bool) -> str:
    return f"q{length_bucket(q_len)}/kv{length_bucket(kv_len)}/d{head_dim}/{'masked' if masked else 'dense'}"


@functools.lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict:
    return json.loads(Path(path or TABLE_PATH).read_text())


def active_table(platform: Platform | None = None) -> dict:
    """The routing table that decides on ``platform``: the one tuned on this GPU in this environment if the cache has
    it, else the shipped table."""
    tuned = tuned_table(platform)
    return tuned if tuned is not None else load_table()


def is_tuned(table: dict) -> bool:
    return table.get("format") == TABLE_FORMAT


def table_label(table: dict) -> str:
    """Which table this is, for ``explain`` and reports."""
    if is_tuned(table):
        return f"tuned on this machine {table.get('date', '')} ({table.get('path', 'cache')})"
    return f"shipped {TABLE_PATH.name} ({'; '.join(table.get('sources', [])) or 'no measurements'})"


def lossy_allowed(table: dict) -> bool:
    """Whether the table may route to lossy backends: only a tuned table made with ``allow_lossy``."""
    return bool(is_tuned(table) and table.get("allow_lossy"))


def pick(rule: dict, usable, preferred: str | None, tolerance: float) -> str | None:
    """The first backend of ``rule``'s ranking that ``usable(name)`` accepts; ``preferred`` instead when it is usable
    and within ``tolerance`` of that one (the ranking's own tie rule, applied to what is installed here)."""
    ranking = rule.get("ranking") or ()
    best = next((name for name in ranking if usable(name)), None)
    if best is None or preferred is None or preferred == best or not usable(preferred):
        return best
    ratios = rule.get("worst_ratio", {})
    if preferred in ratios and best in ratios and ratios[preferred] >= (1 - tolerance) * ratios[best]:
        return preferred
    return best


def table_choice(table: dict, family: str, q_len: int, kv_len: int, head_dim: int, masked: bool,
                 candidates, preferred: str | None = None) -> str | None:
    """The table's choice for this shape class among ``candidates``; ``None`` when the class is not covered."""
    rule = table.get("families", {}).get(family, {}).get(rule_key(q_len, kv_len, head_dim, masked))
    if not rule:
        return None
    return pick(rule, lambda name: name in candidates, preferred, table.get("tolerance", 0.03))


def fp8_choice(table: dict, family: str, q_len: int, kv_len: int, head_dim: int, masked: bool) -> bool:
    """Whether an explicit FP8 ``FLASH_ATTN`` spec runs this shape class in FP8: only classes where the committed
    measurement found the whole FP8 call (quantisation included) faster than FA3 bf16 at every measured shape.
    Classes the table does not cover stay bf16."""
    rule = table.get("fp8", {}).get(family, {}).get(rule_key(q_len, kv_len, head_dim, masked))
    return bool(rule and rule.get("fp8"))


def ranked_alternatives(table: dict, family: str, head_dim: int | None, may_mask: bool, base: str,
                        available) -> tuple[str, ...]:
    """Backends other than ``base`` that the table ranks first (among ``base`` and those ``available(name)``
    accepts) in some measured class this role can hit: its head dim, dense classes, and masked ones when the
    role may pass a mask. Empty when the table agrees with ``base`` everywhere the role can go."""
    rules = table.get("families", {}).get(family, {})
    kinds = ("dense", "masked") if may_mask else ("dense",)
    tolerance = table.get("tolerance", 0.03)
    chosen: list[str] = []
    for key, rule in rules.items():
        if head_dim is None or not key.endswith(tuple(f"/d{head_dim}/{kind}" for kind in kinds)):
            continue
        first = pick(rule, lambda n: n == base or available(n), base, tolerance)
        if first is not None and first != base and first not in chosen:
            chosen.append(first)
    return tuple(chosen)


def route_margins(table: dict, family: str, head_dim: int | None, may_mask: bool, base: str, available) -> tuple[str, ...]:
    """For every measured shape class this role can hit: the backend the table routes it to and by how much it led
    the runner-up there (its worst ratio over the class's shapes), e.g. ``q1/kv1/d128/dense → FLASH_ATTN (next:
    TORCH_SDPA at 0.94×)``."""
    rules = table.get("families", {}).get(family, {})
    kinds = ("dense", "masked") if may_mask else ("dense",)
    tolerance = table.get("tolerance", 0.03)
    lines = []
    for key, rule in sorted(rules.items()):
        if head_dim is None or not key.endswith(tuple(f"/d{head_dim}/{kind}" for kind in kinds)):
            continue
        usable = lambda n: n == base or available(n)  # noqa: E731
        first = pick(rule, usable, base, tolerance)
        if first is None:
            continue
        ratios = rule.get("worst_ratio", {})
        others = [n for n in rule.get("ranking", ()) if n != first and usable(n)]
        note = ""
        if others and first in ratios and others[0] in ratios and ratios[first]:
            note = f" (next: {others[0]} at {ratios[others[0]] / ratios[first]:.2f}×)"
        elif not others:
            note = " (the only one measured here)"
        lines.append(f"{key} → {first}{note}")
    return tuple(lines)


def sparse_dense_above(family: str, q_len: int, kv_len: int, head_dim: int) -> float | None:
    """Block-sparse calls of this shape class that keep more than this share of their key blocks are slower than
    dense attention on ``family``: the break-even the committed measurement of sparse against dense kernel time
    derived (``sparse`` in the shipped table, ``python -m benchmarks.derive_routing --sparse``); ``None`` where
    nothing was measured."""
    rule = load_table().get("sparse", {}).get(family, {}).get(rule_key(q_len, kv_len, head_dim, False))
    return rule.get("dense_above_kept_share") if rule else None


def lossy_key(backend: str, spec) -> str:
    """The name a lossy setting's measurements are filed under in the table's ``lossy`` section."""
    if spec is not None and getattr(spec, "quant", None) is not None:
        return f"{backend} {spec.quant.dtype_qk}"
    sparse = getattr(spec, "block_sparse", None) if spec is not None else None
    if sparse is not None:
        if sparse.mass_threshold is not None:
            return f"{backend} mass_threshold={sparse.mass_threshold}"
        return f"{backend} sparsity={sparse.sparsity}"
    return backend


def measured_error(backend: str, spec) -> str:
    """What the committed measurement says this lossy setting costs: the relative error of the whole transformer
    output against Diffusers' native attention and the step time against the fastest exact configuration, per
    measured model (``lossy`` in the shipped table, from ``benchmarks/results/tune_h200.json``); a sentence saying
    that nothing was measured otherwise."""
    entries = load_table().get("lossy", {}).get(lossy_key(backend, spec), [])
    if not entries:
        return (f"no committed measurement of {lossy_key(backend, spec)}; measure it on your pipeline with "
                "`diffusers-omni compare`")
    parts = []
    for entry in entries:
        speed = ""
        if entry.get("step_s") and entry.get("exact_step_s"):
            speed = f", step {entry['exact_step_s'] / entry['step_s']:.2f}× the fastest exact one"
        exact = f" (exact FLASH_ATTN bf16: {entry['exact_rel_err']:.1%})" if entry.get("exact_rel_err") else ""
        parts.append(f"{entry['rel_err']:.1%} relative error of the whole transformer output vs Diffusers' native "
                     f"attention{exact}{speed} ({entry['model']})")
    return "measured " + "; ".join(parts) + f" [{entries[0].get('source', 'committed run')}]"


def sparse_rules(family: str) -> dict:
    """Every measured break-even of ``family`` by shape class (for ``explain``)."""
    return dict(load_table().get("sparse", {}).get(family, {}))


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


@dataclass(frozen=True)
class Route:
    """One candidate in a platform's default list, taken only when every named condition holds."""

    backend: str
    when: tuple[str, ...] = ()
    why: str = ""


def _flash_attn_3_or_4_importable(platform: Platform, call: AttentionCall) -> bool:
    return any(impl in ("FA3", "FA4") for impl in flash_attention_implementations())


ROUTE_CONDITIONS: dict[str, Callable[[Platform, AttentionCall], bool]] = {
    "model_declares_mask_free_path": lambda platform, call: call.mask_free_path and not call.has_mask,
    "head_dim_128": lambda platform, call: call.head_dim == 128,
    "cudnn_at_least_9_5": lambda platform, call: (platform.cudnn_version or 0) >= 90500,
    "flash_attn_3_or_4_importable": _flash_attn_3_or_4_importable,
}

_BLACKWELL_TAIL = (
    Route("CUDNN_ATTN", when=("cudnn_at_least_9_5",)),
    Route("FLASHINFER_ATTN"),
    Route("FLASH_ATTN"),
    Route("TORCH_SDPA"),
)

# Hopper's route is TORCH_SDPA (unpinned SDPA lands on cuDNN: benchmarks/results/attention_h200.md), and no single
# kernel wins every shape there: FlashAttention-3 leads on long unmasked self-attention, FlashInfer on short masked
# sequences, SDPA at head_dim 64. Those per-shape choices come from routing_table.json (selector._shape_routes →
# routing.ShapeRouter), derived from committed H200 results, not from this list.
_HOPPER_WHY = "the reference kernel; measured shape classes are routed per routing_table.json"

PLATFORM_ROUTES: dict[str, tuple[Route, ...]] = {
    "blackwell_datacenter": (
        Route(
            "TRTLLM_ATTN",
            when=("model_declares_mask_free_path", "head_dim_128"),
            why="trtllm-gen FMHA on datacenter Blackwell for mask-free head_dim 128 paths",
        ),
        *_BLACKWELL_TAIL,
    ),
    "blackwell_workstation": _BLACKWELL_TAIL,
    "hopper": (Route("TORCH_SDPA", why=_HOPPER_WHY),),
    "ada": (
        Route("FLASH_ATTN", when=("flash_attn_3_or_4_importable",)),
        Route("TORCH_SDPA"),
    ),
    "ampere": (
        Route("FLASH_ATTN", when=("flash_attn_3_or_4_importable",)),
        Route("TORCH_SDPA"),
    ),
    "cuda": (Route("TORCH_SDPA"),),
    "cpu": (Route("TORCH_SDPA"),),
    "mps": (Route("TORCH_SDPA"),),
}


def platform_routes(platform: Platform) -> tuple[Route, ...]:
    return PLATFORM_ROUTES.get(platform.family, PLATFORM_ROUTES["cpu"])


def failed_conditions(route: Route, platform: Platform, call: AttentionCall) -> list[str]:
    return [name for name in route.when if not ROUTE_CONDITIONS[name](platform, call)]


use_fp8_rules(lambda family, q_len, kv_len, head_dim: fp8_choice(load_table(), family, q_len, kv_len, head_dim, False))
