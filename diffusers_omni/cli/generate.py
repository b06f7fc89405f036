"""``diffusers-omni generate``: run a pipeline through omni attention and write the image."""

from __future__ import annotations

import time
from pathlib import Path


def run(args) -> int:
    import torch

    from ..pipelines.registry import omnify
    from .common import TINY_MODELS, configure_logging, load_pipeline, table
    from .explain import summarize

    configure_logging(args.verbose)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    started = time.perf_counter()
    pipe = load_pipeline(args.model, dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe.to(device)
    loaded = time.perf_counter()
    pipe = omnify(pipe, args.attention)
    print(table(summarize(pipe.omni_attention_report()), ["role", "category", "backend", "source", "modules"]))

    kwargs = {
        "prompt": args.prompt,
        "num_inference_steps": args.steps,
        "height": args.height,
        "width": args.width,
        "generator": torch.Generator(device="cpu").manual_seed(args.seed),
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
    print(f"wrote {output}")
    return 0
