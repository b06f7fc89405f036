"""``diffusers-omni explain``: per-role backend resolution for a pipeline under a config."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ..config.offload import NO_BUDGET, format_bytes
from ..installer import check_roles_of_plans, plan_attention
from ..attention.platform import current_platform, use_platform
from ..attention.routing import sparse_rules
from ..attention.plan import AttentionPlan


def explain_pipeline(pipe, config=None, platform=None) -> list[dict]:
    """One row per (attention module, role): the chosen backend, its source and rejected candidates."""
    from ..pipelines.registry import omni_pipeline_class
    from ..utils.modules import get_submodule_path

    omni_cls = omni_pipeline_class(type(pipe))
    dits = {path: get_submodule_path(pipe, path) for path in omni_cls._dit_modules}  # dotted paths too
    return explain_dits({path: model for path, model in dits.items() if model is not None}, config, platform)


def explain_dits(dits: dict, config=None, platform=None) -> list[dict]:
    """``explain_pipeline`` for DiTs given by pipeline path (they may live on the meta device: no weights needed)."""
    rows = []
    scope = use_platform(platform) if platform else contextlib.nullcontext()
    planned = []
    with scope:
        plan = AttentionPlan.build(config)  # the one parse of this call, on the platform explained
        for path, model in dits.items():
            declaration, sites = plan_attention(model, plan, check_roles=False)
            planned.append((model, declaration, sites))
            for site, resolutions in sites:
                for resolution in resolutions.values():
                    rows.append({"module": f"{path}.{site.name}", **resolution.to_dict()})
    check_roles_of_plans(plan, planned)  # the keys of one config are checked against all DiTs together
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


def explain_offload(config) -> dict:
    """What an offload config's budgets come to on this machine, without loading weights: each ``"auto"`` budget
    read through ``offload.budget`` (the readings, the bytes chosen and how), explicit sizes as given. The host
    budget counts the weights already in RAM when enabling; here none are loaded (0). With ``compression``, what its
    ``compression_cache_dir`` holds."""
    import torch

    from ..offload import budget

    device = torch.device(config.device)
    out: dict = {"strategy": str(config.strategy), "device": str(device), "budgets": {}}
    reading = None
    for name in ("max_device_memory", "max_host_memory"):
        value = getattr(config, name, None)
        if value is None or value == NO_BUDGET:
            if name == "max_device_memory" and hasattr(config, name):
                out["budgets"][name] = {"bytes": None, "explain": f"{name}: no budget (every DiT block streams "
                                        "through the prefetch window)"}
            continue
        if value != budget.AUTO:
            out["budgets"][name] = {"bytes": value, "explain": f"{name}={format_bytes(value)} (as given)"}
            continue
        reading = reading or budget.read_machine(device)
        chosen = budget.device_budget(reading) if name == "max_device_memory" else budget.host_budget(reading, 0)
        out["budgets"][name] = {"bytes": chosen.nbytes, "explain": chosen.explain()}
        if chosen.limit is not None:  # the device: what a measured call shape may fill (offload.headroom)
            out["budgets"][name]["ceiling"] = chosen.limit - budget.peak_margin(chosen.limit)
    if reading is not None:
        out["read"] = reading.describe()
    compression = getattr(config, "compression", None)
    if compression is not None:
        out["compression"] = {"mode": compression}
        folder = getattr(config, "compression_cache_dir", None)
        if folder is not None:
            files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
            out["compression"].update(cache_dir=str(folder), cached_blocks=len(files),
                                      cached_bytes=sum(f.stat().st_size for f in files))
    return out


def run(args) -> int:
    import torch

    from ..utils.text import fit, table
    from .common import TINY_MODELS, check_model, configure_logging, load_pipeline, own_pipeline_class, parse_platform

    configure_logging(args.verbose)
    platform = parse_platform(args.platform)
    check_model(args.model)
    offload = None
    if getattr(args, "offload", "none") != "none":  # built (and so checked) before anything loads
        from .offload import offload_config

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        offload = explain_offload(offload_config(args, device, collective=False))
    own = None if args.model in TINY_MODELS else own_pipeline_class(args.model)
    if args.model in TINY_MODELS:
        rows = explain_pipeline(load_pipeline(args.model), args.attention, platform)
    elif own is not None:  # this package's own pipelines: their DiTs on the meta device from the configs
        from types import SimpleNamespace

        from ..pipelines.registry import omni_pipeline_class
        from ..utils.modules import get_submodule_path

        components = SimpleNamespace(**own.meta_components(args.model))
        rows = explain_dits({path: get_submodule_path(components, path)
                             for path in omni_pipeline_class(own)._dit_modules}, args.attention, platform)
    else:
        rows = explain_dits(dits_from_configs(args.model, getattr(torch, args.dtype)), args.attention, platform)
    if args.json:
        print(json.dumps(rows if offload is None else {"attention": rows, "offload": offload}, indent=2))
        return 0
    print(fit(f"platform: {(platform or current_platform()).describe()}"))
    summary = summarize(rows)
    print(table(summary, ["role", "category", "backend", "lossy", "source", "modules", "call"], keep=["backend"]))
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
    if offload is not None:
        print(fit(f"offload: {offload['strategy']} on {offload['device']}"))
        if not offload["budgets"]:
            print(fit("  no budget: every DiT block streams through the window"))
        for entry in offload["budgets"].values():
            print(fit(f"  {entry['explain']}"))
            if "ceiling" in entry:
                print(fit(f"  then per call shape: the first forward at each shape is measured, and DiT blocks stay "
                          f"on the device (or stream first, for a larger shape) so that the step's peak stays within "
                          f"{format_bytes(entry['ceiling'])} (what auto read, less a margin)"))
        compression = offload.get("compression")
        if compression is not None:
            line = f"  compression: {compression['mode']}"
            if "cache_dir" in compression:
                line += (f"; compression_cache_dir {compression['cache_dir']} holds {compression['cached_blocks']} "
                         f"blocks' code ({format_bytes(compression['cached_bytes'])}), checked against the weights "
                         "when enabling")
            print(fit(line))
        if "read" in offload:
            print(fit("  auto read: " + ", ".join(f"{k} {v}" for k, v in offload["read"].items())))
            if offload["budgets"].get("max_host_memory", {}).get("explain", "").startswith("max_host_memory=auto"):
                print(fit("  max_host_memory=auto adds the bytes of the weights already in RAM when enabling (none "
                          "are loaded here)"))
    return 0


def dits_from_configs(model: str, dtype) -> dict:
    """The DiTs of a saved or hub pipeline built from their configs on the meta device: explaining a 12B-parameter
    model reads a few JSON files and allocates no weights. Third-party notices of the imports and the config reads
    (quantizer packages, Diffusers' float32-modules note about weights that do not exist here, huggingface_hub's
    deprecation of an argument Diffusers passes) are kept off the screen."""
    import logging
    import warnings

    from diffusers.utils import logging as diffusers_logging

    from ..utils.quiet import quiet_third_party_imports

    previous = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity(logging.ERROR)
    try:
        with quiet_third_party_imports(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks.*")
            return _dits_from_configs(model, dtype)
    finally:
        diffusers_logging.set_verbosity(previous)


def _dits_from_configs(model: str, dtype) -> dict:
    import importlib

    import diffusers
    import torch
    from accelerate import init_empty_weights
    from diffusers import DiffusionPipeline

    from ..pipelines.registry import omni_pipeline_class

    from .common import published_layout_class, read_model_json

    published = published_layout_class(model)
    if published is not None:  # published without model_index.json (NextStep-1.1)
        with torch.device("meta"):
            _, dit = published.skeleton_components(read_model_json(model, "config.json"),
                                                    read_model_json(model, "vae/config.json"))
        return {omni_pipeline_class(published)._dit_modules[0]: dit.to(dtype)}
    index = DiffusionPipeline.load_config(model)
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
