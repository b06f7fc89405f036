"""``diffusers-omni tune``: measure every attention backend at a pipeline's real call shapes on this GPU and cache the
routing table ``auto`` follows from then on (see ``diffusers_omni.attention.tuning``)."""

from __future__ import annotations

import json

from .common import MAX_REPEATS, MAX_WARMUP, TINY_MODELS, bounded_int, device_arg, positive_int
from .offload import add_offload_arguments

_MODEL_HELP = f"a local model directory, a hub id, or one of {', '.join(TINY_MODELS)}"


def add_parser(sub):
    tune = sub.add_parser("tune", help="measure the attention backends on this GPU and cache the routing table auto uses")
    tune.add_argument("--model", default="tiny-flux", help=_MODEL_HELP)
    tune.add_argument("--prompt", default="a lighthouse on a cliff at dawn")
    tune.add_argument("--height", type=positive_int, help="pixels (default: the pipeline's; 64 for the tiny models)")
    tune.add_argument("--width", type=positive_int, help="pixels (default: the pipeline's; 64 for the tiny models)")
    tune.add_argument("--frames", type=positive_int, help="video pipelines: number of frames (default: the pipeline's)")
    tune.add_argument("--device", type=device_arg, help="cuda, cuda:N, cpu (default: cuda when available)")
    # --offload and each strategy's flags, from the registered offload configs (one process: no collective ones).
    add_offload_arguments(tune, collective=False,
                          help="run the pipeline offloaded while recording its calls (models larger than the GPU)")
    tune.add_argument("--allow-lossy", action="store_true",
                      help="also time lossy kernels (SageAttention INT8) and let auto route to them")
    tune.add_argument("--warmup", type=bounded_int(1, MAX_WARMUP), default=3, help="calls per backend before timing")
    tune.add_argument("--repeats", type=bounded_int(1, MAX_REPEATS), default=7, help="timed rounds, interleaved across backends")
    tune.add_argument("--clear", action="store_true", help="delete every tuned table in the cache and exit")
    tune.add_argument("--show", action="store_true", help="print the table auto uses here and exit")
    tune.add_argument("--json", action="store_true", help="machine-readable output")
    tune.add_argument("-v", "--verbose", action="count", default=0, help="-v: INFO logs, -vv: DEBUG")
    return tune


def _show(as_json: bool) -> int:
    from ..attention.routing import active_table, is_tuned, table_label
    from ..attention.tuning import cache_dir, environment_key, table_path
    from ..utils.text import fit

    table = active_table()
    if as_json:
        print(json.dumps({"table": table_label(table), "tuned": is_tuned(table), "cache": str(table_path(
            environment_key())), "key": environment_key(), "families": table.get("families", {})}, indent=2))
        return 0
    print(fit(f"routing table: {table_label(table)}"))
    if not is_tuned(table):
        print(fit(f"no table tuned in this environment under {cache_dir()}; run `diffusers-omni tune --model ...`"))
    return 0


def run(args) -> int:
    import torch

    from ..attention.tuning import CacheNotWritable, check_cache_writable, clear_tuned_tables
    from ..pipelines.registry import omnify
    from ..utils.text import fit, table
    from .common import UsageError, check_model, configure_logging, load_pipeline
    from .offload import installs_nothing, offload_config

    configure_logging(args.verbose)
    if args.clear:
        removed = clear_tuned_tables()
        print(f"removed {len(removed)} tuned routing table(s)")
        return 0
    if args.show:
        return _show(args.json)
    check_model(args.model)
    try:  # before anything loads or is measured: where the table will go
        check_cache_writable()
    except CacheNotWritable as exc:
        raise UsageError(str(exc)) from None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = offload_config(args, device, collective=False)  # validated before anything loads
    tiny = args.model in TINY_MODELS
    dtype = None if tiny else (torch.bfloat16 if device != "cpu" else torch.float32)
    pipe = omnify(load_pipeline(args.model, dtype))
    if installs_nothing(config):
        pipe.to(device)
    else:
        pipe.enable_omni_offload(config)
    kwargs = {"prompt": args.prompt}
    height, width = args.height, args.width
    if tiny:
        height, width = height or 64, width or 64
    if height:
        kwargs["height"] = height
    if width:
        kwargs["width"] = width
    if args.frames:
        kwargs["num_frames"] = args.frames
    elif tiny and "wan" in args.model:
        kwargs["num_frames"] = 5
    if "image" in pipe.__call__.__code__.co_varnames[: pipe.__call__.__code__.co_argcount]:
        raise ValueError(f"--model {args.model!r}: image-conditioned pipelines are not supported by tune yet; tune "
                         "the text-to-image/video pipeline of the same transformer (the attention shapes match)")
    result = pipe.tune_omni_attention(allow_lossy=args.allow_lossy, warmup=args.warmup, repeats=args.repeats,
                                      **kwargs)
    if args.json:
        print(json.dumps({"path": result.path, "seconds": result.seconds, "shapes": result.shapes,
                          "families": result.table["families"], "measured": result.table["measured"]}, indent=2))
        return 0
    print(f"tuned in {result.seconds:.1f} s; table written to {result.path}")
    print(table(result.summary(), ["shape", "fastest", "times (ms)", "failed"]))
    measured = result.table.get("measured", [])
    timed = sorted({name for shape in measured for name in shape["seconds"]})
    if all(len(shape["seconds"]) <= 1 for shape in measured):
        only = ", ".join(timed) or "no backend"
        print(fit(f"only {only} could run these shapes here: nothing to choose between, so `auto` runs as before "
                  "(install another backend, e.g. pip install 'diffusers-omni[flash]', and tune again)"))
    else:
        print(fit("`auto` now routes each shape class to its fastest backend here; `diffusers-omni explain` shows "
                  "the margins"))
    return 0
