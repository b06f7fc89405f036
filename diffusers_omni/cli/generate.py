"""``diffusers-omni generate``: load a pipeline, enable omni attention (and offload), generate, write the result.

Images are written with PIL; videos through ``diffusers.utils.export_to_video`` (mp4, needs ``imageio`` and
``imageio-ffmpeg``: the ``video`` extra) or ``export_to_gif``; audio as 16-bit PCM .wav (stdlib ``wave``). Under
``torchrun`` only rank 0 prints.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from .common import TINY_MODELS, UsageError, check_output, check_writable, write_replacing
from .offload import collective_names, installs_nothing, is_collective, offload_config

_VIDEO_SUFFIXES = (".mp4", ".gif")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
_AUDIO_SUFFIXES = (".wav",)
# Tiny audio models: they sing their built-in example inputs (no text prompt, no size), written as a .wav.
AUDIO_TINY_MODELS = {"tiny-soulx-singer": "diffusers_omni.testing.tiny_soulx_singer:tiny_soulx_singer_inputs"}
_DEFAULT_PROMPT = "a lighthouse on a cliff at dawn"  # main.py's --prompt default


def run(args) -> int:
    import torch

    from ..pipelines.registry import omnify
    from ..utils.text import table
    from .common import configure_logging, load_pipeline
    from .explain import summarize

    offload = args.offload
    collective = is_collective(offload)
    rank_hint = int(os.environ.get("RANK", "0")) if collective else 0
    configure_logging(args.verbose, rank_hint)
    if args.output is not None:
        check_writable(Path(args.output))
    _check_flag_combinations(args)
    if args.output is not None:
        for path in _written_paths(args, Path(args.output)):
            check_output(path, args.overwrite)
    if args.image is not None:
        _check_image(args.image)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # The offload config (--offload and its flags) is built, and so validated, before anything loads.
    config = offload_config(args, device)
    dtype = _dtype(args, device)
    # Everything that can be checked without weights is checked before any are loaded.
    preflight(args, device, dtype)
    rank, world_size, own_group = _setup_distributed(offload, collective)
    say = print if rank == 0 else (lambda *a, **k: None)
    try:
        started = time.perf_counter()
        pipe = load_pipeline(args.model, dtype, mmap=args.mmap, transformer_gguf=args.transformer_gguf)
        if collective and device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
            config = dataclasses.replace(config, device=device)
        if installs_nothing(config):
            pipe.to(device)
        loaded = time.perf_counter()
        pipe = omnify(pipe, args.attention)
        if rank != 0:
            pipe.set_progress_bar_config(disable=True)
        audio = args.model in AUDIO_TINY_MODELS
        kwargs = _audio_call_kwargs(args) if audio else _call_kwargs(args, pipe, rank, world_size)
        output = _audio_output_path(args) if audio else _output_path(args, video=_accepts(pipe, "num_frames"))
        if args.output is None:  # the default name, known once the pipeline says image, video or audio
            for path in _written_paths(args, output):
                check_output(path, args.overwrite)
        if not installs_nothing(config):
            pipe.enable_omni_offload(config if rank == 0 else dataclasses.replace(config, show_progress=False))
        enabled = time.perf_counter()
        backends = summarize(pipe.omni_attention_report())
        if not args.json:
            say(table(backends, ["role", "category", "backend", "lossy", "source", "modules"], keep=["backend"]))

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        result = pipe(**kwargs)
        done = time.perf_counter()

        if world_size > 1 and args.per_rank_outputs:
            output = output.with_name(f"{output.stem}.rank{rank}{output.suffix}")
        elif rank != 0:
            return 0
        replaced = write_replacing(output, lambda path: _write(result, path))
        summary = {
            "model": args.model,
            "pipeline": type(pipe).__name__,
            "device": str(device),
            "dtype": str(next(iter(pipe.omni_dits().values())).dtype).removeprefix("torch."),
            "offload": offload,
            "steps": args.steps,
            "height": kwargs.get("height"),
            "width": kwargs.get("width"),
            "frames": kwargs.get("num_frames"),
            "guidance_scale": kwargs.get("guidance_scale"),
            "seed": kwargs["generator"].initial_seed(),
            "output": str(output),
            "replaced": replaced,
            "timings_s": {"load": loaded - started, "enable": enabled - loaded, "generate": done - enabled},
            "peak_device_memory_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
            "peak_host_rss_bytes": _peak_rss(),
            "backends": [{k: row[k] for k in ("role", "category", "backend", "source", "modules")} for row in backends],
            "world_size": world_size,
            "rank": rank,
        }
        if args.json:
            print(json.dumps(summary, indent=2))
            return 0
        model = args.model if args.model not in TINY_MODELS else f"{args.model} (random weights, built locally)"
        peak = summary["peak_device_memory_bytes"]
        print(f"model: {model} ({summary['pipeline']}, {summary['dtype']})")
        size = f"{result.audios.shape[-1]} samples" if audio else f"{kwargs['width']}×{kwargs['height']}"
        print(f"load {loaded - started:.2f} s, enable {enabled - loaded:.2f} s, generate {done - enabled:.2f} s "
              f"({size}, {args.steps} steps on {device}" + (f", peak device memory {peak / 2**30:.2f} GiB)" if peak else ")"))
        print(f"{'replaced' if replaced else 'wrote'} {output}" + (f" (rank {rank}/{world_size}, seed {summary['seed']})" if world_size > 1 else ""))
        return 0
    finally:
        _teardown(own_group)


def _written_paths(args, output: Path) -> list[Path]:
    """The files a run writes for ``output``: one, or one per rank with ``--per-rank-outputs`` (``WORLD_SIZE``)."""
    if args.per_rank_outputs and is_collective(args.offload):
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size > 1:
            return [output.with_name(f"{output.stem}.rank{rank}{output.suffix}") for rank in range(world_size)]
    return [output]


def _check_flag_combinations(args) -> None:
    """Flags that only some offload strategies read are refused elsewhere rather than ignored (the strategies' own
    flags when their config is built: ``offload_config``)."""
    per_rank = {"--rank-seeds": args.rank_seeds, "--rank-prompt": args.rank_prompt,
                "--per-rank-outputs": args.per_rank_outputs}
    for flag, value in per_rank.items():
        if value and not is_collective(args.offload):
            raise UsageError(f"{flag}={value} needs --offload {' or '.join(collective_names())} (got --offload "
                             f"{args.offload})")
    gguf = args.transformer_gguf
    if gguf is not None and not Path(gguf).is_file():
        raise UsageError(f"--transformer-gguf={gguf!r}: no such file")
    if args.output is not None:
        suffix = Path(args.output).suffix.lower()
        if suffix not in _IMAGE_SUFFIXES + _VIDEO_SUFFIXES + _AUDIO_SUFFIXES:
            raise UsageError(f"--output={args.output!r}: unknown file type {suffix or '(none)'!r}; use one of "
                             f"{', '.join(_IMAGE_SUFFIXES + _VIDEO_SUFFIXES + _AUDIO_SUFFIXES)}")


# Refuse before work: the arguments checked against the pipeline before any weights load -------------------------

_GiB = 2**30
# Per denoising step, the schedule holds at once the pipeline's float64 sigmas (8 bytes) and the scheduler's
# timesteps and sigmas (FlowMatch's ``set_timesteps`` peaked at ~20 bytes a step, measured; 16 counted): a lower
# bound, so a refusal is certain to be right.
_SCHEDULE_BYTES_PER_STEP = 24


class _Skeleton:
    """What a pipeline is, without its weights: the Omni class, and (when it can be built) the Diffusers pipeline
    object around its VAE and DiT made on the meta device from their configs (no storage), the rest ``None``."""

    def __init__(self, omni_cls: type, pipe: Any = None, dit: Any = None, vae_config: dict | None = None) -> None:
        self.omni_cls, self.pipe, self.dit, self.vae_config = omni_cls, pipe, dit, vae_config or {}


def _read_config(model: str, name: str) -> dict | None:
    """A config file of a local pipeline directory, or of a hub repository (that one file is downloaded)."""
    root = Path(model).expanduser()
    try:
        if root.is_dir():
            path = root / name
            return json.loads(path.read_text()) if path.is_file() else None
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model, name)).read_text())
    except Exception:  # offline, no such file or repository, unreadable JSON: the load reports it
        return None


def _meta_module(entry: Any, config: dict | None):
    """A component built on the meta device from its ``model_index.json`` entry and config (no storage)."""
    import importlib

    import torch

    if config is None or not isinstance(entry, (list, tuple)) or entry[1] is None:
        return None
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    with torch.device("meta"):
        return cls.from_config(config)


def _build_skeleton(pipeline_cls: type, components: dict[str, Any]):
    """The pipeline object around the given components (every other one ``None``), or ``None`` when its
    ``__init__`` needs more than that."""
    parameters = inspect.signature(pipeline_cls.__init__).parameters
    kwargs = {name: components.get(name) for name, p in parameters.items()
              if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
              and (name in components or p.default is inspect.Parameter.empty)}
    try:
        return pipeline_cls(**kwargs)
    except Exception:
        return None


def skeleton(model: str) -> _Skeleton | None:
    """The pipeline ``model`` names, from configs only: a tiny model's factories, a local directory's
    ``model_index.json`` and component configs, or those files of a hub repository. ``None`` when they cannot be
    read (the load then reports why); a pipeline diffusers-omni does not support is refused here (``TypeError``)."""
    import logging

    from diffusers.utils import logging as diffusers_logging

    from ..utils.quiet import quiet_torchvision_fallback
    from .common import check_model

    check_model(model)
    previous = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity(logging.ERROR)
    try:
        with quiet_torchvision_fallback():
            return _tiny_skeleton(model) if model in TINY_MODELS else _config_skeleton(model)
    finally:
        diffusers_logging.set_verbosity(previous)


def _tiny_skeleton(model: str) -> _Skeleton:
    import torch

    from ..pipelines.registry import omni_pipeline_class
    from ..testing.tiny import tiny_pipeline_parts

    if model == "tiny-nextstep":
        from ..testing.tiny_nextstep import tiny_nextstep_parts

        pipeline_cls, vae_factory, dit_factory = tiny_nextstep_parts()
    elif model == "tiny-bagel":
        from ..testing.tiny_bagel import tiny_bagel_parts

        pipeline_cls, vae_factory, dit_factory = tiny_bagel_parts()
    else:
        pipeline_cls, vae_factory, dit_factory = tiny_pipeline_parts(model)
    omni_cls = omni_pipeline_class(pipeline_cls)
    with torch.device("meta"):
        vae = vae_factory()
        dit = dit_factory(vae)
    pipe = _build_skeleton(pipeline_cls, {"vae": vae, omni_cls._dit_modules[0]: dit})
    return _Skeleton(omni_cls, pipe, dit, dict(vae.config))


def _config_skeleton(model: str) -> _Skeleton | None:
    import diffusers

    from ..pipelines.registry import omni_pipeline_class

    index = _read_config(model, "model_index.json")
    if index is None:
        return published_skeleton(model)
    if "_class_name" not in index:
        return None
    pipeline_cls = getattr(diffusers, index["_class_name"], None)
    if pipeline_cls is None:
        return None
    omni_cls = omni_pipeline_class(pipeline_cls)
    dit_name = next((n for n in omni_cls._dit_modules if isinstance(index.get(n), (list, tuple))
                     and index[n][1] is not None), None)
    vae_config = _read_config(model, "vae/config.json") if "vae" in index else None
    dit_config = _read_config(model, f"{dit_name}/config.json") if dit_name else None
    try:
        vae = _meta_module(index.get("vae"), vae_config)
        dit = _meta_module(index.get(dit_name), dit_config) if dit_name else None
    except Exception:  # a component class this diffusers does not have: the load reports it
        return _Skeleton(omni_cls, vae_config=vae_config)
    pipe = None
    if vae is not None and dit is not None:
        pipe = _build_skeleton(pipeline_cls, {"vae": vae, dit_name: dit})
    return _Skeleton(omni_cls, pipe, dit, vae_config)


def published_skeleton(model: str) -> _Skeleton | None:
    """The skeleton of a repository published without model_index.json (``PUBLISHED_LAYOUTS``), from its configs."""
    import torch

    from ..pipelines.registry import omni_pipeline_class
    from .common import published_layout_class

    pipeline_cls = published_layout_class(model)
    if pipeline_cls is None:
        return None
    omni_cls = omni_pipeline_class(pipeline_cls)
    try:
        with torch.device("meta"):
            vae, dit = pipeline_cls.skeleton_components(_read_config(model, "config.json"),
                                                        _read_config(model, "vae/config.json"))
    except Exception:  # an unreadable config: the load reports it
        return _Skeleton(omni_cls)
    pipe = _build_skeleton(pipeline_cls, {"vae": vae, omni_cls._dit_modules[0]: dit})
    return _Skeleton(omni_cls, pipe, dit, dict(vae.config))


def preflight(args, device: str, dtype: Any) -> _Skeleton | None:
    """Refuse, before any weights load, every argument the pipeline's configs already rule out: the output type
    (image or video, an installed mp4 encoder), flags the pipeline takes no value for, height/width against its
    multiple and the DiT's position table, frames against the VAE's temporal multiple, and sizes and steps whose
    smallest allocation cannot fit in the memory of the machine. Flags left out get the pipeline's defaults here
    (``fill_defaults``), so they are checked too."""
    if args.steps is not None:
        _check_steps(args.steps)
    if args.model in AUDIO_TINY_MODELS:
        _audio_preflight(args)
        return None
    plan = skeleton(args.model)
    if plan is None:
        return None
    name = plan.omni_cls.__name__
    if getattr(args, "offload", None) == "model-level" and not getattr(plan.omni_cls, "_model_level_offload", True):
        raise UsageError(f"--offload model-level: {name} does not support model-level offload (its one backbone "
                         "would never leave the device); use --offload layerwise")
    takes = inspect.signature(plan.omni_cls.__call__).parameters
    video = "num_frames" in takes
    if args.output is not None:
        _output_path(args, video=video)
    for flag, parameter, value in (("--negative-prompt", "negative_prompt", args.negative_prompt),
                                   ("--guidance-scale", "guidance_scale", args.guidance_scale),
                                   ("--frames", "num_frames", args.frames), ("--image", "image", args.image)):
        if value is not None and parameter not in takes:
            raise UsageError(f"{flag}={value!r}: {name} takes no {parameter}")
    fill_defaults(args, plan.omni_cls, plan.pipe)
    if args.steps is not None:
        _check_steps(args.steps)
    frames = args.frames if video else 1
    if args.height is None or args.width is None:
        return plan  # no default size from the configs alone: the loaded pipeline gives it (``call_kwargs``)
    if plan.pipe is not None:
        multiple, why = _spatial_multiple(plan.pipe, plan.dit)
        for flag, value in (("--height", args.height), ("--width", args.width)):
            if value % multiple:
                raise UsageError(f"{flag}={value}: {name} needs a multiple of {multiple} ({why}); e.g. "
                                 f"{max(multiple, value // multiple * multiple)}")
        temporal = _temporal_multiple(plan.pipe) if video else None
        if frames is not None and temporal and (frames - 1) % temporal:
            raise UsageError(f"--frames={frames}: {name} needs 1 + a multiple of {temporal} frames (e.g. "
                             f"{(frames - 1) // temporal * temporal + 1})")
        _check_positions(args, plan, name, multiple, frames, temporal)
    _check_memory(args, plan, device, dtype, frames or 1)
    return plan


# The tiny models' sizes: small enough that the README's first command runs in seconds on a CPU.
TINY_DEFAULTS = {"height": 64, "width": 64, "steps": 4, "frames": 5}
# Autoregressive tiny models write one token per 4 x 4 pixels: a smaller image keeps them as quick.
TINY_MODEL_DEFAULTS = {"tiny-nextstep": {"height": 16, "width": 16, "steps": 2}}


def pipeline_defaults(pipeline_cls: type, pipe: Any = None) -> dict[str, Any]:
    """The defaults ``pipeline_cls``'s ``__call__`` uses for what it is not given: ``steps``
    (``num_inference_steps``), ``guidance_scale`` and ``frames`` (``num_frames``) from its signature, ``height`` and
    ``width`` from its signature when it declares them (Wan: 480 × 832), else ``default_sample_size ×
    vae_scale_factor`` of ``pipe`` (the pipeline object, or one built around its configs), as Diffusers' ``__call__``
    computes them (FLUX.1-dev: 128 × 8 = 1024). A value it does not declare is left out."""
    parameters = inspect.signature(pipeline_cls.__call__).parameters

    def default(name: str) -> Any:
        parameter = parameters.get(name)
        if parameter is None or parameter.default is inspect.Parameter.empty or parameter.default is None:
            return None
        return parameter.default

    found = {"steps": default("num_inference_steps"), "guidance_scale": default("guidance_scale"),
             "frames": default("num_frames"), "height": default("height"), "width": default("width")}
    sample, scale = getattr(pipe, "default_sample_size", None), getattr(pipe, "vae_scale_factor", None)
    if isinstance(sample, int) and isinstance(scale, int):
        for side in ("height", "width"):
            if found[side] is None and side in parameters:
                found[side] = sample * scale
    return {key: value for key, value in found.items() if isinstance(value, (int, float)) and value is not True}


def fill_defaults(args, pipeline_cls: type, pipe: Any = None) -> None:
    """Set every size and schedule flag left out (``None``) to its default: the tiny models' small sizes
    (``TINY_DEFAULTS``), else the pipeline's own (``pipeline_defaults``). ``--frames`` only for pipelines taking
    ``num_frames``; ``--guidance-scale`` only for those taking ``guidance_scale``. Flags given are never changed."""
    parameters = inspect.signature(pipeline_cls.__call__).parameters
    own = pipeline_defaults(pipeline_cls, pipe)
    tiny = {**TINY_DEFAULTS, **TINY_MODEL_DEFAULTS.get(args.model, {})} if args.model in TINY_MODELS else {}
    for flag, key in (("steps", "steps"), ("height", "height"), ("width", "width"), ("frames", "frames"),
                      ("guidance_scale", "guidance_scale")):
        if getattr(args, flag, None) is not None:
            continue
        if key == "frames" and "num_frames" not in parameters:
            continue
        value = tiny.get(key, own.get(key))
        if value is not None:
            setattr(args, flag, value)


def _check_positions(args, plan: _Skeleton, name: str, multiple: int, frames: int | None,
                     temporal: int | None) -> None:
    """A DiT with a fixed rotary table (Wan's ``rope_max_seq_len``) cannot place more latent patches along an axis
    than the table has rows."""
    limit = getattr(plan.dit.config, "rope_max_seq_len", None) if plan.dit is not None else None
    if not isinstance(limit, int):
        return
    for flag, value in (("--height", args.height), ("--width", args.width)):
        if value // multiple > limit:
            raise UsageError(f"{flag}={value}: {name}'s transformer places at most {limit} patches along an axis "
                             f"(rope_max_seq_len in its config), i.e. at most {limit * multiple} pixels "
                             f"({value // multiple} patches asked)")
    if frames and temporal:
        patch = getattr(plan.dit.config, "patch_size", None) or (1,)
        patch_t = patch[0] if isinstance(patch, (tuple, list)) else 1
        latent = ((frames - 1) // temporal + 1) // patch_t
        if latent > limit:
            raise UsageError(f"--frames={frames}: {name}'s transformer places at most {limit} latent frames "
                             f"(rope_max_seq_len in its config), i.e. at most {(limit * patch_t - 1) * temporal + 1} "
                             "frames")


def host_memory_bytes() -> int | None:
    """Physical memory of this machine (``None`` where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def device_memory_bytes(device: str) -> tuple[int | None, str]:
    """Total memory of ``device`` and how to name it (CPU and MPS share the host's)."""
    import torch

    dev = torch.device(device)
    backend = getattr(torch, dev.type, None) if dev.type in ("cuda", "xpu", "npu") else None
    if backend is not None and backend.is_available():
        index = dev.index if dev.index is not None else backend.current_device()
        return backend.get_device_properties(index).total_memory, f"{dev.type}:{index}"
    return host_memory_bytes(), f"{dev.type} (host memory)"


def _check_steps(steps: int) -> None:
    total = host_memory_bytes()
    if total is not None and steps * _SCHEDULE_BYTES_PER_STEP > total:
        raise UsageError(f"--steps={steps}: the denoising schedule alone keeps at least {_SCHEDULE_BYTES_PER_STEP} bytes a step "
                         f"(its sigmas and timesteps), {steps * _SCHEDULE_BYTES_PER_STEP / _GiB:.1f} GiB, more than this "
                         f"machine's {total / _GiB:.1f} GiB; at most {total // _SCHEDULE_BYTES_PER_STEP:,}")


def _decoder_channels(vae_config: dict) -> int:
    """Channels of the VAE decoder's last, full-resolution stage (3, the image itself, when the config does not
    say)."""
    if vae_config.get("block_out_channels"):
        return int(vae_config["block_out_channels"][0])
    if vae_config.get("base_dim"):
        return int(vae_config["base_dim"]) * int((vae_config.get("dim_mult") or [1])[0])
    return 3


def _check_memory(args, plan: _Skeleton, device: str, dtype: Any, frames: int) -> None:
    """Sizes whose smallest allocation cannot fit: one frame through the VAE decoder's full-resolution stage on the
    device (offloading moves DiT weights, not the decoder's activations), and the decoded frames as float32 on the
    host (the pipeline's post-processing). Lower bounds: a refusal is certain, a pass is not a promise."""
    import torch

    pixels = args.height * args.width
    element = (dtype if dtype is not None else torch.float32).itemsize
    channels = _decoder_channels(plan.vae_config)
    need = channels * pixels * element
    total, where = device_memory_bytes(device)
    size = f"--height={args.height} --width={args.width}"
    if total is not None and need > total:
        raise UsageError(f"{size}: decoding one frame needs at least {need / _GiB:.1f} GiB on {where} (the VAE "
                         f"decoder's last stage: {channels} channels × {args.height} × {args.width} × {element} bytes), "
                         f"more than its {total / _GiB:.1f} GiB")
    host = host_memory_bytes()
    need = 3 * pixels * frames * 4
    if host is not None and need > host:
        frames_text = f" × {frames} frames" if frames > 1 else ""
        raise UsageError(f"{size}{f' --frames={frames}' if frames > 1 else ''}: the decoded output needs at least "
                         f"{need / _GiB:.1f} GiB of host memory (3 channels × {args.height} × {args.width}"
                         f"{frames_text} × 4 bytes, float32), more than this machine's {host / _GiB:.1f} GiB")


def _check_image(path: str) -> None:
    """``--image`` names a file PIL can read as an image."""
    if not Path(path).is_file():
        raise UsageError(f"--image={path!r}: no such file")
    _open_image(path, verify=True)


def _open_image(path: str, verify: bool = False):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            if verify:
                image.verify()
                return None
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise UsageError(f"--image={path!r}: not an image (PIL cannot identify the file's format); give a .png, "
                         ".jpg or .webp") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise UsageError(f"--image={path!r}: cannot be read as an image ({exc})") from None


def _dtype(args, device: str):
    import torch

    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    if args.model in TINY_MODELS:
        return None
    return torch.bfloat16 if torch.device(device).type != "cpu" else None


def _accepts(pipe, name: str) -> bool:
    return name in inspect.signature(type(pipe).__call__).parameters


def _spatial_multiple(pipe, dit) -> tuple[int, str]:
    """The multiple height and width must be, and how it comes about (VAE downscale × DiT patch)."""
    spatial = next((getattr(pipe, a) for a in ("vae_scale_factor_spatial", "vae_spatial_compression_ratio",
                                               "vae_scale_factor") if isinstance(getattr(pipe, a, None), int)), 8)
    patch: Any = 1
    if dit is not None:
        patch = getattr(dit.config, "patch_size", None) or getattr(dit.config, "latent_patch_size", None) or 1
        patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
    if hasattr(pipe, "_pack_latents"):
        patch = max(int(patch), 2)
    return spatial * int(patch), f"VAE scale {spatial} × patch {patch}"


def _temporal_multiple(pipe) -> int | None:
    for attr in ("vae_scale_factor_temporal", "vae_temporal_compression_ratio"):
        value = getattr(pipe, attr, None)
        if isinstance(value, int) and value > 1:
            return value
    return None


def _call_kwargs(args, pipe, rank: int, world_size: int) -> dict:
    import torch

    name = type(pipe).__name__
    fill_defaults(args, type(pipe), pipe)
    for flag, value in (("--height", args.height), ("--width", args.width), ("--steps", args.steps)):
        if value is None:
            raise UsageError(f"{flag}: {name} declares no default (no default in its __call__, no "
                             "default_sample_size × vae_scale_factor); give --height, --width and --steps")
    multiple, why = _spatial_multiple(pipe, next(iter(pipe.omni_dits().values()), None))
    for flag, value in (("--height", args.height), ("--width", args.width)):
        if value % multiple:
            raise UsageError(f"{flag}={value}: {name} needs a multiple of {multiple} ({why}); e.g. "
                             f"{max(multiple, value // multiple * multiple)}")
    seed, prompt = _rank_request(args, rank, world_size)
    kwargs: dict[str, Any] = {
        "prompt": prompt,
        "num_inference_steps": args.steps,
        "height": args.height,
        "width": args.width,
        "generator": torch.Generator(device="cpu").manual_seed(seed),
    }
    optional = {"--negative-prompt": ("negative_prompt", args.negative_prompt),
                "--guidance-scale": ("guidance_scale", args.guidance_scale),
                "--frames": ("num_frames", args.frames),
                "--image": ("image", args.image)}
    for flag, (parameter, value) in optional.items():
        if value is not None and not _accepts(pipe, parameter):
            raise UsageError(f"{flag}={value!r}: {name} takes no {parameter}")
    if args.negative_prompt is not None:
        kwargs["negative_prompt"] = args.negative_prompt
    if args.guidance_scale is not None:
        kwargs["guidance_scale"] = args.guidance_scale
    if _accepts(pipe, "num_frames"):
        frames = args.frames
        temporal = _temporal_multiple(pipe)
        if frames is not None and temporal and (frames - 1) % temporal:
            raise UsageError(f"--frames={frames}: {name} needs 1 + a multiple of {temporal} frames (e.g. "
                             f"{(frames - 1) // temporal * temporal + 1})")
        if frames is not None:
            kwargs["num_frames"] = frames
    if _accepts(pipe, "image") and ("ImageToVideo" in name or args.image is not None):
        from PIL import Image

        kwargs["image"] = (_open_image(args.image) if args.image
                           else Image.new("RGB", (args.width, args.height), "gray"))
    if _accepts(pipe, "output_type"):
        kwargs["output_type"] = "pil"
    return kwargs


def _is_video(result) -> bool:
    return hasattr(result, "frames")


def _video_encoder() -> bool:
    try:
        import imageio  # noqa: F401
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


def _output_path(args, video: bool) -> Path:
    if args.output is None:
        return Path("omni" + ((".mp4" if _video_encoder() else ".gif") if video else ".png"))
    output = Path(args.output)
    suffix = output.suffix.lower()
    if video and suffix not in _VIDEO_SUFFIXES:
        raise UsageError(f"--output={args.output!r}: this pipeline makes a video; use .mp4 or .gif")
    if suffix in _AUDIO_SUFFIXES:
        raise UsageError(f"--output={args.output!r}: this pipeline makes {'a video' if video else 'an image'}; .wav "
                         "is for audio models (tiny-soulx-singer)")
    if not video and suffix in _VIDEO_SUFFIXES:
        raise UsageError(f"--output={args.output!r}: this pipeline makes an image; use .png, .jpg or .webp")
    if suffix == ".mp4" and not _video_encoder():
        raise UsageError(f"--output={args.output!r}: no mp4 encoder installed (pip install 'diffusers-omni[video]', "
                         "i.e. imageio and imageio-ffmpeg); or write a .gif")
    return output


def _audio_preflight(args) -> None:
    """An audio model takes none of the image/video flags and writes a .wav."""
    for flag, value in (("--height", args.height), ("--width", args.width), ("--frames", args.frames),
                        ("--image", args.image), ("--negative-prompt", args.negative_prompt),
                        ("--rank-prompt", args.rank_prompt),
                        ("--prompt", None if args.prompt == _DEFAULT_PROMPT else args.prompt)):
        if value is not None:
            raise UsageError(f"{flag}={value!r}: {args.model} sings its built-in example score (audio model); it "
                             "takes no text prompt, size, frames or image")
    if args.steps is None:
        args.steps = TINY_DEFAULTS["steps"]
    if args.output is not None:
        _audio_output_path(args)


def _audio_call_kwargs(args) -> dict:
    import importlib

    import torch

    module, _, name = AUDIO_TINY_MODELS[args.model].partition(":")
    kwargs = getattr(importlib.import_module(module), name)()
    kwargs.update(num_inference_steps=args.steps, generator=torch.Generator(device="cpu").manual_seed(args.seed),
                  output_type="np")
    if args.guidance_scale is not None:
        kwargs["guidance_scale"] = args.guidance_scale
    return kwargs


def _audio_output_path(args) -> Path:
    if args.output is None:
        return Path("omni.wav")
    if Path(args.output).suffix.lower() != ".wav":
        raise UsageError(f"--output={args.output!r}: {args.model} makes audio; use .wav")
    return Path(args.output)


def _write_wav(audio: Any, sample_rate: int, output: Path) -> None:
    """Mono 16-bit PCM: samples clipped to [-1, 1] and scaled by 32767."""
    import wave

    import numpy as np

    samples = np.asarray(audio, dtype=np.float32).reshape(-1)
    pcm = np.round(np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(str(output), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(pcm.tobytes())


def _frames(result) -> list:
    from diffusers.utils import numpy_to_pil

    frames = result.frames[0]
    if not hasattr(frames[0], "save"):
        frames = numpy_to_pil(frames)
    return list(frames)


def _write(result, output: Path) -> None:
    from diffusers.utils import export_to_gif, export_to_video

    if hasattr(result, "audios"):
        _write_wav(result.audios[0], result.sample_rate, output)
    elif not _is_video(result):
        result.images[0].save(output)
    elif output.suffix.lower() == ".gif":
        export_to_gif(_frames(result), str(output))
    else:
        export_to_video(_frames(result), str(output))


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _setup_distributed(offload: str, collective: bool) -> tuple[int, int, bool]:
    """``(rank, world_size, created)``: joins the torchrun/accelerate process group for a collective offload
    strategy (distributed layerwise)."""
    import torch
    import torch.distributed as dist

    if not collective:
        return 0, 1, False
    created = False
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise UsageError(
                f"--offload {offload} needs a distributed launch; allowed: "
                "`torchrun --nproc-per-node N -m diffusers_omni.cli.main generate ...` (or accelerate launch)"
            )
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
        created = True
    return dist.get_rank(), dist.get_world_size(), created


def _rank_request(args, rank: int, world_size: int) -> tuple[int, str]:
    """This rank's seed and prompt: ``--rank-seeds`` / ``--rank-prompt`` lists, else ``--seed + rank`` and
    ``--prompt``."""
    from ..offload.dataparallel import rank_values

    seeds = None
    if args.rank_seeds:
        try:
            seeds = [int(s) for s in args.rank_seeds.split(",")]
        except ValueError:
            raise UsageError(f"--rank-seeds={args.rank_seeds!r}: expected comma-separated integers") from None
    seed = rank_values(seeds, args.seed + rank, rank, world_size, "--rank-seeds")
    prompt = rank_values(args.rank_prompt, args.prompt, rank, world_size, "--rank-prompt")
    return seed, prompt


def _teardown(created: bool) -> None:
    if created:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


# Shared with ``compare``, which generates with the same flags (one process, no per-rank values).
call_kwargs = _call_kwargs
torch_dtype = _dtype
