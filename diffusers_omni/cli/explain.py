"""``diffusers-omni explain``: per-role backend resolution for a pipeline under a config."""

from __future__ import annotations

import contextlib
import json

from ..installer import check_roles_of_plans, plan_attention
from ..attention.platform import current_platform, use_platform
from ..attention.routing import sparse_rules
from ..config.attention import AttentionConfig


def explain_pipeline(pipe, config=None, platform=None) -> list[dict]:
    """One row per (attention module, role): the chosen backend, its source and rejected candidates."""
    from ..pipelines.registry import omni_pipeline_class
    from ..utils.modules import get_submodule_path

    omni_cls = omni_pipeline_class(type(pipe))
    dits = {path: get_submodule_path(pipe, path) for path in omni_cls._dit_modules}  # dotted paths allowed
    return explain_dits({path: model for path, model in dits.items() if model is not None}, config, platform)


def explain_dits(dits: dict, config=None, platform=None) -> list[dict]:
    """``explain_pipeline`` for DiTs given by pipeline path (they may live on the meta device: no weights needed)."""
    config = AttentionConfig.parse(config)
    rows = []
    scope = use_platform(platform) if platform else contextlib.nullcontext()
    planned = []
    with scope:
        for path, model in dits.items():
            declaration, plan = plan_attention(model, config, check_roles=False)
            planned.append((model, declaration, plan))
            for site, resolutions in plan:
                for resolution in resolutions.values():
                    rows.append({"module": f"{path}.{site.name}", **resolution.to_dict()})
    check_roles_of_plans(config, planned)  # the keys of one config are checked against all DiTs together
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Collapse rows with the same role, backend and source (blocks repeat the same roles)."""
    grouped: dict[tuple, dict] = {}
    for row in rows:
        key = (row["role"], row["backend"], row["source"])
        if key not in grouped:
            grouped[key] = {**row, "modules": 0}
        grouped[key]["modules"] += 1
    return list(grouped.values())


def run(args) -> int:
    import torch

    from ..utils.text import fit, table
    from .common import TINY_MODELS, check_model, configure_logging, load_pipeline, parse_platform

    configure_logging(args.verbose)
    platform = parse_platform(args.platform)
    check_model(args.model)
    if args.model in TINY_MODELS:
        rows = explain_pipeline(load_pipeline(args.model), args.attention, platform)
    else:
        rows = explain_dits(dits_from_configs(args.model, getattr(torch, args.dtype)), args.attention, platform)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(fit(f"platform: {(platform or current_platform()).describe()}"))
    summary = summarize(rows)
    print(table(summary, ["role", "category", "backend", "lossy", "source", "modules", "call"]))
    tables = sorted({row["routing_table"] for row in summary if row.get("routing_table")})
    for label in tables:
        print(fit(f"routing table: {label}"))
    for row in summary:
        if row.get("shape_routed"):
            print(fit(f"  {row['role']}: shape-routed to {', '.join(row['shape_routed'])} where the routing table "
                      f"ranks them first for this platform; other shapes run {row['backend']}"))
        for margin in row.get("margins", ()):
            print(fit(f"  {row['role']}: measured {margin}"))
        if row.get("lossy"):
            print(fit(f"  {row['role']}: LOSSY — {row['backend']} approximates attention (quantised or "
                      "block-sparse); compare it with an exact config on your model: "
                      "diffusers-omni compare --candidate '<config>'"))
            if row["backend"] == "RAINFUSION_ATTN":
                family = (platform or current_platform()).family
                for key, rule in sparse_rules(family).items():
                    print(fit(f"  {row['role']}: calls of class {key} keeping more than "
                              f"{rule['dense_above_kept_share']:.0%} of the key blocks run dense (measured "
                              f"break-even: {rule['from']})"))
        for rejected in row["rejected"]:
            print(fit(f"  {row['role']}: skipped {rejected['backend']}: {'; '.join(rejected['reasons'])}"))
    return 0


def dits_from_configs(model: str, dtype) -> dict:
    """The DiTs of a saved or hub pipeline built from their configs on the meta device: explaining a 12B-parameter
    model reads a few JSON files and allocates no weights."""
    import importlib

    import diffusers
    from accelerate import init_empty_weights
    from diffusers import DiffusionPipeline

    from ..pipelines.registry import omni_pipeline_class

    from ..utils.quiet import quiet_torchvision_fallback

    index = DiffusionPipeline.load_config(model)
    with quiet_torchvision_fallback():
        pipeline_cls = getattr(diffusers, index["_class_name"])
    omni_cls = omni_pipeline_class(pipeline_cls)
    dits = {}
    for path in omni_cls._dit_modules:
        entry = index.get(path)
        if not isinstance(entry, (list, tuple)) or entry[1] is None:
            continue
        model_cls = getattr(importlib.import_module(entry[0]), entry[1])
        with init_empty_weights():
            dit = model_cls.from_config(model_cls.load_config(model, subfolder=path))
        dits[path] = dit.to(dtype)
    return dits
