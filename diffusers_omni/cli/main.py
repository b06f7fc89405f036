"""Entry point of the ``diffusers-omni`` command.

Exit status: 0 success, 1 the command ran and failed (``align``: not aligned; a model that cannot be loaded), 2
invalid input (the message names the flag and the value), 130 interrupted (Ctrl-C), 141 the reader of stdout went
away (``diffusers-omni models | head -3``; nothing is printed then).
"""

from __future__ import annotations

import argparse
import sys

from ..config.names import did_you_mean
from ..utils.versions import omni_version
from .common import (TINY_MODELS, UsageError, check_attention_environment, check_hub_model, check_model, device_arg,
                     finite_float, positive_int, steps_int)
from .offload import add_offload_arguments

_MODEL_HELP = f"a local model directory, a hub id, or one of {', '.join(TINY_MODELS)}"
_PLATFORM_HELP = "simulate a platform: cpu, mps or sm_XY[,cudnn=N]"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` where there is a default worth showing (not for flags and unset options)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """``argparse`` with defaults in ``--help`` and "did you mean" for a mistyped choice or subcommand."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """Every parse error is one line and exit status 2, as the commands' own errors are (no usage block)."""
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        # Unknown arguments are found by the top parser; name the subcommand they were given to.
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(namespace, "command", None)
            prog = f"{self.prog} {command}" if command else self.prog
            self.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extras)} (see {prog} --help)\n")
        return namespace

    def _check_value(self, action: argparse.Action, value) -> None:
        if action.choices is not None and value not in action.choices:
            choices = [str(c) for c in action.choices]
            hint = did_you_mean(value, choices, prefix=" (did you mean ", suffix="?)")
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint}; choose from {', '.join(choices)}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="diffusers-omni", description="Per-role attention backends and CPU offload for Diffusers")
    parser.add_argument("--version", action="version", version=f"%(prog)s {omni_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,models,explain,generate,align,warmup,tune,compare}")

    info = sub.add_parser("info", help="platform, versions and every attention backend (paste it into bug reports)")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("--platform", help=_PLATFORM_HELP)

    models = sub.add_parser("models", help="supported architectures, pipelines, roles and blocks")
    models_format = models.add_mutually_exclusive_group()
    models_format.add_argument("--json", action="store_true", help="machine-readable output")
    models_format.add_argument("--markdown", action="store_true",
                               help="the Markdown table of the docs (default: a table fitted to the terminal)")

    explain = sub.add_parser("explain", help="per-role backend resolution for a pipeline")
    explain.add_argument("--model", default="tiny-flux", help=_MODEL_HELP)
    explain.add_argument("--attention", help="backend name (ours or Diffusers'), or JSON {'default': ..., 'per_role': ...}")
    explain.add_argument("--platform", help=_PLATFORM_HELP)
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                         help="dtype the DiTs will run in (real models are built from their configs, no weights)")
    explain.add_argument("-v", "--verbose", action="count", default=0, help="-v: INFO logs, -vv: DEBUG")
    explain.add_argument("--device", type=device_arg,
                         help="with --offload: the device whose memory auto budgets read (default: cuda when available)")
    add_offload_arguments(explain, collective=False,
                          help="also explain this offload's budgets (what \"auto\" reads on --device and chooses)")

    generate = sub.add_parser("generate", help="generate an image or a video through omni attention")
    generate.add_argument("--model", default="tiny-flux", help=_MODEL_HELP)
    generate.add_argument("--prompt", default="a lighthouse on a cliff at dawn")
    generate.add_argument("--negative-prompt", help="what to steer away from (pipelines that take one)")
    generate.add_argument("--guidance-scale", type=finite_float, help="classifier-free guidance (default: the pipeline's)")
    generate.add_argument("--steps", type=steps_int,
                          help="denoising steps (default: the pipeline's, e.g. 28 for FLUX.1-dev; 4 for the tiny models)")
    generate.add_argument("--height", type=positive_int,
                          help="pixels; a multiple the model needs (default: the pipeline's, e.g. 1024 for FLUX.1-dev; "
                               "64 for the tiny models)")
    generate.add_argument("--width", type=positive_int,
                          help="pixels; a multiple the model needs (default: the pipeline's; 64 for the tiny models)")
    generate.add_argument("--frames", type=positive_int,
                          help="video pipelines: number of frames (default: the pipeline's; 5 for the tiny models)")
    generate.add_argument("--image", help="image-to-video pipelines: conditioning image path")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--attention", help="backend name (ours or Diffusers'), or JSON {'default': ..., 'per_role': ...}")
    generate.add_argument("--device", type=device_arg, help="cuda, cuda:N, mps, cpu (default: cuda when available)")
    generate.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                          help="torch_dtype; auto = bfloat16 for a local or hub model on an accelerator, else float32 "
                               "(the tiny models are float32)")
    generate.add_argument("--output", help="where to write: .png/.jpg for images, .mp4 or .gif for videos, .wav for "
                                           "audio (default: omni.png, or omni.mp4 for a video — omni.gif without a "
                                           "video encoder — or omni.wav for audio)")
    generate.add_argument("--overwrite", action="store_true", help="replace --output when it exists (default: refuse)")
    generate.add_argument("--json", action="store_true",
                          help="print a JSON summary (timings, peak memory, backends) instead of the tables")
    generate.add_argument("-v", "--verbose", action="count", default=0, help="-v: INFO logs, -vv: DEBUG")
    add_offload_arguments(generate)  # --offload and each strategy's flags, from the registered offload configs
    generate.add_argument("--rank-seeds", help="comma-separated seed per rank (default: --seed + rank)")
    generate.add_argument("--rank-prompt", action="append", help="prompt for the next rank (repeat once per rank)")
    generate.add_argument("--mmap", action="store_true",
                          help="load the DiTs as mmap views of their safetensors files (local directory or hub id)")
    generate.add_argument("--transformer-gguf", metavar="FILE",
                          help="load the pipeline's transformer from this GGUF file (load_gguf_mmap: its quantized "
                               "weights stay views of the file, so --max-host-memory reads their blocks back from "
                               "it); the other components and the transformer's config come from --model")
    generate.add_argument("--per-rank-outputs", action="store_true",
                          help="every rank writes OUTPUT with .rankN before the suffix (default: only rank 0 writes)")
    from .align import add_parser as add_align_parser
    from .compare import add_parser as add_compare_parser
    from .tune import add_parser as add_tune_parser
    from .warmup import add_parser as add_warmup_parser

    add_align_parser(sub)
    add_warmup_parser(sub)
    add_compare_parser(sub)
    add_tune_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    command = "diffusers-omni"
    try:
        args = build_parser().parse_args(argv)
        command = f"diffusers-omni {args.command}"
        # Before any command imports Diffusers (which raises deep in its import on a bad DIFFUSERS_ATTN_BACKEND).
        check_attention_environment()
        if getattr(args, "model", None) is not None and not getattr(args, "show", False) and not getattr(
                args, "clear", False):
            # Before any command imports Diffusers: a model id that is no directory is answered in seconds.
            check_model(args.model)
            check_hub_model(args.model)
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
        elif args.command == "compare":
            from .compare import run
        elif args.command == "tune":
            from .tune import run
        else:
            from .generate import run
        return run(args)
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`diffusers-omni models | head -3`): stop quietly, as `cat` would, with the
        # status of a process ended by SIGPIPE; stdout goes to /dev/null so that the interpreter's final flush of
        # what is still buffered does not fail again.
        _silence_stdout()
        return 128 + 13
    except (UsageError, ValueError, TypeError) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        # Files and downloads: a model that cannot be read, a hub id that does not exist, a disk that is full.
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor behind sys.stdout (captured in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
