"""``diffusers-omni align``: compare one transformer call under two configurations, layer by layer.

Three uses:

* one machine, two configurations: ``--a CONFIG --b CONFIG`` (``stock`` = Diffusers' own processors), each with
  optional ``--dtype-a/--dtype-b`` and ``--mode-a/--mode-b`` (``inference`` or ``training``);
* two machines: each runs ``--a CONFIG --inputs inputs.pt --save-a outputs_<machine>.pt`` on the same recorded
  inputs (``--record inputs.pt`` writes them), then ``--compare outputs_x.pt outputs_y.pt`` anywhere;
* kernel identity only: ``--a CONFIG --fingerprint job.json`` on each job, then ``--compare train.json
  rollout.json``.

Exit status: 0 aligned (bitwise, or within ``--atol``), 1 not aligned, 2 invalid input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_SIDE_HELP = "'stock' (Diffusers' processors), a backend name, or JSON {'default': ..., 'per_role': ..., 'deterministic': ...}"


def add_parser(sub) -> argparse.ArgumentParser:
    from .common import TINY_MODELS, device_arg, finite_float, non_negative_int, positive_int, steps_int

    align = sub.add_parser("align", help="per-layer comparison of a transformer call under two configurations")
    align.add_argument("--model", default="tiny-flux", help=f"a local model directory, a hub id, or one of {', '.join(TINY_MODELS)}")
    align.add_argument("--a", help=f"side a: {_SIDE_HELP} (default: the platform default)")
    align.add_argument("--b", help="side b, same forms as --a; omit to run side a only (with --save-a/--fingerprint)")
    for side in ("a", "b"):
        align.add_argument(f"--dtype-{side}", choices=["float32", "bfloat16", "float16"], help=f"run side {side} in this dtype")
        align.add_argument(f"--mode-{side}", choices=["inference", "training"], default="inference", help=f"side {side}: no_grad inference or a training-mode forward")
        align.add_argument(f"--save-{side}", help=f"write side {side}'s per-layer outputs and fingerprint (torch file)")
    align.add_argument("--inputs", help="replay transformer inputs recorded earlier (--record) instead of running the pipeline")
    align.add_argument("--record", help="write the recorded transformer inputs here")
    align.add_argument("--call-index", type=non_negative_int, default=0, help="which transformer forward to record (0 = first step)")
    align.add_argument("--prompt", default="a lighthouse on a cliff at dawn")
    align.add_argument("--steps", type=steps_int, default=2)
    align.add_argument("--height", type=positive_int, default=32)
    align.add_argument("--width", type=positive_int, default=32)
    align.add_argument("--frames", type=positive_int, default=5, help="video pipelines: number of frames")
    align.add_argument("--seed", type=int, default=0)
    align.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="torch_dtype for from_pretrained")
    align.add_argument("--device", type=device_arg, help="cuda, cuda:N, mps, cpu (default: cuda when available)")
    align.add_argument("--fingerprint", help="write side a's kernel fingerprint (JSON) here")
    align.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved files: fingerprints (.json) or layer outputs")
    align.add_argument("--atol", type=finite_float, help="aligned when every layer's max abs error is within this (default: bitwise)")
    align.add_argument("--json", help="write the report as JSON here")
    align.add_argument("-v", "--verbose", action="count", default=0, help="-v: INFO logs, -vv: DEBUG")
    return align


def _compare_files(args) -> int:
    from ..alignment import LayerOutputs, compare_fingerprints, compare_layer_outputs, load_fingerprint

    from .common import UsageError

    first, second = args.compare
    for path in (first, second):
        if not Path(path).is_file():
            raise UsageError(f"--compare {path!r}: no such file")
    if first.endswith(".json") and second.endswith(".json"):
        comparison = compare_fingerprints(load_fingerprint(first), load_fingerprint(second))
        print(comparison.table())
        print(f"\nresult: {'kernels match' if comparison.matches else 'kernels differ: ' + ', '.join(comparison.mismatched_roles)}")
        payload, ok = comparison.to_dict(), comparison.matches
    else:
        report = compare_layer_outputs(LayerOutputs.load(first), LayerOutputs.load(second), atol=args.atol)
        print(report.table())
        payload, ok = report.to_dict(), report.aligned
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0 if ok else 1


def _record(args, pipe):
    import torch

    from ..alignment import record_transformer_inputs

    kwargs = {
        "prompt": args.prompt,
        "num_inference_steps": args.steps,
        "height": args.height,
        "width": args.width,
        "generator": torch.Generator(device="cpu").manual_seed(args.seed),
    }
    if "Wan" in type(pipe).__name__:
        kwargs["num_frames"] = args.frames
    if "ImageToVideo" in type(pipe).__name__:
        from PIL import Image

        kwargs["image"] = Image.new("RGB", (args.width, args.height), "gray")
    return record_transformer_inputs(pipe, call_index=args.call_index, **kwargs)


def run(args) -> int:
    import torch

    from ..alignment import AlignmentSide, RecordedInputs, capture_layers, compare_layer_outputs, save_fingerprint
    from .common import UsageError, configure_logging, load_pipeline

    configure_logging(args.verbose)
    if args.inputs is not None and not Path(args.inputs).is_file():
        raise UsageError(f"--inputs={args.inputs!r}: no such file")
    if args.compare:
        return _compare_files(args)
    sides = {}
    for name in ("a", "b"):
        value = getattr(args, name)
        if value is None and name == "b":
            continue
        dtype = getattr(args, f"dtype_{name}")
        sides[name] = AlignmentSide(
            attention=value if value is not None else "auto",
            dtype=getattr(torch, dtype) if dtype else None,
            mode=getattr(args, f"mode_{name}"),
            label=name,
        )
    pipe = load_pipeline(args.model, getattr(torch, args.dtype) if args.dtype else None)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe.to(device)
    if args.inputs:
        inputs = RecordedInputs.load(args.inputs)
    else:
        inputs = _record(args, pipe)
        if args.record:
            print(f"wrote recorded transformer inputs to {inputs.save(args.record)}")
    model = pipe.transformer
    captures = {name: capture_layers(model, inputs, side) for name, side in sides.items()}
    for name, capture in captures.items():
        path = getattr(args, f"save_{name}")
        if path:
            print(f"wrote side {name} layer outputs to {capture.save(path)}")
    if args.fingerprint:
        print(f"wrote side a kernel fingerprint to {save_fingerprint(captures['a'].fingerprint, args.fingerprint)}")
    if "b" not in captures:
        from ..utils.text import table

        roles = [{"role": role, **entry} for role, entry in captures["a"].fingerprint["roles"].items()]
        print(table(roles, ["role", "backend", "implementation", "deterministic", "call", "modules"]))
        return 0
    report = compare_layer_outputs(captures["a"], captures["b"], atol=args.atol)
    print(report.table())
    if args.json:
        print(f"wrote {report.to_json(args.json)}")
    return 0 if report.aligned else 1
