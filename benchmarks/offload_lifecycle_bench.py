#!/usr/bin/env python
"""Offload lifecycle on the H200 (#13): delete-and-rebuild cycles and a long denoising run with offload on.

1. **Delete and rebuild.** For each strategy (layerwise, model-level), ``--cycles`` times: build a FLUX.1-size
   random-weight bf16 transformer, enable offload (host copies registered with ``cudaHostRegister``), run one
   forward, drop the model *without* ``disable()`` (as ``del pipe`` in a notebook does), ``gc.collect()``. After
   each cycle: no CUDA error, registered host bytes back to 0, host RSS back to the baseline taken before the
   first cycle (within ``--rss-tolerance``), device memory back to its baseline. Building a cycle's model costs no
   host copy: its parameters are views of one shared random pool (weights are read-only), so the cycle time is
   the offload's own (pack, register, forward, release).
2. **100 denoising steps.** ``--steps`` transformer forwards with an Euler update of the latents between them,
   under layerwise and model-level offload and resident: every step's output bitwise equal to resident, device
   memory growth from step 1 to the last ≤ 1 MiB. Shapes: FLUX at ``--image-tokens`` (default 1024 = 512², fewer
   than 1024²'s 4096 so the run stays within five minutes; weights streamed per step are the same) and 512 text
   tokens.

Results go to ``<out>.json`` and ``<out>.md`` (``--out`` prefix, chosen by the runner)::

    python -m benchmarks run offload-lifecycle
    python -m benchmarks run offload-lifecycle --smoke   # tiny model on CPU, checks the script's logic
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from benchmarks.offload_bench import environment, host_rss, parameters_on_meta, trim_host_heap  # noqa: E402

from diffusers_omni import OffloadConfig, apply_offload  # noqa: E402
from diffusers_omni.offload.memory import registered_host_bytes  # noqa: E402

MiB = 2**20
GiB = 2**30
STRATEGIES = ("layerwise", "model_level")


def flux_kwargs(smoke: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"guidance_embeds": True}
    if smoke:
        kwargs.update(num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=2,
                      joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
    return kwargs


def random_pool(numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(numel, generator=generator) * 0.02).to(dtype)


def build_model(pool: torch.Tensor, smoke: bool) -> tuple[nn.Module, int]:
    """A FLUX transformer whose parameters are views of ``pool`` (a different window per parameter)."""
    from diffusers import FluxTransformer2DModel

    with parameters_on_meta():
        model = FluxTransformer2DModel(**flux_kwargs(smoke))
    offset, total = 0, 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            numel = param.numel()
            if offset + numel > pool.numel():
                offset = 0
            view = pool[offset : offset + numel].view(param.shape)
            module._parameters[name] = nn.Parameter(view, requires_grad=False)
            offset = (offset + numel + 7919) % max(pool.numel() - numel, 1)
            total += numel * pool.element_size()
    return model.eval(), total


def make_inputs(model: nn.Module, device: torch.device, image_tokens: int, text_tokens: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    config = model.config
    side = int(image_tokens**0.5)
    ids = torch.zeros(side * side, 3)
    ids[:, 1] = torch.arange(side).repeat_interleave(side)
    ids[:, 2] = torch.arange(side).repeat(side)
    bf16 = torch.bfloat16
    return {
        "hidden_states": torch.randn(1, side * side, config.in_channels, generator=generator).to(device, bf16),
        "encoder_hidden_states": torch.randn(1, text_tokens, config.joint_attention_dim, generator=generator).to(
            device, bf16),
        "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=generator).to(device, bf16),
        "guidance": torch.tensor([3.5], device=device),
        "img_ids": ids.to(device),
        "txt_ids": torch.zeros(text_tokens, 3, device=device),
        "return_dict": False,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def warm_up(pool: torch.Tensor, args: argparse.Namespace, device: torch.device) -> None:
    """One resident forward before any baseline is taken: the process's one-time costs (CUDA kernel modules loaded
    into host memory, the cuBLAS workspace on the device) are not the offload's and must not count as growth."""
    model, _ = build_model(pool, args.smoke)
    model.to(device)
    inputs = make_inputs(model, device, args.cycle_image_tokens, args.text_tokens)
    with torch.inference_mode():
        model(**inputs, timestep=torch.tensor([1.0], device=device))
    synchronize(device)
    del model, inputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def offload_config(strategy: str, device: torch.device) -> OffloadConfig:
    window = {"max_device_memory": "none"} if strategy == "layerwise" else {}  # not given: auto on a GPU
    return OffloadConfig(strategy, device=device, pin_memory=True, **window)


# 1. Delete and rebuild ------------------------------------------------------------------------------------------


