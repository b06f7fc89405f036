"""Skip-Softmax calibration: the ``sparse_attention_config`` block of a transformer's ``config.json``.

NVIDIA ModelOpt writes a calibrated curve per group of attention modules. Each group holds:

- ``formula``: must be ``a*exp(b*target_sparsity)`` (whitespace ignored); any other formula is refused;
- ``coefficients``: ``a`` and ``b`` as a mapping (``{"a": ..., "b": ...}``) or a two-item list ``[a, b]``;
- ``ignore`` (optional): ``fnmatch`` patterns over module names (``"blocks.0.*"``); matching modules stay dense;
- ``targets`` (optional): ``fnmatch`` patterns of the modules the group covers (default: every module).

Groups sit either directly under ``sparse_attention_config`` or under its ``config_groups`` key; a top-level
``ignore`` list applies to every group. For a mixture-of-experts pipeline (Wan 2.2 A14B) the second expert's
calibration lives in ``transformer_2/config.json``.

λ (the Skip-Softmax threshold) at a target sparsity ``s`` is ``a * exp(b * s)``; the trtllm-gen kernel takes
``λ × kv_len`` as its ``skip_softmax_threshold_scale_factor`` (it divides by the KV length itself).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

FORMULA = "a*exp(b*target_sparsity)"
CONFIG_KEY = "sparse_attention_config"


class CalibrationError(ValueError):
    """A ``sparse_attention_config`` block is malformed, or a calibration is needed and missing."""


def _normalise_formula(text: str) -> str:
    return re.sub(r"\s+", "", text)


@dataclass(frozen=True)
class CalibrationGroup:
    name: str
    a: float
    b: float
    targets: tuple[str, ...] = ("*",)
    ignore: tuple[str, ...] = ()

    def covers(self, module_name: str) -> bool:
        return any(fnmatch.fnmatchcase(module_name, p) for p in self.targets)

    def ignores(self, module_name: str) -> bool:
        return any(fnmatch.fnmatchcase(module_name, p) for p in self.ignore)

    def threshold(self, target_sparsity: float) -> float:
        return self.a * math.exp(self.b * target_sparsity)


@dataclass(frozen=True)
class SkipSoftmaxCalibration:
    """A parsed ``sparse_attention_config``; ``source`` names the file it came from (for messages)."""

    groups: tuple[CalibrationGroup, ...]
    source: str = "<dict>"

    def group_for(self, module_name: str) -> CalibrationGroup | None:
        """The group covering ``module_name``, or ``None`` when it is ignored or covered by no group."""
        for group in self.groups:
            if group.covers(module_name):
                return None if group.ignores(module_name) else group
        return None

    def threshold(self, module_name: str, target_sparsity: float) -> float | None:
        """λ for ``module_name`` at ``target_sparsity``; ``None`` means the module stays dense."""
        group = self.group_for(module_name)
        return None if group is None else group.threshold(target_sparsity)


def _patterns(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise CalibrationError(f"{where} must be a list of fnmatch patterns (str), got {value!r}")
    return tuple(value)


def _coefficient(coefficients: Any, key: str, index: int, where: str) -> float:
    if isinstance(coefficients, Mapping):
        if key not in coefficients:
            raise CalibrationError(f"{where}.coefficients is missing {key!r}; found keys {sorted(coefficients)}")
        value = coefficients[key]
    elif isinstance(coefficients, (list, tuple)):
        if len(coefficients) != 2:
            raise CalibrationError(f"{where}.coefficients has {len(coefficients)} values; required: [a, b]")
        value = coefficients[index]
    else:
        raise CalibrationError(f"{where}.coefficients must be {{'a': .., 'b': ..}} or [a, b], got {coefficients!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CalibrationError(f"{where}.coefficients.{key}={value!r} must be a finite number")
    return float(value)


def parse_calibration(block: Any, source: str = "<dict>") -> SkipSoftmaxCalibration:
    """Validate a ``sparse_attention_config`` mapping and return its groups (raises ``CalibrationError``)."""
    where = f"{source}: {CONFIG_KEY}"
    if not isinstance(block, Mapping):
        raise CalibrationError(f"{where} must be a mapping, got {type(block).__name__}")
    global_ignore = _patterns(block.get("ignore"), f"{where}.ignore")
    raw_groups = block.get("config_groups", {k: v for k, v in block.items() if k != "ignore"})
    if not isinstance(raw_groups, Mapping) or not raw_groups:
        raise CalibrationError(f"{where} has no calibration groups; each needs 'formula' and 'coefficients'")
    groups = []
    for name, group in raw_groups.items():
        gwhere = f"{where}.{name}"
        if not isinstance(group, Mapping):
            raise CalibrationError(f"{gwhere} must be a mapping, got {type(group).__name__}")
        formula = group.get("formula")
        if formula is None:
            raise CalibrationError(f"{gwhere} is missing 'formula'; required: {FORMULA!r}")
        if not isinstance(formula, str) or _normalise_formula(formula) != FORMULA:
            raise CalibrationError(f"{gwhere}.formula={formula!r} is not supported; required: {FORMULA!r}")
        if "coefficients" not in group:
            raise CalibrationError(f"{gwhere} is missing 'coefficients'; required: a and b of {FORMULA!r}")
        a = _coefficient(group["coefficients"], "a", 0, gwhere)
        b = _coefficient(group["coefficients"], "b", 1, gwhere)
        if a < 0:
            raise CalibrationError(f"{gwhere}.coefficients.a={a!r} must be >= 0 (λ is a non-negative threshold)")
        targets = _patterns(group.get("targets"), f"{gwhere}.targets") or ("*",)
        ignore = global_ignore + _patterns(group.get("ignore"), f"{gwhere}.ignore")
        groups.append(CalibrationGroup(str(name), a, b, targets, ignore))
    return SkipSoftmaxCalibration(tuple(groups), source)


def load_calibration_file(path: str | os.PathLike) -> SkipSoftmaxCalibration | None:
    """Parse ``config.json`` at ``path``; ``None`` when it has no ``sparse_attention_config``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path} is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(data, Mapping) or CONFIG_KEY not in data:
        return None
    return parse_calibration(data[CONFIG_KEY], source=str(path))


