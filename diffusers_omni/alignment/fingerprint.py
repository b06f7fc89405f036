"""Kernel fingerprints: which attention kernel serves each role, in a form two jobs can write and compare.

A training job and a rollout job each call ``kernel_fingerprint(pipe)`` (or ``diffusers-omni align
--fingerprint``), write the JSON, and ``compare_fingerprints`` reports role by role what differs: backend,
implementation, versions, hub kernel repo and revision, torch/CUDA/cuDNN, device, call dtype and the deterministic
flag.
"""

from __future__ import annotations

import json
import platform as _py_platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..utils.text import table
from ..utils.versions import omni_version

FORMAT = "diffusers-omni.kernel-fingerprint/1"

# Per-role fields that only say where a choice came from or how often it is used; they never make two kernels
# different, so comparisons report them but do not count them as mismatches.
INFORMATIONAL_FIELDS = frozenset({"source", "modules"})


def environment() -> dict[str, Any]:
    """Versions and device of this process: everything outside the backend that decides which kernel runs."""
    import diffusers

    from ..attention.platform import current_platform

    plat = current_platform()
    return {
        "python": _py_platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "diffusers": diffusers.__version__,
        "diffusers_omni": omni_version(),
        "device_type": plat.device_type,
        "device_name": plat.device_name,
        "compute_capability": list(plat.compute_capability) if plat.compute_capability else None,
        "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


# Environment fields copied into every role entry, so that a role-by-role comparison sees them.
_KERNEL_ENV_FIELDS = ("torch", "cuda", "cudnn", "device_name", "compute_capability")


def _dits(target: Any) -> dict[str, nn.Module]:
    omni_dits = getattr(target, "omni_dits", None)
    if callable(omni_dits):
        return omni_dits()
    if isinstance(target, nn.Module):
        return {"model": target}
    components = getattr(target, "components", None)
    if isinstance(components, dict):
        # A stock Diffusers pipeline: every transformer-like component with attention processors.
        return {
            name: module
            for name, module in components.items()
            if isinstance(module, nn.Module) and name.startswith("transformer")
        }
    raise TypeError(f"kernel_fingerprint needs a pipeline or an nn.Module, got {type(target).__name__}")


def _stock_identity(processor: Any) -> dict[str, Any]:
    import diffusers

    backend = getattr(processor, "_attention_backend", None)
    if backend is None:
        try:
            from diffusers.models.attention_dispatch import _AttentionBackendRegistry

            backend = _AttentionBackendRegistry.get_active_backend()[0]
        except Exception:  # diffusers without the dispatcher
            backend = None
    return {
        "backend": f"diffusers:{getattr(backend, 'value', backend)}" if backend is not None else "diffusers",
        "implementation": f"{type(processor).__module__}.{type(processor).__qualname__}",
        "version": diffusers.__version__,
        "kernel_repo": None,
        "kernel_revision": None,
        "deterministic": False,
    }


def _entries(model: nn.Module) -> list[tuple[str, dict[str, Any]]]:
    from ..attention.processors import is_omni_processor

    found = []
    for _, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None:
            continue
        if is_omni_processor(processor):
            for role, attend in processor.attend.items():
                identity = {
                    **attend.backend.describe(),
                    "call": attend.resolution.call.describe(),
                    "source": attend.resolution.source,
                }
                found.append((role, identity))
        else:
            found.append((f"stock:{type(processor).__name__}", {**_stock_identity(processor), "source": "diffusers"}))
    return found


def kernel_fingerprint(target: Any) -> dict[str, Any]:
    """The kernel identity of every attention role of a pipeline or a bare transformer.

    Args:
        target: an Omni pipeline, a stock Diffusers pipeline, or a transformer (``nn.Module``).

    Returns:
        A JSON-serialisable dict: ``format``, ``environment`` (versions, device, ``torch`` deterministic algorithms)
        and ``roles``: role → identity (``backend``, ``implementation``, ``version``, ``kernel_repo``,
        ``kernel_revision``, ``deterministic``, the call it was resolved for, torch/CUDA/cuDNN versions, device name
        and capability, ``source`` and ``modules``). Roles are keyed by role name (``"flux.joint"``); with several
        DiTs (Wan 2.2) by ``"<component>:<role>"``. Modules without omni attention appear as
        ``"stock:<ProcessorClass>"``. When modules of one role run different kernels the entry lists them under
        ``variants``.

    Example:
    ```py
    >>> fp = kernel_fingerprint(pipe); save_fingerprint(fp, "rollout.json")
    >>> print(compare_fingerprints(load_fingerprint("train.json"), fp).table())
    ```
    """
    env = environment()
    dits = _dits(target)
    grouped: dict[str, list[dict[str, Any]]] = {}
    for path, model in dits.items():
        for role, identity in _entries(model):
            key = role if len(dits) == 1 else f"{path}:{role}"
            identity = {**identity, **{name: env[name] for name in _KERNEL_ENV_FIELDS}}
            grouped.setdefault(key, []).append(identity)
    roles: dict[str, Any] = {}
    for key, identities in grouped.items():
        distinct: dict[str, dict[str, Any]] = {}
        for identity in identities:
            distinct.setdefault(json.dumps(identity, sort_keys=True, default=str), identity)
        if len(distinct) == 1:
            roles[key] = {**next(iter(distinct.values())), "modules": len(identities)}
        else:
            roles[key] = {"variants": [distinct[k] for k in sorted(distinct)], "modules": len(identities)}
    return {"format": FORMAT, "environment": env, "roles": dict(sorted(roles.items()))}


def save_fingerprint(fingerprint: dict[str, Any], path: str | Path) -> Path:
    """Write a fingerprint as JSON (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fingerprint, indent=2, sort_keys=True, default=str) + "\n")
    return path


def load_fingerprint(path: str | Path) -> dict[str, Any]:
    """Read a fingerprint written by ``save_fingerprint`` (or the ``fingerprint`` of a saved layer-output file)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a diffusers-omni kernel fingerprint (format {FORMAT!r})")
    return data


@dataclass
class RoleComparison:
    role: str
    status: str  # "match", "mismatch", "only in a", "only in b"
    differences: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    notes: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "status": self.status,
            "differences": {k: list(v) for k, v in self.differences.items()},
            "notes": {k: list(v) for k, v in self.notes.items()},
        }


