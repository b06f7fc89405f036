"""``diffusers-omni generate``: load a pipeline, enable omni attention (and offload), generate, write the result.

Images are written with PIL; videos through ``diffusers.utils.export_to_video`` (mp4, needs ``imageio`` and
``imageio-ffmpeg``: the ``video`` extra) or ``export_to_gif``. Under ``torchrun`` only rank 0 prints.
"""

from __future__ import annotations

import inspect
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from .common import TINY_MODELS, UsageError, check_writable

_VIDEO_SUFFIXES = (".mp4", ".gif")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


def run(args) -> int:
    import torch

    from ..pipelines.registry import omnify
    from ..utils.text import table
    from .common import configure_logging, load_pipeline
    from .explain import summarize

    offload = args.offload
    rank_hint = int(os.environ.get("RANK", "0")) if offload == "distributed-layerwise" else 0
    configure_logging(args.verbose, rank_hint)
    if args.output is not None:
        check_writable(Path(args.output))
    _check_flag_combinations(args)
    if args.image is not None and not Path(args.image).is_file():
        raise UsageError(f"--image={args.image!r}: no such file")

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _dtype(args, device)
    rank, world_size, own_group = _setup_distributed(offload)
    say = print if rank == 0 else (lambda *a, **k: None)
    try:
        started = time.perf_counter()
        pipe = load_pipeline(args.model, dtype, mmap=args.mmap)
        if offload == "distributed-layerwise" and device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        if offload == "none":
            pipe.to(device)
        loaded = time.perf_counter()
        pipe = omnify(pipe, args.attention)
        if rank != 0:
            pipe.set_progress_bar_config(disable=True)
        kwargs = _call_kwargs(args, pipe, rank, world_size)
        output = _output_path(args, video=_accepts(pipe, "num_frames"))
        if offload == "distributed-layerwise":
            pipe.enable_distributed_layerwise_offload(
                use_allgather=not args.no_allgather, resident_layers=args.resident_layers, device=device,
                **({"show_progress": False} if rank != 0 else {}),
            )
        elif offload == "layerwise":
            options = {"prefetch_depth": args.prefetch_depth} if args.prefetch_depth is not None else {}
            pipe.enable_layerwise_offload(device=device, max_device_memory=args.max_device_memory, **options)
        elif offload == "model-level":
            pipe.enable_model_level_offload(device=device)
        enabled = time.perf_counter()
        backends = summarize(pipe.omni_attention_report())
        if not args.json:
            say(table(backends, ["role", "category", "backend", "source", "modules"]))

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        result = pipe(**kwargs)
        done = time.perf_counter()

        if world_size > 1 and args.per_rank_outputs:
            output = output.with_name(f"{output.stem}.rank{rank}{output.suffix}")
        elif rank != 0:
            return 0
        output.parent.mkdir(parents=True, exist_ok=True)
        _write(result, output)
        summary = {
            "model": args.model,
            "pipeline": type(pipe).__name__,
            "device": str(device),
            "dtype": str(next(iter(pipe.omni_dits().values())).dtype).removeprefix("torch."),
            "offload": offload,
            "steps": args.steps,
            "height": kwargs["height"],
            "width": kwargs["width"],
            "frames": kwargs.get("num_frames"),
            "seed": kwargs["generator"].initial_seed(),
            "output": str(output),
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
        print(f"load {loaded - started:.2f} s, enable {enabled - loaded:.2f} s, generate {done - enabled:.2f} s "
              f"({args.steps} steps on {device}" + (f", peak device memory {peak / 2**30:.2f} GiB)" if peak else ")"))
        print(f"wrote {output}" + (f" (rank {rank}/{world_size}, seed {summary['seed']})" if world_size > 1 else ""))
        return 0
    finally:
        _teardown(own_group)


def _check_flag_combinations(args) -> None:
    """Flags that only one offload strategy reads are refused elsewhere rather than ignored."""
    layerwise_only = {"--max-device-memory": args.max_device_memory, "--prefetch-depth": args.prefetch_depth}
    for flag, value in layerwise_only.items():
        if value is not None and args.offload != "layerwise":
            raise UsageError(f"{flag}={value} needs --offload layerwise (got --offload {args.offload})")
    distributed_only = {"--no-allgather": args.no_allgather, "--resident-layers": args.resident_layers,
                        "--rank-seeds": args.rank_seeds, "--rank-prompt": args.rank_prompt,
                        "--per-rank-outputs": args.per_rank_outputs}
    for flag, value in distributed_only.items():
        if value and args.offload != "distributed-layerwise":
            raise UsageError(f"{flag}={value} needs --offload distributed-layerwise (got --offload {args.offload})")
    if args.resident_layers and not args.no_allgather:
        raise UsageError(f"--resident-layers={args.resident_layers} needs --no-allgather")
    if args.max_device_memory is not None:
        from ..config.offload import parse_bytes

        try:
            parse_bytes(args.max_device_memory, "--max-device-memory")
        except (TypeError, ValueError) as exc:
            raise UsageError(str(exc)) from None
    if args.output is not None:
        suffix = Path(args.output).suffix.lower()
        if suffix not in _IMAGE_SUFFIXES + _VIDEO_SUFFIXES:
            raise UsageError(f"--output={args.output!r}: unknown file type {suffix or '(none)'!r}; use one of "
                             f"{', '.join(_IMAGE_SUFFIXES + _VIDEO_SUFFIXES)}")


def _dtype(args, device: str):
    import torch

    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    if args.model in TINY_MODELS:
        return None
    return torch.bfloat16 if torch.device(device).type != "cpu" else None


def _accepts(pipe, name: str) -> bool:
    return name in inspect.signature(type(pipe).__call__).parameters


def _spatial_multiple(pipe) -> tuple[int, str]:
    """The multiple height and width must be, and how it comes about (VAE downscale × DiT patch)."""
    spatial = next((getattr(pipe, a) for a in ("vae_scale_factor_spatial", "vae_spatial_compression_ratio",
                                               "vae_scale_factor") if isinstance(getattr(pipe, a, None), int)), 8)
    patch: Any = 1
    dit = next(iter(pipe.omni_dits().values()), None)
    if dit is not None:
        patch = getattr(dit.config, "patch_size", None) or 1
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
    multiple, why = _spatial_multiple(pipe)
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
        frames = args.frames if args.frames is not None else (5 if args.model in TINY_MODELS else None)
        temporal = _temporal_multiple(pipe)
        if frames is not None and temporal and (frames - 1) % temporal:
            raise UsageError(f"--frames={frames}: {name} needs 1 + a multiple of {temporal} frames (e.g. "
                             f"{(frames - 1) // temporal * temporal + 1})")
        if frames is not None:
            kwargs["num_frames"] = frames
    if _accepts(pipe, "image") and ("ImageToVideo" in name or args.image is not None):
        from PIL import Image

        kwargs["image"] = (Image.open(args.image).convert("RGB") if args.image
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
    if not video and suffix in _VIDEO_SUFFIXES:
        raise UsageError(f"--output={args.output!r}: this pipeline makes an image; use .png, .jpg or .webp")
    if suffix == ".mp4" and not _video_encoder():
        raise UsageError(f"--output={args.output!r}: no mp4 encoder installed (pip install 'diffusers-omni[video]', "
                         "i.e. imageio and imageio-ffmpeg); or write a .gif")
    return output


def _frames(result) -> list:
    from diffusers.utils import numpy_to_pil

    frames = result.frames[0]
    if not hasattr(frames[0], "save"):
        frames = numpy_to_pil(frames)
    return list(frames)


def _write(result, output: Path) -> None:
    from diffusers.utils import export_to_gif, export_to_video

    if not _is_video(result):
        result.images[0].save(output)
    elif output.suffix.lower() == ".gif":
        export_to_gif(_frames(result), str(output))
    else:
        export_to_video(_frames(result), str(output))


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _setup_distributed(offload: str) -> tuple[int, int, bool]:
    """``(rank, world_size, created)``: joins the torchrun/accelerate process group for distributed offload."""
    import torch
    import torch.distributed as dist

    if offload != "distributed-layerwise":
        return 0, 1, False
    created = False
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise UsageError(
                "--offload distributed-layerwise needs a distributed launch; allowed: "
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
