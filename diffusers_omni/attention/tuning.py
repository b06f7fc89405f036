"""Routing tables measured on the user's own GPU: timing, derivation and the per-environment cache.

``diffusers-omni tune`` (``installer.tune_attention``) records the attention calls a model really makes, then this
module times every candidate backend at each recorded shape (warm-up, then repeats interleaved across backends so
that clock and thermal drift hit every candidate alike), ranks them per shape class exactly like the shipped
``routing_table.json`` and writes the table to the user's cache directory, keyed by everything that can change a
kernel's speed: GPU name, compute capability, CUDA driver and runtime, cuDNN, torch and every kernel package version.
``routing.active_table`` prefers a tuned table whose key matches this process; any change of the key (a new driver,
a new FlashInfer) makes the table stale and the shipped one decides again until ``tune`` runs again.

Lossy backends (quantised or block-sparse) are timed and ranked only when tuning was asked to allow them
(``allow_lossy``); the table records that choice, and routing never takes a lossy backend from a table that did not
allow it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping

import torch

from ..utils.versions import installed_version
from .platform import Platform, current_platform, detected_platform

ENV_CACHE_DIR = "DIFFUSERS_OMNI_CACHE_DIR"
TABLE_FORMAT = "diffusers-omni tuned routing table v1"
# Distributions whose version changes a kernel's speed (any of them changing invalidates a tuned table).
KERNEL_DISTRIBUTIONS = (
    "fa3-fwd",
    "flash-attn",
    "flash-attn-3",
    "flash-attn-4",
    "flashinfer-python",
    "flashinfer-cubin",
    "sageattention",
    "triton",
    "kernels",
)
# A backend within this share of the fastest keeps its place when it is the platform route's own choice (the shipped
# table uses 3%; tuned tables are measured on this very machine, so only run-to-run noise needs absorbing).
TUNED_TOLERANCE = 0.01


def cache_dir() -> Path:
    """Where tuned tables live: ``$DIFFUSERS_OMNI_CACHE_DIR``, else ``$XDG_CACHE_HOME/diffusers-omni``, else
    ``~/.cache/diffusers-omni``."""
    explicit = os.environ.get(ENV_CACHE_DIR, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "diffusers-omni"


def _driver_version() -> str | None:
    """The CUDA driver's API version (e.g. ``13000``), or ``None`` without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    try:
        import ctypes

        version = ctypes.c_int()
        libcuda = ctypes.CDLL("libcuda.so.1")
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return str(version.value)
    except OSError:
        pass
    return None


def environment_key(platform: Platform | None = None) -> dict:
    """Everything a tuned table's timings depend on, for ``platform`` (default: the detected one)."""
    platform = platform or detected_platform()
    return {
        "device_type": platform.device_type,
        "device_name": platform.device_name,
        "compute_capability": platform.sm,
        "cudnn": platform.cudnn_version,
        "cuda_runtime": torch.version.cuda if platform.device_type == "cuda" else None,
        "cuda_driver": _driver_version() if platform.device_type == "cuda" else None,
        "torch": torch.__version__,
        "packages": {name: installed_version(name) for name in KERNEL_DISTRIBUTIONS},
    }


def key_digest(key: Mapping) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def table_path(key: Mapping) -> Path:
    """The cache file of a tuned table for ``key``: one file per environment, named after the GPU and the key."""
    label = re.sub(r"[^A-Za-z0-9]+", "-", f"{key.get('device_name') or key.get('device_type')}").strip("-").lower()
    sm = key.get("compute_capability") or key.get("device_type")
    return cache_dir() / "routing" / f"{label}-{sm}-{key_digest(key)}.json"


# The tuned table of this process's environment, read once (``forget_tuned_table`` after writing or to re-read).
_tuned: dict | None = None
_tuned_read = False


def tuned_table(platform: Platform | None = None) -> dict | None:
    """The tuned table for ``platform`` if it is the GPU this process runs on and a table measured in this exact
    environment (``environment_key``) is in the cache; ``None`` otherwise (a simulated platform never has one)."""
    global _tuned, _tuned_read
    platform = platform or current_platform()
    if platform != detected_platform():
        return None
    if not _tuned_read:
        _tuned_read = True
        key = environment_key(platform)
        path = table_path(key)
        _tuned = None
        if path.is_file():
            try:
                table = json.loads(path.read_text())
            except (OSError, ValueError):
                table = None
            if isinstance(table, dict) and table.get("format") == TABLE_FORMAT and table.get("key") == key:
                table["path"] = str(path)
                _tuned = table
    return _tuned