@dataclass
class FingerprintComparison:
    """Role-by-role comparison of two fingerprints (``a`` and ``b``)."""

    roles: list[RoleComparison]
    environment: dict[str, tuple[Any, Any]]

    @property
    def matches(self) -> bool:
        """True when every role exists on both sides and runs the same kernel."""
        return all(row.status == "match" for row in self.roles)

    @property
    def mismatched_roles(self) -> list[str]:
        return [row.role for row in self.roles if row.status != "match"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "matches": self.matches,
            "roles": [row.to_dict() for row in self.roles],
            "environment_differences": {k: list(v) for k, v in self.environment.items()},
        }

    def table(self) -> str:
        rows = []
        for row in self.roles:
            detail = "; ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in row.differences.items())
            rows.append({"role": row.role, "kernel": row.status, "differences": detail})
        text = table(rows, ["role", "kernel", "differences"])
        if self.environment:
            text += "\nenvironment differences: " + "; ".join(
                f"{k}: {a!r} vs {b!r}" for k, (a, b) in self.environment.items()
            )
        return text


def _diff(a: dict[str, Any], b: dict[str, Any]) -> tuple[dict, dict]:
    differences, notes = {}, {}
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            (notes if key in INFORMATIONAL_FIELDS else differences)[key] = (a.get(key), b.get(key))
    return differences, notes


def compare_fingerprints(a: dict[str, Any], b: dict[str, Any]) -> FingerprintComparison:
    """Compare two fingerprints role by role; ``source`` and ``modules`` differences are notes, not mismatches."""
    for name, fp in (("a", a), ("b", b)):
        if not isinstance(fp, dict) or fp.get("format") != FORMAT:
            raise ValueError(f"fingerprint {name} is not a diffusers-omni kernel fingerprint (format {FORMAT!r})")
    rows = []
    for role in sorted(set(a["roles"]) | set(b["roles"])):
        if role not in b["roles"]:
            rows.append(RoleComparison(role, "only in a"))
            continue
        if role not in a["roles"]:
            rows.append(RoleComparison(role, "only in b"))
            continue
        differences, notes = _diff(a["roles"][role], b["roles"][role])
        rows.append(RoleComparison(role, "mismatch" if differences else "match", differences, notes))
    env_a, env_b = a.get("environment", {}), b.get("environment", {})
    environment = {k: (env_a.get(k), env_b.get(k)) for k in sorted(set(env_a) | set(env_b)) if env_a.get(k) != env_b.get(k)}
    return FingerprintComparison(rows, environment)
