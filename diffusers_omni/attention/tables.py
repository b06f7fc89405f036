"""The routing table: measured rankings per platform family and call-shape class, read by the families that route
on them.

``routing_table.json`` (written by ``python -m benchmarks.derive_routing`` from committed benchmark results) holds,
per platform family and shape class ``q<bucket>/kv<bucket>/d<head_dim>/<dense|masked>``: the backends ranked by
measured speed (``families``), whether FLASH_ATTN's FP8 pays off (``fp8``, read by the flash family), the kept
share above which block-sparse is slower than dense (``sparse``, read by the RainFusion family) and what each lossy
setting measured (``lossy``). A table tuned on this GPU (``diffusers-omni tune``, ``attention.tuning``) replaces the
``families`` rankings when one measured in this exact environment is in the cache (``active_table``).

Kernel independent and shared: ``routing.ShapeRouter``, the flash family's FP8 rule, the RainFusion family's
break-even and the installer's lossy report all read it here.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from .tuning import TABLE_FORMAT, tuned_table

if TYPE_CHECKING:
    from .platform import Platform

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
    measured model (``lossy`` in the shipped table, from ``benchmarks/results/tune/latest.json``); a sentence saying
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
