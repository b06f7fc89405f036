"""``diffusers-omni explain``: per-role backend resolution for a pipeline under a config."""

from __future__ import annotations

import contextlib
import json

from ..attention.install import plan_attention
from ..attention.platform import current_platform, use_platform
from ..config.attention import AttentionConfig


def explain_pipeline(pipe, config=None, platform=None) -> list[dict]:
    """One row per (attention module, role): the chosen backend, its source and rejected candidates."""
    from ..pipelines.registry import omni_pipeline_class

    omni_cls = omni_pipeline_class(type(pipe))
    config = AttentionConfig.parse(config)
    rows = []
    scope = use_platform(platform) if platform else contextlib.nullcontext()
    with scope:
        for path in omni_cls._dit_modules:
            model = getattr(pipe, path, None)
            if model is None:
                continue
            _, plan = plan_attention(model, config)
            for site, resolutions in plan:
                for resolution in resolutions.values():
                    rows.append({"module": f"{path}.{site.name}", **resolution.to_dict()})
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
    from .common import configure_logging, load_pipeline, parse_platform, table

    configure_logging(args.verbose)
    platform = parse_platform(args.platform)
    pipe = load_pipeline(args.model)
    rows = explain_pipeline(pipe, args.attention, platform)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"platform: {(platform or current_platform()).describe()}")
    summary = summarize(rows)
    print(table(summary, ["role", "category", "backend", "source", "modules", "call"]))
    for row in summary:
        for rejected in row["rejected"]:
            print(f"  {row['role']}: skipped {rejected['backend']}: {'; '.join(rejected['reasons'])}")
    return 0