def load_pipeline_calibrations(pipeline_dir: str | os.PathLike) -> dict[str, SkipSoftmaxCalibration]:
    """Calibrations of a pipeline folder: ``transformer`` and, for a second expert, ``transformer_2``."""
    out = {}
    for component in ("transformer", "transformer_2"):
        path = Path(pipeline_dir) / component / "config.json"
        if path.is_file():
            calibration = load_calibration_file(path)
            if calibration is not None:
                out[component] = calibration
    return out


_ATTACHED = "_omni_skip_softmax_calibration"


def attach_calibration(model: Any, calibration: SkipSoftmaxCalibration | Mapping | None) -> None:
    """Give ``model`` a calibration explicitly (e.g. one not stored next to its weights)."""
    if isinstance(calibration, Mapping):
        calibration = parse_calibration(calibration, source=f"attached to {type(model).__name__}")
    setattr(model, _ATTACHED, calibration)


def calibration_for_model(model: Any) -> SkipSoftmaxCalibration | None:
    """The calibration of a loaded transformer: attached explicitly, in its config, or in the ``config.json`` of
    the folder it was loaded from (``config._name_or_path``; for a second expert that folder is
    ``transformer_2``). ``None`` when none is found."""
    attached = getattr(model, _ATTACHED, None)
    if attached is not None:
        return attached
    config = getattr(model, "config", None)
    if config is None:
        return None
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    block = get(CONFIG_KEY, None)
    if block is not None:
        return parse_calibration(block, source=f"{type(model).__name__}.config")
    name_or_path = get("_name_or_path", None)
    if name_or_path and Path(name_or_path, "config.json").is_file():
        return load_calibration_file(Path(name_or_path, "config.json"))
    return None