def forget_tuned_table() -> None:
    """Read the cache again on the next ``tuned_table`` call (after ``tune`` wrote one, or a version changed)."""
    global _tuned, _tuned_read
    _tuned, _tuned_read = None, False


@contextlib.contextmanager
def use_tuned_table(table: dict):
    """Route by ``table`` as this machine's tuned table inside the block (tune's in-model verification)."""
    global _tuned, _tuned_read
    saved = (_tuned, _tuned_read)
    _tuned, _tuned_read = table, True
    try:
        yield table
    finally:
        _tuned, _tuned_read = saved


def near_ties(rule: dict, margin: float, routable: Callable[[str], bool]) -> list[str]:
    """The backends of a rule within ``margin`` of its best kernel time (those worth timing inside the model)."""
    ratios = rule.get("worst_ratio", {})
    names = [n for n in rule.get("ranking", ()) if routable(n) and n in ratios]
    if not names:
        return []
    best = ratios[names[0]]
    return [n for n in names if ratios[n] >= (1 - margin) * best]


# Measuring ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallShape:
    """One attention call as a model makes it: ``[batch, q_len, heads, head_dim]`` queries against ``kv_len`` keys."""

    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    masked: bool = False
    roles: tuple[str, ...] = ()

    @property
    def signature(self) -> tuple:
        return (self.batch, self.q_len, self.kv_len, self.heads, self.kv_heads, self.head_dim, self.dtype, self.masked)

    def describe(self) -> str:
        mask = ", masked" if self.masked else ""
        heads = f"{self.heads}" if self.kv_heads == self.heads else f"{self.heads}/{self.kv_heads}"
        return (f"B{self.batch} q{self.q_len} kv{self.kv_len} H{heads} d{self.head_dim} {self.dtype}{mask}"
                f" ({', '.join(self.roles)})")

    def flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim


@dataclass
class ShapeTiming:
    shape: CallShape
    seconds: dict[str, float] = field(default_factory=dict)  # backend → median seconds per call
    failed: dict[str, str] = field(default_factory=dict)  # backend → why it could not run this shape

    def to_dict(self) -> dict:
        return {"shape": asdict(self.shape), "describe": self.shape.describe(),
                "seconds": {k: round(v, 9) for k, v in self.seconds.items()}, "failed": dict(self.failed)}


def _inputs(shape: CallShape, device, mask: torch.Tensor | None, generator: torch.Generator):
    dtype = getattr(torch, shape.dtype)

    def rand(length: int, heads: int) -> torch.Tensor:
        return torch.randn(shape.batch, length, heads, shape.head_dim, device=device, dtype=dtype,
                           generator=generator)

    q, k, v = rand(shape.q_len, shape.heads), rand(shape.kv_len, shape.kv_heads), rand(shape.kv_len, shape.kv_heads)
    return q, k, v, (mask.to(device) if mask is not None else None)


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    if device.type == "cuda":
        def timed(fn, inner: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0 / inner
    else:
        def timed(fn, inner: int) -> float:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - t0) / inner
    return timed


