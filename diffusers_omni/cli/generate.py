"""``diffusers-omni generate``: run a pipeline through omni attention and write the image."""

from __future__ import annotations

import time
from pathlib import Path


def run(args) -> int:
    import torch

    from ..pipelines.registry import omnify
    from ..utils.text import table
    from .common import TINY_MODELS, configure_logging, load_pipeline
    from .explain import summarize

    configure_logging(args.verbose)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    offload = getattr(args, "offload", "none")
    rank, world_size, own_group = _setup_distributed(offload)
    started = time.perf_counter()
    pipe = load_pipeline(args.model, dtype, mmap=getattr(args, "mmap", False))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if offload == "distributed-layerwise" and device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    if offload == "none":
        pipe.to(device)
    loaded = time.perf_counter()
    pipe = omnify(pipe, args.attention)
    if offload == "distributed-layerwise":
        pipe.enable_distributed_layerwise_offload(
            use_allgather=not args.no_allgather, resident_layers=args.resident_layers, device=device
        )
    elif offload == "layerwise":
        pipe.enable_layerwise_offload(device=device)
    elif offload == "model-level":
        pipe.enable_model_level_offload(device=device)
    print(table(summarize(pipe.omni_attention_report()), ["role", "category", "backend", "source", "modules"]))

    seed, prompt = _rank_request(args, rank, world_size)
    kwargs = {
        "prompt": prompt,
        "num_inference_steps": args.steps,
        "height": args.height,
        "width": args.width,
        "generator": torch.Generator(device="cpu").manual_seed(seed),
    }
    if args.model in ("tiny-wan", "tiny-wan-i2v") or "Wan" in type(pipe).__name__:
        kwargs["num_frames"] = args.frames
        kwargs["output_type"] = "pil"
    if "ImageToVideo" in type(pipe).__name__:
        from PIL import Image

        kwargs["image"] = Image.open(args.image) if args.image else Image.new("RGB", (args.width, args.height), "gray")
    generating = time.perf_counter()
    result = pipe(**kwargs)
    done = time.perf_counter()

    output = Path(args.output)
    if world_size > 1 and getattr(args, "per_rank_outputs", False):
        output = output.with_name(f"{output.stem}.rank{rank}{output.suffix}")
    elif rank != 0:
        _teardown(own_group)
        return 0
    output.parent.mkdir(parents=True, exist_ok=True)
    images = result.frames[0] if hasattr(result, "frames") else result.images
    first = images[0]
    if not hasattr(first, "save"):
        from diffusers.utils import numpy_to_pil

        first = numpy_to_pil(first)[0]
    first.save(output)
    model = args.model if args.model not in TINY_MODELS else f"{args.model} (random weights, built locally)"
    print(f"model: {model}")
    print(f"load {loaded - started:.2f} s, generate {done - generating:.2f} s ({args.steps} steps on {device})")
    print(f"wrote {output}" + (f" (rank {rank}/{world_size}, seed {seed})" if world_size > 1 else ""))
    _teardown(own_group)
    return 0


def _setup_distributed(offload: str) -> tuple[int, int, bool]:
    """``(rank, world_size, created)``: joins the torchrun/accelerate process group for distributed offload."""
    import os

    import torch
    import torch.distributed as dist

    if offload != "distributed-layerwise":
        return 0, 1, False
    created = False
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ValueError(
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

    seeds = [int(s) for s in args.rank_seeds.split(",")] if getattr(args, "rank_seeds", None) else None
    seed = rank_values(seeds, args.seed + rank, rank, world_size, "--rank-seeds")
    prompt = rank_values(getattr(args, "rank_prompt", None), args.prompt, rank, world_size, "--rank-prompt")
    return seed, prompt


def _teardown(created: bool) -> None:
    if created:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
