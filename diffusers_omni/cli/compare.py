"""``diffusers-omni compare``: the same generation under a reference and a candidate attention configuration.

Writes a labelled side-by-side image (reference | candidate | absolute difference amplified by a stated gain, PSNR
and SSIM under them; for a video, a grid of a few frames with the same three rows), at the pipeline's own size and
steps unless given, and prints PSNR, SSIM and the per-role attention error of the first transformer
call, plus the wall time of each run (``--json``: all of it as JSON). Model loading and the generation arguments are
``generate``'s.

Exit status: 0 compared, 1 the model cannot be loaded, 2 invalid input.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

_CONFIG_HELP = ("'stock' (Diffusers' own processors), a backend name (ours or Diffusers', e.g. native), or JSON "
                "{'default': ..., 'per_role': ...}")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


def add_parser(sub) -> argparse.ArgumentParser:
    from .common import MAX_WARMUP, TINY_MODELS, bounded_int, device_arg, finite_float, positive_int, steps_int

    compare = sub.add_parser("compare", help="quality of an attention config against a reference: side-by-side "
                                             "image, PSNR, SSIM, per-layer attention error")
    compare.add_argument("--model", default="tiny-flux",
                         help=f"a local model directory, a hub id, or one of {', '.join(TINY_MODELS)}")
    compare.add_argument("--reference", default="native", help=f"reference attention: {_CONFIG_HELP}")
    compare.add_argument("--candidate", required=True, help="candidate attention, same forms as --reference")
    compare.add_argument("--output", default="compare.png",
                         help="side-by-side image (a frame grid for videos): .png, .jpg or .webp")
    compare.add_argument("--overwrite", action="store_true", help="replace --output when it exists (default: refuse)")
    compare.add_argument("--json", action="store_true", help="print the summary as JSON instead of the tables")
    compare.add_argument("--prompt", default="a lighthouse on a cliff at dawn", help="the prompt of both runs")
    compare.add_argument("--negative-prompt", help="what to steer away from (pipelines that take one)")
    compare.add_argument("--guidance-scale", type=finite_float,
                         help="classifier-free guidance (default: the pipeline's)")
    compare.add_argument("--steps", type=steps_int,
                         help="denoising steps (default: the pipeline's, as generate; 4 for the tiny models)")
    compare.add_argument("--height", type=positive_int,
                         help="pixels; a multiple the model needs (default: the pipeline's; 64 for the tiny models)")
    compare.add_argument("--width", type=positive_int,
                         help="pixels; a multiple the model needs (default: the pipeline's; 64 for the tiny models)")
    compare.add_argument("--frames", type=positive_int,
                         help="video pipelines: number of frames (default: 5 for the tiny models, else the pipeline's)")
    compare.add_argument("--image", help="image-to-video pipelines: conditioning image path")
    compare.add_argument("--seed", type=int, default=0, help="the seed of both runs")
    compare.add_argument("--device", type=device_arg, help="cuda, cuda:N, mps, cpu (default: cuda when available)")
    compare.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                         help="auto = bfloat16 for a local or hub model on an accelerator, else float32; the tiny "
                              "models are cast to it when given")
    compare.add_argument("--diff-gain", type=finite_float,
                         help="the difference panel shows |candidate - reference| times this (default: the gain "
                              "that shows the largest difference white; the panel states it)")
    compare.add_argument("--warmup-runs", type=bounded_int(0, MAX_WARMUP), default=0,
                         help="untimed runs of each side first (kernel compilation, plan caches)")
    compare.add_argument("--no-local", action="store_true",
                         help="skip rerunning the reference processor on the candidate's inputs (local_rel_err)")
    compare.add_argument("-v", "--verbose", action="count", default=0, help="-v: INFO logs, -vv: DEBUG")
    return compare


def _side(flag: str, text: str):
    """``stock`` or a parsed ``AttentionConfig``; a bad value is refused naming the flag (exit 2)."""
    from ..alignment import AlignmentSide
    from .common import UsageError

    try:
        return AlignmentSide(attention=text).attention
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{flag}={text!r}: {exc}") from None


def _generate_args(args) -> argparse.Namespace:
    """The namespace ``generate``'s call-argument builder reads (one process, no per-rank values)."""
    return argparse.Namespace(**vars(args), rank_seeds=None, rank_prompt=None, attention=None, offload="none")


def run(args) -> int:
    import torch

    from ..alignment.quality import check_attention, compare_pipelines
    from ..pipelines.registry import omnify
    from ..utils.text import table
    from .common import TINY_MODELS, UsageError, check_output, configure_logging, load_pipeline, write_replacing
    from .generate import call_kwargs, preflight, torch_dtype

    configure_logging(args.verbose)
    output = Path(args.output)
    if output.suffix.lower() not in _IMAGE_SUFFIXES:
        raise UsageError(f"--output={args.output!r}: compare writes a still image (side by side, or a frame grid "
                         f"for videos); use one of {', '.join(_IMAGE_SUFFIXES)}")
    check_output(output, args.overwrite)
    if args.diff_gain is not None and not (args.diff_gain > 0 and math.isfinite(args.diff_gain)):
        raise UsageError(f"--diff-gain={args.diff_gain}: must be a finite number > 0")
    if args.image is not None and not Path(args.image).is_file():
        raise UsageError(f"--image={args.image!r}: no such file")
    reference = _side("--reference", args.reference)
    candidate = _side("--candidate", args.candidate)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    generate_args = _generate_args(args)
    dtype = torch_dtype(generate_args, device)
    # generate's checks before any weights load (sizes, frames, flags the pipeline takes no value for); the output
    # here is always a still image, checked above.
    preflight(argparse.Namespace(**{**vars(generate_args), "output": None}), device, dtype)
    pipe = load_pipeline(args.model, dtype)
    pipe.to(device, dtype) if dtype is not None else pipe.to(device)
    pipe = omnify(pipe, enable_attention=False)  # each run installs its own configuration
    kwargs = call_kwargs(generate_args, pipe, 0, 1)
    kwargs.pop("generator")
    kwargs.pop("output_type", None)
    for flag, text, config in (("--reference", args.reference, reference), ("--candidate", args.candidate, candidate)):
        try:  # what enabling it would refuse (a backend that cannot run a role here, a per_role key matching none)
            check_attention(pipe, config)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{flag}={text!r}: {exc}") from None
    if args.json:
        pipe.set_progress_bar_config(disable=True)
    report = compare_pipelines(pipe, reference, candidate, seed=args.seed, warmup_runs=args.warmup_runs,
                               local_errors=not args.no_local, **kwargs)
    report.diff_gain = args.diff_gain  # None: the gain that shows the largest difference white
    image, shown = report.annotated()
    replaced = write_replacing(output, image.save)
    summary = {"model": args.model, "device": str(device),
               "dtype": str(next(iter(pipe.components["transformer"].parameters())).dtype).removeprefix("torch.")
               if "transformer" in pipe.components else None,
               "output": str(output), "replaced": replaced, **report.to_dict(),
               "image": {key: shown[key] for key in ("labels", "footer", "diff_gain", "panel_scale")}}
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    model = args.model if args.model not in TINY_MODELS else f"{args.model} (random weights, built locally)"
    for name, side in (("reference", report.reference), ("candidate", report.candidate)):
        print(f"{name}:")
        print(table(side["backends"], ["role", "backend", "lossy"]))
    print()
    print(report.table())
    print(f"model: {model} ({summary['call']['pipeline']}, {summary['dtype']}, seed {args.seed})")
    print(f"{'replaced' if replaced else 'wrote'} {output}")
    return 0