def measure(shapes: list[tuple[CallShape, torch.Tensor | None]], candidates: Callable[[CallShape], dict],
            device, *, warmup: int = 3, repeats: int = 7, min_seconds: float = 0.002,
            progress: Callable[[str], None] | None = None) -> list[ShapeTiming]:
    """Time every candidate backend at every shape.

    Args:
        shapes: ``(shape, mask)`` pairs: the mask a recorded masked call passed (``None`` for unmasked calls).
        candidates: ``shape -> {name: backend instance}``, the backends that can run that shape.
        warmup: calls per backend before timing (JIT compilation, autotuning, allocator).
        repeats: timed rounds; each round times every backend once, in a rotated order, and the median round
            counts. A round runs enough calls to last ``min_seconds``.

    A backend that raises on a shape is recorded under ``failed`` with its error and never ranked there.
    """
    device = torch.device(device)
    timed = _timer(device)
    generator = torch.Generator(device=device).manual_seed(0)
    results = []
    for shape, mask in shapes:
        timing = ShapeTiming(shape)
        q, k, v, attn_mask = _inputs(shape, device, mask, generator)
        gqa = shape.kv_heads != shape.heads
        runs: dict[str, Callable[[], object]] = {}
        inner: dict[str, int] = {}
        with torch.inference_mode():
            for name, backend in candidates(shape).items():
                def call(backend=backend):
                    return backend(q, k, v, attn_mask, 0.0, False, None, gqa)

                try:
                    for _ in range(warmup):
                        call()
                    once = max(timed(call, 1), 1e-7)
                except Exception as exc:  # a backend that cannot run this shape is a result, not a crash
                    timing.failed[name] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                runs[name] = call
                inner[name] = max(1, min(100, int(min_seconds / once)))
            samples: dict[str, list[float]] = {name: [] for name in runs}
            names = list(runs)
            for round_index in range(repeats):
                shift = round_index % max(len(names), 1)
                for name in names[shift:] + names[:shift]:
                    samples[name].append(timed(runs[name], inner[name]))
        timing.seconds = {name: statistics.median(values) for name, values in samples.items()}
        if progress is not None:
            ranked = sorted(timing.seconds.items(), key=lambda item: item[1])
            progress(f"{shape.describe()}: " + ", ".join(f"{n} {s * 1e3:.3f} ms" for n, s in ranked))
        results.append(timing)
        del q, k, v, attn_mask
    return results


def derive_rules(timings: list[ShapeTiming], rule_key: Callable[[int, int, int, bool], str]) -> dict:
    """Per shape class, the measured backends ranked fastest first (by their worst ratio to the fastest over the
    class's shapes, weighted by nothing: every recorded shape counts), in the shipped table's format."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for timing in timings:
        if not timing.seconds:
            continue
        fastest = min(timing.seconds.values())
        key = rule_key(timing.shape.q_len, timing.shape.kv_len, timing.shape.head_dim, timing.shape.masked)
        per_backend = ratios.setdefault(key, {})
        for name, seconds in timing.seconds.items():
            per_backend.setdefault(name, []).append(fastest / seconds)
    rules = {}
    for key, per_backend in sorted(ratios.items()):
        # Only backends measured at every shape of the class are ranked (a backend that failed one shape is not
        # safe for the class).
        count = max(len(values) for values in per_backend.values())
        worst = {name: min(values) for name, values in per_backend.items() if len(values) == count}
        ranking = sorted(worst, key=lambda name: -worst[name])
        rules[key] = {"ranking": ranking, "worst_ratio": {name: round(worst[name], 4) for name in ranking}}
    return rules


def build_table(platform: Platform, timings: list[ShapeTiming], rule_key, *, allow_lossy: bool,
                shipped: Mapping, models: list[str], seconds: float) -> dict:
    """A tuned table for ``platform``: the shipped table's keys (``fp8``, ``sparse`` rules are kept from it: tuning
    measures exact routing) with ``families`` holding this machine's measured ranking."""
    table = {key: value for key, value in shipped.items() if key not in ("families", "sources", "path")}
    table.update({
        "format": TABLE_FORMAT,
        "key": environment_key(platform),
        "tolerance": TUNED_TOLERANCE,
        "allow_lossy": allow_lossy,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "models": models,
        "tune_seconds": round(seconds, 2),
        "sources": [f"tuned on {platform.device_name} ({platform.describe()}), torch {torch.__version__}"],
        "families": {platform.family: derive_rules(timings, rule_key)},
        "measured": [timing.to_dict() for timing in timings],
    })
    return table


def save_table(table: dict) -> Path:
    """Write ``table`` to its cache file (atomically) and make this process use it."""
    path = table_path(table["key"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(table, indent=2) + "\n")
    os.replace(tmp, path)
    forget_tuned_table()
    return path


def clear_tuned_tables() -> list[Path]:
    """Delete every tuned table in the cache directory; returns the files removed."""
    folder = cache_dir() / "routing"
    removed = sorted(folder.glob("*.json")) if folder.is_dir() else []
    for path in removed:
        path.unlink()
    forget_tuned_table()
    return removed
