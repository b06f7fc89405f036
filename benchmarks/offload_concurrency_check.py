#!/usr/bin/env python
"""Concurrent callers of one offloaded transformer on the H200 (#28 item 1).

``--threads`` threads each call one FLUX.1-size random-weight bf16 transformer (weights are views of one random
pool, as in ``offload_lifecycle_bench``) ``--calls`` times, with a different input per thread, under layerwise
offload (default window, ``prefetch_depth=2``, a budget) and model-level offload, ``--rounds`` times each. Every
output must be bitwise equal to that thread's input run alone on the resident model, with no exception and no
crash. Before the fix, four threads on CPU raised random errors and about one run in three ended in SIGSEGV; on
CUDA the copy stream, events and the caching allocator are in play, which CPU runs cannot check.

Results go to ``<out>.json`` and ``<out>.md`` (``--out`` prefix, chosen by the runner)::

    python -m benchmarks run offload-concurrency
    python -m benchmarks run offload-concurrency --smoke   # tiny model on CPU, checks the script's logic
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.offload_bench import environment
from benchmarks.offload_lifecycle_bench import MiB, build_model, make_inputs, random_pool, synchronize

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.config.offload import format_bytes


def configs(device: torch.device, model_bytes: int) -> dict[str, OffloadConfig]:
    budget = model_bytes * 3 // 4  # some blocks resident, the rest streamed
    return {
        "layerwise": OffloadConfig("layerwise", device=device, max_device_memory="none"),
        "layerwise, prefetch_depth=2": OffloadConfig("layerwise", device=device, max_device_memory="none",
                                                     prefetch_depth=2),
        f"layerwise, budget {format_bytes(budget)}": OffloadConfig("layerwise", device=device,
                                                                   max_device_memory=budget),
        "model_level": OffloadConfig("model_level", device=device),
    }


def thread_inputs(model, device: torch.device, args: argparse.Namespace) -> list[dict[str, Any]]:
    inputs = []
    for k in range(args.threads):
        x = make_inputs(model, device, args.image_tokens, args.text_tokens)
        x["hidden_states"] = x["hidden_states"] + 0.01 * k  # a different input per thread
        x["timestep"] = torch.tensor([1.0 - 0.1 * k], device=device)
        inputs.append(x)
    return inputs


def run_concurrently(model, inputs: list[dict], calls: int) -> tuple[dict, list[str]]:
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[str] = []
    barrier = threading.Barrier(len(inputs))

    def work(k: int) -> None:
        torch.set_num_threads(1)
        try:
            barrier.wait()
            for call in range(calls):
                with torch.inference_mode():
                    outputs[k, call] = model(**inputs[k])[0]
        except BaseException:  # noqa: BLE001 - reported
            errors.append(traceback.format_exc(limit=3))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outputs, errors


def check(name: str, config: OffloadConfig, pool: torch.Tensor, args: argparse.Namespace,
          device: torch.device, references: list[torch.Tensor], inputs: list[dict]) -> dict[str, Any]:
    model, _ = build_model(pool, args.smoke)
    backend = apply_offload(model, config)
    rows = []
    for round_index in range(args.rounds):
        start = time.perf_counter()
        outputs, errors = run_concurrently(model, inputs, args.calls)
        synchronize(device)
        equal = sum(torch.equal(o, references[k]) for (k, _), o in outputs.items())
        rows.append({"round": round_index, "seconds": time.perf_counter() - start, "outputs": len(outputs),
                     "bitwise_equal": equal, "errors": errors[:3], "error_count": len(errors)})
        print(f"[{name}] round {round_index}: {equal}/{args.threads * args.calls} bitwise equal, "
              f"{len(errors)} errors", flush=True)
    backend.disable()
    del model, backend
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    expected = args.threads * args.calls
    ok = all(r["error_count"] == 0 and r["outputs"] == expected and r["bitwise_equal"] == expected for r in rows)
    return {"name": name, "rows": rows, "pass": ok}


def markdown(report: dict) -> str:
    args = report["args"]
    lines = [
        "# Concurrent callers of one offloaded transformer",
        "",
        f"{args['threads']} threads × {args['calls']} calls per round, {args['rounds']} rounds per configuration; "
        f"FLUX transformer ({format_bytes(report['model_bytes'])} bf16), {args['image_tokens']} image and "
        f"{args['text_tokens']} text tokens; each output compared bitwise with its input run alone, resident.",
        "",
        "| Configuration | Rounds passed | Bitwise equal outputs | Errors | Seconds per round (mean) |",
        "|---|---|---|---|---|",
    ]
    for entry in report["results"]:
        rows = entry["rows"]
        passed = sum(r["error_count"] == 0 and r["bitwise_equal"] == r["outputs"] for r in rows)
        lines.append(f"| {entry['name']} | {passed}/{len(rows)} | {sum(r['bitwise_equal'] for r in rows)}/"
                     f"{args['threads'] * args['calls'] * len(rows)} | {sum(r['error_count'] for r in rows)} | "
                     f"{sum(r['seconds'] for r in rows) / len(rows):.2f} |")
    lines += ["", f"All checks pass: **{'yes' if report['all_checks_pass'] else 'no'}**", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script, not the GPU)")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json, PREFIX.md (the runner, python -m benchmarks run, chooses it)")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--image-tokens", type=int, default=1024, help="a square number (1024 = 512² image)")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--pool-bytes", type=int, default=512 * MiB, help="random pool the weights are views of")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds = min(args.rounds, 2)
        args.image_tokens, args.text_tokens, args.pool_bytes = 16, 8, 2 * MiB
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        torch.set_num_threads(1)  # as the worker threads do (the thread count changes CPU reduction order)
    pool = random_pool(args.pool_bytes // 2, torch.bfloat16)
    model, model_bytes = build_model(pool, args.smoke)
    model.to(device)
    inputs = thread_inputs(model, device, args)
    with torch.inference_mode():
        references = [model(**x)[0] for x in inputs]
    synchronize(device)
    del model
    gc.collect()
    report: dict[str, Any] = {"environment": environment(device), "args": vars(args), "model_bytes": model_bytes,
                              "results": []}
    for name, config in configs(device, model_bytes).items():
        report["results"].append(check(name, config, pool, args, device, references, inputs))
        out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    report["all_checks_pass"] = all(entry["pass"] for entry in report["results"])
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["all_checks_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
