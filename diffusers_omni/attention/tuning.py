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

import logging

import torch

from ..utils.versions import installed_version
from .platform import Platform, current_platform, detected_platform

ENV_CACHE_DIR = "DIFFUSERS_OMNI_CACHE_DIR"
TABLE_FORMAT = "diffusers-omni tuned routing table v1"
logger = logging.getLogger("diffusers_omni.attention.tuning")
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
    environment (``environment_key``) is in the cache; ``None`` otherwise (a simulated platform never has one).

    A cache file that cannot be used (unreadable, not UTF-8 text, empty, truncated or nested past the JSON reader's
    limit, not a table, another format, measured in another environment, or with fields routing cannot read) is
    named in one warning and the shipped table decides."""
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
            table, problem = _read_table(path, key)
            if problem is None:
                table["path"] = str(path)
                _tuned = table
            elif str(path) not in _warned:
                _warned.add(str(path))
                logger.warning("ignoring the tuned routing table %s: %s; the shipped table decides (`diffusers-omni "
                               "tune` measures and rewrites it, `diffusers-omni tune --clear` removes it)", path,
                               problem)
    return _tuned


# Unusable cache files already named since the cache was last (re)read: one warning per file.
_warned: set[str] = set()


def _read_table(path: Path, key: Mapping) -> tuple[dict | None, str | None]:
    """The table in ``path`` and ``None``, or ``None`` and why it cannot be used here."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, f"it cannot be read ({exc.strerror or exc})"
    if not data.strip():
        return None, "the file is empty"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "it is not text (not UTF-8: a binary file)"
    try:
        table = json.loads(text)
    except RecursionError:
        return None, "its JSON nests too deeply to be a routing table"
    except ValueError as exc:
        return None, f"it is not valid JSON, e.g. truncated ({exc})"
    return (table, None) if (problem := table_problem(table, key)) is None else (None, problem)


def table_problem(table: object, key: Mapping | None = None) -> str | None:
    """Why ``table`` cannot serve as this environment's tuned table (``key``: the environment it must have been
    measured in), or ``None``: the fields routing reads have the types it reads them as."""
    if not isinstance(table, dict):
        return f"it holds a JSON {_json_type(table)}, not a table (an object)"
    if table.get("format") != TABLE_FORMAT:
        return (f"its format is {table.get('format')!r}, not {TABLE_FORMAT!r} (written by another version of "
                "diffusers-omni)")
    if key is not None and table.get("key") != key:
        stored = table.get("key") if isinstance(table.get("key"), dict) else {}
        differ = sorted(name for name in set(key) | set(stored) if stored.get(name) != key.get(name))
        return f"it was measured in another environment (differs in: {', '.join(differ) or 'key'})"
    families = table.get("families")
    if not isinstance(families, dict):
        return f"'families' is a JSON {_json_type(families)}, expected an object of platform families"
    for family, rules in families.items():
        if not isinstance(rules, dict):
            return f"'families.{family}' is a JSON {_json_type(rules)}, expected an object of shape classes"
        for rule_key, rule in rules.items():
            where = f"'families.{family}.{rule_key}"
            if not isinstance(rule, dict):
                return f"{where}' is a JSON {_json_type(rule)}, expected an object"
            ranking = rule.get("ranking")
            if not isinstance(ranking, list) or not all(isinstance(name, str) for name in ranking):
                return f"{where}.ranking' is a JSON {_json_type(ranking)}, expected a list of backend names"
            for field_name in ("worst_ratio", "kernel_worst_ratio", "in_model_seconds"):
                values = rule.get(field_name, {})
                if not isinstance(values, dict) or not all(_is_number(v) for v in values.values()):
                    return f"{where}.{field_name}' is not an object of numbers"
    tolerance = table.get("tolerance", 0.0)
    if not _is_number(tolerance) or not 0 <= tolerance < 1:
        return f"'tolerance' is {tolerance!r}, expected a number from 0 to below 1"
    if not isinstance(table.get("allow_lossy", False), bool):
        return f"'allow_lossy' is {table.get('allow_lossy')!r}, expected true or false"
    return None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value: object) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def forget_tuned_table() -> None:
    """Read the cache again on the next ``tuned_table`` call (after ``tune`` wrote one, or a version changed)."""
    global _tuned, _tuned_read
    _tuned, _tuned_read = None, False
    _warned.clear()


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


class CacheNotWritable(OSError):
    """The cache directory of tuned tables cannot be written; the message names ``DIFFUSERS_OMNI_CACHE_DIR``."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


def check_cache_writable() -> Path:
    """The folder tuned tables are written to, created if missing and checked writable (``tune`` calls this before
    measuring anything); ``CacheNotWritable`` naming the folder and ``DIFFUSERS_OMNI_CACHE_DIR`` otherwise."""
    import tempfile

    folder = cache_dir() / "routing"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if isinstance(exc, (NotADirectoryError, FileExistsError)):
            reason = "a file stands where a folder is needed"
        source = (f"{ENV_CACHE_DIR}={os.environ[ENV_CACHE_DIR]}" if os.environ.get(ENV_CACHE_DIR, "").strip()
                  else f"the default cache {cache_dir()}")
        raise CacheNotWritable(f"cannot write tuned routing tables under {folder} ({reason}; from {source}); set "
                               f"{ENV_CACHE_DIR} to a writable folder") from None
    return folder


def save_table(table: dict) -> Path:
    """Write ``table`` to its cache file (atomically) and make this process use it."""
    path = table_path(table["key"])
    check_cache_writable()
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
