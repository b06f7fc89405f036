"""``diffusers-omni info``: the platform and every registered backend, available or with its reasons.

Availability means it runs: every kernel package a backend needs is imported in a child interpreter (a package whose
import crashes the interpreter cannot take ``info`` down), and on a real CUDA GPU each available backend runs one tiny
attention call there too; the import or launch error is the reason shown. A simulated platform (``--platform``)
cannot launch kernels, so it shows import results only.
"""

from __future__ import annotations

import json

import torch

from ..attention.availability import isolated_results, package_installed, probe, probe_imports, task_key
from ..attention.backends.base import AttentionCall
from ..attention.backends.flash import IMPLEMENTATIONS, flash_attention_implementations
from ..attention.platform import current_platform
from ..attention.routing import failed_conditions, platform_routes
from ..attention.registry import get_backend_class, registered_backend_names
from ..attention.selector import environment_backend
from ..utils.versions import omni_version


def kernel_modules() -> list[str]:
    """The kernel packages the registered backends import: their ``packages`` and every FlashAttention candidate."""
    modules = [impl.module for impl in IMPLEMENTATIONS]
    for name in registered_backend_names():
        modules += [module for module, _ in get_backend_class(name).packages]
    return list(dict.fromkeys(modules))


def _availability(platform) -> dict:
    """Each backend's availability reasons, the usable FlashAttention implementations and the platform routes (whose
    conditions ask which implementations import)."""
    check = AttentionCall(device_type=platform.device_type, head_dim=128)
    return {
        "reasons": {name: get_backend_class(name).availability_reasons(platform) for name in registered_backend_names()},
        "implementations": flash_attention_implementations(),
        "routes": [
            {"backend": r.backend, "when": list(r.when),
             "conditions_failing_for_unmasked_head_dim_128": failed_conditions(r, platform, check)}
            for r in platform_routes(platform)
        ],
    }


def _isolated_availability(platform) -> tuple[dict, dict[str, str | None]]:
    """``_availability`` with every kernel import made in child interpreters (``attention.availability.probe``),
    never in this process, and the import results by module."""
    results: dict[str, str | None] = {}
    while True:
        # The first pass imports nothing and answers "imports" for every package: it only collects the ones asked
        # for, so that one child interpreter imports them all; later passes answer from its results. Only installed
        # packages are probed (one that is not installed needs no import to be found missing).
        with isolated_results(results) as unprobed:
            wanted = {module for module in kernel_modules() if package_installed(module)}
            found = _availability(platform)
        missing = sorted((wanted | unprobed) - set(results))
        if not missing:
            return found, results
        results.update(probe_imports(missing))


def launch_checks(reasons: dict[str, list[str]], device: str = "cuda") -> dict[str, str | None]:
    """One tiny bfloat16 attention call per available backend (no reasons in ``reasons``) on ``device``, in child
    interpreters: ``{backend: None (ran) or the error, or "not run: ..."}``."""
    tasks, launch = {}, {}
    for name, why in reasons.items():
        if why:
            continue
        cls = get_backend_class(name)
        if getattr(cls, "kernel_repo", None):
            launch[name] = "not run: its kernel is fetched from the Hub on first use"
            continue
        tasks[name] = ["call", f"{cls.__module__}:{cls.__qualname__}", device, "bfloat16"]
    found = probe(list(tasks.values()))
    launch.update({name: found[task_key(task)] for name, task in tasks.items()})
    return launch