def cycles(strategy: str, pool: torch.Tensor, args: argparse.Namespace, device: torch.device,
           deadline: float) -> dict:
    print(f"[{strategy}] {args.cycles} delete-and-rebuild cycles", flush=True)
    gc.collect()
    trim_host_heap()
    synchronize(device)
    baseline = {"rss": host_rss()["rss"], "registered": registered_host_bytes(), "device": device_allocated(device)}
    rows, errors = [], []
    for cycle in range(args.cycles):
        if time.perf_counter() > deadline:
            errors.append(f"stopped after {cycle} cycles: time budget (--time-budget {args.time_budget} s) spent")
            break
        row: dict[str, Any] = {"cycle": cycle}
        start = time.perf_counter()
        try:
            model, nbytes = build_model(pool, args.smoke)
            inputs = make_inputs(model, device, args.cycle_image_tokens, args.text_tokens)
            t0 = time.perf_counter()
            backend = apply_offload(model, offload_config(strategy, device))
            synchronize(device)
            row["enable_s"] = time.perf_counter() - t0
            row["host_memory_mode"] = backend.stats.host_memory_mode
            row["registered_while_on"] = registered_host_bytes()
            with torch.inference_mode():
                model(timestep=torch.tensor([0.5], device=device), **inputs)
            synchronize(device)
            alive = weakref.ref(model)
            del model, backend, inputs  # dropped without disable()
            gc.collect()
            trim_host_heap()
            synchronize(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            row["freed"] = alive() is None
            row["model_bytes"] = nbytes
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            row["error"] = f"{type(error).__name__}: {error}"
            errors.append(f"cycle {cycle}: {row['error']}")
            traceback.print_exc()
            gc.collect()
        row["registered_after"] = registered_host_bytes()
        row["rss_growth"] = host_rss()["rss"] - baseline["rss"]
        row["device_growth"] = device_allocated(device) - baseline["device"]
        row["cycle_s"] = time.perf_counter() - start
        rows.append(row)
        print(f"[{strategy}] cycle {cycle}: {row['cycle_s']:.1f} s, registered while on "
              f"{row.get('registered_while_on', 0) / GiB:.2f} GiB, after {row['registered_after']} B, RSS growth "
              f"{row['rss_growth'] / MiB:+.0f} MiB, device growth {row['device_growth'] / MiB:+.1f} MiB"
              + (f", ERROR {row['error']}" if "error" in row else ""), flush=True)
    try:
        synchronize(device)  # surfaces an asynchronous CUDA error
    except Exception as error:  # noqa: BLE001
        errors.append(f"CUDA error at the end: {error}")
    checks = {
        "cycles_run": len(rows),
        "no_error": not errors and all("error" not in r for r in rows),
        "registered_back_to_baseline": all(r["registered_after"] == baseline["registered"] for r in rows),
        "registered_while_on": all(r.get("registered_while_on", 0) > 0 for r in rows) if device.type == "cuda"
        else None,
        "rss_back_to_baseline": all(r["rss_growth"] <= args.rss_tolerance for r in rows),
        "device_back_to_baseline": all(r["device_growth"] <= MiB for r in rows),
        "models_freed": all(r.get("freed") for r in rows),
    }
    return {"strategy": strategy, "baseline": baseline, "rows": rows, "errors": errors, "checks": checks}


# 2. Denoising steps -----------------------------------------------------------------------------------------------


def denoise(model: nn.Module, inputs: dict, steps: int, device: torch.device) -> tuple[list[torch.Tensor], list[int]]:
    """``steps`` forwards with an Euler update between them; every output (on the device) and the allocated
    device bytes after each step."""
    latents = inputs["hidden_states"].clone()
    outputs, allocated = [], []
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    with torch.inference_mode():
        for i in range(steps):
            timestep = torch.tensor([float(sigmas[i])], device=device)
            out = model(**{**inputs, "hidden_states": latents}, timestep=timestep)[0]
            latents = latents + (sigmas[i + 1] - sigmas[i]).item() * out
            synchronize(device)
            # Kept on the host: outputs held on the device would count as growth (99 × one output).
            outputs.append(out.cpu())
            del out
            allocated.append(device_allocated(device))
    return outputs, allocated


def denoising(pool: torch.Tensor, args: argparse.Namespace, device: torch.device) -> dict:
    print(f"[denoise] resident, {args.steps} steps", flush=True)
    model, _ = build_model(pool, args.smoke)
    inputs = make_inputs(model, device, args.image_tokens, args.text_tokens)
    model.to(device)
    start = time.perf_counter()
    reference, _ = denoise(model, inputs, args.steps, device)
    results = {"resident": {"seconds": time.perf_counter() - start}}
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for strategy in STRATEGIES:
        print(f"[denoise] {strategy}, {args.steps} steps", flush=True)
        model, _ = build_model(pool, args.smoke)
        backend = apply_offload(model, offload_config(strategy, device))
        start = time.perf_counter()
        outputs, allocated = denoise(model, inputs, args.steps, device)
        seconds = time.perf_counter() - start
        equal = [torch.equal(o, r) for o, r in zip(outputs, reference)]
        growth = allocated[-1] - allocated[0]
        results[strategy] = {
            "seconds": seconds,
            "bitwise_equal_steps": sum(equal),
            "steps": len(equal),
            "device_allocated_first": allocated[0],
            "device_allocated_last": allocated[-1],
            "device_growth": growth,
            "device_allocated_max_step": max(allocated),
            "checks": {"bitwise_equal": all(equal), "device_growth_le_1MiB": growth <= MiB},
        }
        print(f"[denoise] {strategy}: {seconds:.1f} s, {sum(equal)}/{len(equal)} steps bitwise equal, device growth "
              f"{growth} B", flush=True)
        backend.disable()
        del model, backend, outputs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


# Report -----------------------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    lines = ["# Offload lifecycle", "",
             f"Device: {report['environment'].get('device_name', report['environment'].get('device'))}. "
             f"FLUX.1-size random-weight bf16 transformer ({report['model_bytes'] / GiB:.2f} GiB), "
             f"{report['args']['cycles']} delete-and-rebuild cycles per strategy (model dropped without `disable()`, "
             f"then `gc.collect()`), {report['args']['steps']} denoising steps at {report['args']['image_tokens']} "
             f"image + {report['args']['text_tokens']} text tokens. Generated by "
             "`benchmarks/offload_lifecycle_bench.py`.", "",
             "## Delete and rebuild", "",
             "| Strategy | Cycles | Host memory | Registered while on | Registered after | Max RSS growth | "
             "Max device growth | Mean cycle (s) | No error | Back to baseline |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for entry in report["cycles"]:
        rows = entry["rows"]
        checks = entry["checks"]
        back = checks["registered_back_to_baseline"] and checks["rss_back_to_baseline"] and \
            checks["device_back_to_baseline"] and checks["models_freed"]
        lines.append(
            f"| {entry['strategy']} | {checks['cycles_run']} | {rows[0].get('host_memory_mode', '?') if rows else '?'} "
            f"| {max((r.get('registered_while_on', 0) for r in rows), default=0) / GiB:.2f} GiB "
            f"| {max((r['registered_after'] for r in rows), default=0)} B "
            f"| {max((r['rss_growth'] for r in rows), default=0) / MiB:+.0f} MiB "
            f"| {max((r['device_growth'] for r in rows), default=0) / MiB:+.2f} MiB "
            f"| {sum(r['cycle_s'] for r in rows) / max(len(rows), 1):.1f} "
            f"| {'yes' if checks['no_error'] else 'NO'} | {'yes' if back else 'NO'} |")
    errors = [e for entry in report["cycles"] for e in entry["errors"]]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {e}" for e in errors]
    lines += ["", "## Denoising steps", "",
              "| Variant | Seconds | Bitwise equal to resident | Device growth (first → last step) | ≤ 1 MiB |",
              "|---|---|---|---|---|"]
    for name, entry in report["denoise"].items():
        if name == "resident":
            lines.append(f"| resident | {entry['seconds']:.1f} | — | — | — |")
            continue
        lines.append(f"| {name} | {entry['seconds']:.1f} | {entry['bitwise_equal_steps']}/{entry['steps']} "
                     f"| {entry['device_growth']} B | {'yes' if entry['checks']['device_growth_le_1MiB'] else 'NO'} |")
    lines += ["", f"All checks pass: **{'yes' if report['all_checks_pass'] else 'NO'}**", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script, not the GPU)")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json, PREFIX.md (the runner, python -m benchmarks run, chooses it)")
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--image-tokens", type=int, default=1024, help="a square number (1024 = 512² image)")
    parser.add_argument("--cycle-image-tokens", type=int, default=256, help="tokens of the one forward per cycle")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--pool-bytes", type=int, default=512 * MiB, help="random pool the weights are views of")
    parser.add_argument("--rss-tolerance", type=int, default=512 * MiB,
                        help="allowed host RSS above the pre-cycle baseline after gc (allocator slack)")
    parser.add_argument("--time-budget", type=float, default=260.0,
                        help="seconds for the cycles of each strategy (cycles past it are reported as not run)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.cycles = min(args.cycles, 3)
        args.steps = min(args.steps, 4)
        args.image_tokens, args.cycle_image_tokens, args.text_tokens = 16, 16, 8
        args.pool_bytes = 2 * MiB
        args.rss_tolerance = 64 * MiB
    if int(args.image_tokens**0.5) ** 2 != args.image_tokens:
        parser.error(f"--image-tokens={args.image_tokens} is not a square number; allowed: 256, 1024, 4096, ...")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    pool = random_pool(args.pool_bytes // 2, torch.bfloat16)
    _, model_bytes = build_model(pool, args.smoke)
    report: dict[str, Any] = {"environment": environment(device), "args": vars(args), "model_bytes": model_bytes,
                              "cycles": [], "denoise": {}}
    warm_up(pool, args, device)
    for strategy in STRATEGIES:
        deadline = time.perf_counter() + args.time_budget
        report["cycles"].append(cycles(strategy, pool, args, device, deadline))
        out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    report["denoise"] = denoising(pool, args, device)
    checks = [c for entry in report["cycles"] for k, c in entry["checks"].items() if isinstance(c, bool)]
    checks += [entry["checks"]["cycles_run"] == args.cycles for entry in report["cycles"]]
    checks += [c for name, entry in report["denoise"].items() if name != "resident" for c in entry["checks"].values()]
    report["all_checks_pass"] = all(checks)
    report["seconds"] = time.perf_counter() - started
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out.with_suffix('.json')} and .md in {report['seconds']:.0f} s")
    return 0 if report["all_checks_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
