"""Entry point of the ``diffusers-omni`` command."""

from __future__ import annotations

import argparse
import sys

from .common import TINY_MODELS

_MODEL_HELP = f"a local model directory, a hub id, or one of {', '.join(TINY_MODELS)} (default: tiny-flux)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusers-omni", description="Per-role attention backends for Diffusers")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="platform, versions and every attention backend")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("--platform", help="simulate a platform: cpu, mps or sm_XY[,cudnn=N]")

    models = sub.add_parser("models", help="supported architectures, pipelines, roles and blocks")
    models.add_argument("--json", action="store_true", help="machine-readable output")

    explain = sub.add_parser("explain", help="per-role backend resolution for a pipeline")
    explain.add_argument("--model", default="tiny-flux", help=_MODEL_HELP)
    explain.add_argument("--attention", help="backend name, or JSON {'default': ..., 'per_role': ...}")
    explain.add_argument("--platform", help="simulate a platform: cpu, mps or sm_XY[,cudnn=N]")
    explain.add_argument("--json", action="store_true")
    explain.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                         help="dtype the DiTs will run in (real models are built from their configs, no weights)")
    explain.add_argument("-v", "--verbose", action="store_true")

    generate = sub.add_parser("generate", help="generate an image through omni attention")
    generate.add_argument("--model", default="tiny-flux", help=_MODEL_HELP)
    generate.add_argument("--prompt", default="a lighthouse on a cliff at dawn")
    generate.add_argument("--steps", type=int, default=4)
    generate.add_argument("--height", type=int, default=64)
    generate.add_argument("--width", type=int, default=64)
    generate.add_argument("--frames", type=int, default=5, help="video pipelines: number of frames")
    generate.add_argument("--image", help="image-to-video pipelines: conditioning image path")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--attention", help="backend name, or JSON {'default': ..., 'per_role': ...}")
    generate.add_argument("--device", help="cuda, cpu, … (default: cuda when available)")
    generate.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="torch_dtype for from_pretrained")
    generate.add_argument("--output", default="omni.png")
    generate.add_argument("-v", "--verbose", action="store_true")
    generate.add_argument("--offload", choices=["none", "model-level", "layerwise", "distributed-layerwise"],
                          default="none", help="offload strategy; distributed-layerwise runs under torchrun")
    generate.add_argument("--no-allgather", action="store_true",
                          help="distributed-layerwise: a full host copy per rank instead of 1/N shards + all-gather")
    generate.add_argument("--resident-layers", type=int, default=0,
                          help="distributed-layerwise with --no-allgather: leading blocks kept on the device")
    generate.add_argument("--rank-seeds", help="comma-separated seed per rank (default: --seed + rank)")
    generate.add_argument("--rank-prompt", action="append", help="prompt for the next rank (repeat once per rank)")
    generate.add_argument("--mmap", action="store_true",
                          help="load the DiTs as mmap views of their safetensors files (local directory or hub id)")
    generate.add_argument("--per-rank-outputs", action="store_true",
                          help="every rank writes OUTPUT with .rankN before the suffix (default: only rank 0 writes)")
    from .align import add_parser as add_align_parser
    from .warmup import add_parser as add_warmup_parser

    add_align_parser(sub)
    add_warmup_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        from .info import run
    elif args.command == "models":
        from .models import run
    elif args.command == "explain":
        from .explain import run
    elif args.command == "align":
        from .align import run
    elif args.command == "warmup":
        from .warmup import run
    else:
        from .generate import run
    try:
        return run(args)
    except (ValueError, TypeError) as exc:
        print(f"diffusers-omni {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
