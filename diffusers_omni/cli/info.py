"""``diffusers-omni info``: the platform and every registered backend, available or with its reasons."""

from __future__ import annotations

import json

import torch

from ..attention.backends.base import AttentionCall
from ..attention.backends.flash import flash_attention_implementations
from ..attention.platform import current_platform
from ..attention.routing import failed_conditions, platform_routes
from ..attention.registry import get_backend_class, registered_backend_names
from ..utils.versions import omni_version


def collect_info(platform=None) -> dict:
    import diffusers

    platform = platform or current_platform()
    backends = []
    for name in registered_backend_names():
        cls = get_backend_class(name)
        reasons = cls.availability_reasons(platform)
        determinism = cls.determinism_reasons(platform)
        backends.append(
            {
                "name": name,
                "available": not reasons,
                "reasons": reasons,
                "supports_mask": cls.supports_mask,
                "supports_backward": cls.supports_backward,
                # Whether the backend can promise bitwise run-to-run reproducibility here under deterministic
                # mode (AttentionConfig(deterministic=True) or DIFFUSERS_OMNI_DETERMINISTIC=1), and why not.
                "deterministic": not determinism,
                "deterministic_reasons": determinism,
            }
        )
    probe = AttentionCall(device_type=platform.device_type, head_dim=128)
    routes = [
        {"backend": r.backend, "when": list(r.when), "conditions_failing_for_unmasked_head_dim_128": failed_conditions(r, platform, probe)}
        for r in platform_routes(platform)
    ]
    return {
        "diffusers_omni": omni_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "diffusers": diffusers.__version__,
        "platform": platform.to_dict(),
        "flash_attention_implementations": flash_attention_implementations(),
        "routing": routes,
        "shape_routing": _shape_routing(platform),
        "deterministic_mode": _deterministic_mode(),
        "backends": backends,
    }


def _shape_routing(platform) -> dict:
    """The committed routing table's ranking per measured shape class of this platform family."""
    from ..attention.routing import TABLE_PATH, load_table

    rules = load_table().get("families", {}).get(platform.family, {})
    return {"table": TABLE_PATH.name, "classes": {key: rule["ranking"] for key, rule in rules.items()}}


def _deterministic_mode() -> dict:
    from ..attention.selector import ENV_DETERMINISTIC, deterministic_requested

    try:
        enabled, source = deterministic_requested(None)
    except ValueError as exc:
        return {"enabled": None, "source": f"env {ENV_DETERMINISTIC}", "error": str(exc)}
    return {
        "enabled": enabled,
        "source": source or "AttentionConfig(deterministic=True) or DIFFUSERS_OMNI_DETERMINISTIC=1 turn it on",
        "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def _format_shape_routing(shape_routing: dict) -> list[str]:
    classes = shape_routing["classes"]
    if not classes:
        return [f"shape routing: none measured for this platform ({shape_routing['table']})"]
    lines = [f"shape routing ({shape_routing['table']}; class = q/kv length buckets, head dim, mask; the first "
             "installed backend of each ranking runs, the route above otherwise):"]
    lines += [f"  {key:22s} {' > '.join(ranking)}" for key, ranking in classes.items()]
    return lines


def format_info(info: dict) -> str:
    plat = info["platform"]
    lines = [
        f"diffusers-omni {info['diffusers_omni']}  torch {info['torch']}  diffusers {info['diffusers']}",
        f"platform: {plat['description']}  device: {plat['device_name']}",
        f"CUDA: {info['cuda'] or 'none'}  cuDNN: {info['cudnn'] or 'none'}",
        f"FlashAttention implementations found: {', '.join(info['flash_attention_implementations']) or 'none'}",
        "default routing: " + " → ".join(r["backend"] + (f" (if {', '.join(r['when'])})" if r["when"] else "") for r in info["routing"]),
        *_format_shape_routing(info["shape_routing"]),
        f"deterministic mode: {'on' if info['deterministic_mode'].get('enabled') else 'off'} "
        f"({info['deterministic_mode']['source']})",
        "",
        "backends:",
    ]
    for backend in info["backends"]:
        det = "deterministic" if backend["deterministic"] else "not deterministic"
        if backend["available"]:
            lines.append(f"  {backend['name']:18s} available, {det}")
            lines.extend(f"      - {reason}" for reason in backend["deterministic_reasons"])
        else:
            lines.append(f"  {backend['name']:18s} unavailable")
            lines.extend(f"      - {reason}" for reason in backend["reasons"])
    return "\n".join(lines)


def run(args) -> int:
    from .common import parse_platform

    info = collect_info(parse_platform(args.platform))
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0