def collect_info(platform=None) -> dict:
    """Everything ``info`` shows. ``platform=None``: this machine, and on a CUDA GPU one tiny call per available
    backend; a given (simulated) ``platform``: kernel imports only."""
    import diffusers

    simulated = platform is not None
    platform = platform or current_platform()
    found, imports = _isolated_availability(platform)
    reasons = found["reasons"]
    if simulated:
        launch_note = "not run: a simulated platform cannot launch kernels; import results only"
        launch = {}
    elif platform.device_type != "cuda":
        launch_note = f"not run: the platform is {platform.device_type}, not a CUDA GPU"
        launch = {}
    else:
        launch = launch_checks(reasons)
        launch_note = "one tiny bfloat16 attention call per available backend, in a child interpreter"
    backends = []
    for name in registered_backend_names():
        cls = get_backend_class(name)
        why = list(reasons[name])
        error = launch.get(name)
        if error is not None and not error.startswith("not run:"):
            why.append(error)
        determinism = cls.determinism_reasons(platform)
        backends.append(
            {
                "name": name,
                "available": not why,
                "reasons": why,
                # None: not launched (unavailable, simulated or not a CUDA GPU); "ok"; "not run: ..."; the error.
                "launch": ("ok" if error is None else error) if name in launch else None,
                "supports_mask": cls.supports_mask,
                "supports_backward": cls.supports_backward,
                # Whether the backend can promise bitwise run-to-run reproducibility here under deterministic
                # mode (AttentionConfig(deterministic=True) or DIFFUSERS_OMNI_DETERMINISTIC=1), and why not.
                "deterministic": not determinism,
                "deterministic_reasons": determinism,
            }
        )
    return {
        "diffusers_omni": omni_version(),
        "environment": environment(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "diffusers": diffusers.__version__,
        "platform": platform.to_dict(),
        "flash_attention_implementations": found["implementations"],
        "availability_check": {
            "imports": "each kernel package imported in a child interpreter",
            "kernel_imports": imports,
            "launch": launch_note,
        },
        "environment_backend": _environment_backend(),
        "routing": found["routes"],
        "shape_routing": _shape_routing(platform),
        "deterministic_mode": _deterministic_mode(),
        "backends": backends,
    }


_PACKAGES = ("torch", "diffusers", "transformers", "accelerate", "huggingface_hub", "safetensors", "tokenizers",
             "numpy", "flash-attn", "flash-attn-4", "fa3-fwd", "flashinfer-python", "sageattention", "kernels",
             "torchao", "bitsandbytes", "gguf", "peft", "imageio-ffmpeg")


def environment() -> dict:
    """What ``diffusers-cli env`` reports, plus the optional kernel packages: versions, OS, GPUs, host memory."""
    import os
    import platform as host
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append({"index": index, "name": props.name, "memory_bytes": props.total_memory,
                         "compute_capability": f"{props.major}.{props.minor}"})
    try:
        host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        host_memory = None
    return {
        "python": host.python_version(),
        "os": host.platform(),
        "cpu_count": os.cpu_count(),
        "host_memory_bytes": host_memory,
        "packages": {name: installed(name) for name in _PACKAGES},
        "accelerator": "cuda" if torch.cuda.is_available() else (
            "mps" if torch.backends.mps.is_available() else "none"),
        "gpus": gpus,
    }


def bug_report_block(info: dict) -> str:
    """The copy-pasteable block for a bug report (the shape of ``diffusers-cli env``'s)."""
    env = info["environment"]
    gib = 2**30
    lines = [
        f"- diffusers-omni version: {info['diffusers_omni']}",
        f"- Platform: {env['os']}",
        f"- Python version: {env['python']}",
        *(f"- {name} version: {value}" for name, value in env["packages"].items() if value),
        f"- CUDA / cuDNN: {info['cuda'] or 'none'} / {info['cudnn'] or 'none'}",
        *(f"- GPU {g['index']}: {g['name']} ({g['memory_bytes'] / gib:.1f} GiB, sm {g['compute_capability']})"
          for g in env["gpus"]),
        f"- Accelerator: {env['accelerator']}",
        f"- Host memory: {env['host_memory_bytes'] / gib:.1f} GiB" if env["host_memory_bytes"] else "- Host memory: unknown",
        f"- CPUs: {env['cpu_count']}",
        f"- Attention platform: {info['platform']['description']}",
        "- Available attention backends: " + (", ".join(b["name"] for b in info["backends"] if b["available"]) or "none"),
        f"- Deterministic mode: {'on' if info['deterministic_mode'].get('enabled') else 'off'}",
    ]
    return "\n".join(lines)


def _shape_routing(platform) -> dict:
    """The ranking per measured shape class of this platform family, from the table that decides here: one tuned on
    this machine (``diffusers-omni tune``) when it matches this environment, the shipped one otherwise."""
    from ..attention.routing import active_table, is_tuned, table_label

    table = active_table(platform)
    rules = table.get("families", {}).get(platform.family, {})
    return {"table": table_label(table), "tuned": is_tuned(table),
            "classes": {key: rule["ranking"] for key, rule in rules.items()}}


def _environment_backend() -> dict:
    """The default backend the environment variables ask for (the CLI refused an unknown value before this)."""
    spec, source = environment_backend()
    return {"backend": spec.backend if spec is not None else None, "source": source or None}


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
        f"availability: {info['availability_check']['imports']}; kernel launch check: "
        f"{info['availability_check']['launch']}",
        "default from the environment: " + (
            f"{info['environment_backend']['backend']} ({info['environment_backend']['source']})"
            if info["environment_backend"]["backend"] else "none (DIFFUSION_ATTENTION_BACKEND, DIFFUSERS_ATTN_BACKEND unset)"),
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
            ran = ", a tiny call ran" if backend.get("launch") == "ok" else ""
            lines.append(f"  {backend['name']:18s} available{ran}, {det}")
            if backend.get("launch", "ok") not in ("ok", None):
                lines.append(f"      - launch check {backend['launch']}")
            lines.extend(f"      - {reason}" for reason in backend["deterministic_reasons"])
        else:
            lines.append(f"  {backend['name']:18s} unavailable")
            lines.extend(f"      - {reason}" for reason in backend["reasons"])
    lines += ["", "Copy and paste the text below into a bug report:", "", bug_report_block(info)]
    return "\n".join(lines)


def run(args) -> int:
    from ..utils.text import fit
    from .common import parse_platform

    info = collect_info(parse_platform(args.platform))
    print(json.dumps(info, indent=2) if args.json else fit(format_info(info)))  # fit: the terminal's width
    return 0
