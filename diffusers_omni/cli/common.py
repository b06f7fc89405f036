"""Helpers shared by the CLI commands: platform overrides, logging and pipeline loading."""

from __future__ import annotations

import logging
from typing import Any

TINY_MODELS = ("tiny-flux", "tiny-wan", "tiny-wan-i2v")


def parse_platform(text: str | None):
    """``--platform`` values: ``cpu``, ``mps``, or ``sm_XY[,cudnn=N]`` (e.g. ``sm_90,cudnn=91900``)."""
    from ..attention.platform import Platform

    if text is None:
        return None
    head, *options = [part.strip() for part in text.split(",")]
    if head in ("cpu", "mps"):
        return Platform(device_type=head, device_name=head.upper())
    if not (head.startswith("sm_") and head[3:].isdigit() and len(head) >= 5):
        raise SystemExit(f"--platform={text!r}: expected cpu, mps or sm_XY[,cudnn=N] (e.g. sm_90,cudnn=91900)")
    digits = head[3:]
    capability = (int(digits[:-1]), int(digits[-1]))
    cudnn = 91900
    for option in options:
        key, _, value = option.partition("=")
        if key != "cudnn" or not value.isdigit():
            raise SystemExit(f"--platform option {option!r} is not allowed; allowed: cudnn=N")
        cudnn = int(value)
    return Platform(device_type="cuda", device_name=f"simulated {head}", compute_capability=capability, cudnn_version=cudnn)


def configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("diffusers_omni").setLevel(logging.INFO)


def load_pipeline(model: str, dtype: Any = None, mmap: bool = False):
    """A tiny local pipeline by name, or any supported Diffusers pipeline through ``from_pretrained``.

    With ``mmap``, every DiT the pipeline declares is loaded with ``load_transformer_mmap`` (weights stay views of
    the safetensors files, shared through the page cache, so ranks of a distributed run do not each hold a copy).
    """
    from .. import testing

    if mmap:
        if model in TINY_MODELS:
            raise ValueError(f"--mmap needs a model directory or hub id; got {model!r} (built in memory, no files)")
        return _load_with_mmap_dits(model, dtype)

    if model == "tiny-flux":
        return testing.tiny_flux_pipeline()
    if model == "tiny-wan":
        return testing.tiny_wan_pipeline()
    if model == "tiny-wan-i2v":
        return testing.tiny_wan_i2v_pipeline()
    from diffusers import DiffusionPipeline

    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    return DiffusionPipeline.from_pretrained(model, **kwargs)


def _load_with_mmap_dits(model: str, dtype: Any):
    import importlib
    from pathlib import Path

    import diffusers
    from diffusers import DiffusionPipeline

    from ..offload.loading import load_transformer_mmap
    from ..pipelines.registry import omni_pipeline_class

    root = Path(model)
    if not root.is_dir():
        # Diffusers' own filtering (the pipeline's component folders, safetensors over .bin, no single-file
        # checkpoints), as from_pretrained downloads; a bare snapshot_download would fetch the whole repository.
        root = Path(DiffusionPipeline.download(model))
    index = DiffusionPipeline.load_config(root)
    pipeline_cls = getattr(diffusers, index["_class_name"])
    components = {}
    for path in omni_pipeline_class(pipeline_cls)._dit_modules:
        entry = index.get(path)
        if not isinstance(entry, (list, tuple)) or entry[1] is None:
            continue
        library, class_name = entry
        model_cls = getattr(importlib.import_module(library), class_name)
        components[path] = load_transformer_mmap(model_cls, root, subfolder=path, torch_dtype=dtype)
    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    return DiffusionPipeline.from_pretrained(root, **components, **kwargs)
