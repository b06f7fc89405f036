#!/usr/bin/env python
"""Multi-GPU benchmark of distributed layerwise offload: N ranks, one GPU each, weights mmap-loaded and sharded.

Per model (full-size random-weight bf16 FLUX.1-dev / Wan2.2-14B transformers, built as ``offload_bench.py`` builds
them), every rank measures and rank 0 gathers and reports:

1. Rank 0 builds the model and ``save_pretrained``s it to ``--ckpt-dir`` (reused when already complete); every
   rank then loads it with ``load_transformer_mmap`` (bf16).
2. Host RSS (anonymous and file-backed) before loading, after loading and after enabling AllGather mode; device
   peak during steps. Target: anonymous growth ≤ 1.05 × streamed block bytes ÷ N + non-block bytes.
3. Pinned host→device bandwidth with every rank copying at once, and all-gather bandwidth for the largest block.
4. Step time (one transformer forward under inference_mode, median after warm-up) in AllGather and no-AllGather
   mode on N ranks, single-GPU layerwise and resident on rank 0 alone (the other ranks wait at a barrier).
   Target: AllGather step ≤ 1.1 × max(resident, streamed bytes ÷ (N × per-GPU bandwidth) + all-gathers per step).
5. All-gather time of each distinct block against bytes ÷ the measured all-gather bandwidth.
6. Data-parallel throughput: in AllGather mode every rank runs its own request (latents seeded by rank), so N
   requests take one lockstep step. Target: N ÷ AllGather step ≥ 0.85 × N ÷ single-GPU layerwise step.

Usage (results in ``<out>.json``, ``<out>.md``, ``<out>.png``)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m benchmarks run offload-multigpu          # torchrun, one process per GPU
    python -m benchmarks run offload-multigpu --smoke      # two processes: tiny models, CPU, gloo

A rank that raises prints its traceback and exits at once (torchrun then stops the others); collectives time out
after ``--timeout`` seconds, so a lost rank cannot hang the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any


import torch
import torch.distributed as dist

from benchmarks.common import pyplot, save_figure
from benchmarks.offload_bench import (
    GiB,
    _fmt,
    _gib,
    build_model,
    environment,
    free_memory,
    host_rss,
    make_inputs,
    measure_bandwidth,
    run_variant,
    synchronize,
    trim_host_heap,
)

from diffusers_omni import OffloadConfig, apply_offload, load_transformer_mmap
from diffusers_omni.config.offload import format_bytes
from diffusers_omni.offload.transports import all_gather_bytes

STEP_FACTOR, RSS_FACTOR, DP_FACTOR = 1.1, 1.05, 0.85
_DONE_MARKER = ".omni_bench_complete"


# Process group ---------------------------------------------------------------------------------------------------


class Ctx:
    """This process's rank, world size and device; set up from torchrun's environment (or one process alone)."""

    def __init__(self, smoke: bool, timeout_s: float) -> None:
        for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                           ("NVSHMEM_DISABLE_NVLS", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"),
                           ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(key, value)
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        if smoke:
            self.device = torch.device("cpu")
        elif torch.cuda.is_available():
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
        else:
            raise SystemExit("no CUDA device: run with --smoke for the CPU/gloo check of this script")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        extra = {"device_id": self.device} if self.backend == "nccl" else {}
        dist.init_process_group(self.backend, timeout=timedelta(seconds=timeout_s), **extra)

    def barrier(self) -> None:
        dist.barrier(**({"device_ids": [self.device.index]} if self.backend == "nccl" else {}))

    def log(self, message: str) -> None:
        print(f"[rank {self.rank}/{self.world}] {message}", flush=True)


# Measurements ----------------------------------------------------------------------------------------------------


def concurrent_h2d_bandwidth(ctx: Ctx, nbytes: int, repeats: int = 5) -> float:
    """This rank's pinned host→device bytes/s while every rank copies (each copy starts after a barrier)."""
    pinned = ctx.device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    times = []
    for index in range(repeats + 1):  # the first copy warms up
        ctx.barrier()
        synchronize(ctx.device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        synchronize(ctx.device)
        if index:
            times.append(time.perf_counter() - start)
    del src, dst
    free_memory(ctx.device)
    return nbytes / statistics.median(times)


def time_all_gathers(ctx: Ctx, shard_bytes: list[int], repeats: int = 5, inner: int = 3) -> float:
    """Seconds for one round of all-gathers with the given per-rank shard sizes (a block gathers one per dtype)."""
    pairs = [(torch.empty(n * ctx.world, dtype=torch.uint8, device=ctx.device),
              torch.empty(n, dtype=torch.uint8, device=ctx.device)) for n in shard_bytes]

    def gather_round() -> None:
        for output, shard in pairs:
            all_gather_bytes(output, shard, dist.group.WORLD)

    gather_round()
    times = []
    for _ in range(repeats):
        ctx.barrier()
        synchronize(ctx.device)
        start = time.perf_counter()
        for _ in range(inner):
            gather_round()
        synchronize(ctx.device)
        times.append((time.perf_counter() - start) / inner)
    del pairs
    free_memory(ctx.device)
    return statistics.median(times)


def block_layouts(backend: Any) -> Counter:
    """``{(per-dtype shard bytes, ...): block count}`` of an enabled AllGather backend's streamed blocks."""
    blocks = [b for row in backend._state.streamed for b in row if b is not None]
    return Counter(tuple(n * torch.empty(0, dtype=d).element_size() for d, n in sorted(b.store.shard.items(), key=str))
                   for b in blocks)


def discard(backend: Any) -> None:
    """Drop an AllGather backend whose model is thrown away. ``disable()`` would re-gather every block into a full
    host copy per rank (≈20 s and model-size RSS per rank for FLUX); registered host memory must still be
    unregistered before it is freed."""
    state = backend._state
    if state.transfers is not None:
        state.transfers.synchronize()
    state.hooks.remove_all()
    state.host_memory.release(backend.device)
    backend._forget()
    backend._enabled = False


def request_inputs(name: str, model: torch.nn.Module, device: torch.device, smoke: bool, seed: int) -> dict:
    """``offload_bench``'s inputs with latents drawn from ``seed``: one rank's own request."""
    inputs = make_inputs(name, model, device, smoke)
    latents = inputs["hidden_states"]
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(seed))
    inputs["hidden_states"] = noise.to(device=device, dtype=latents.dtype)
    return inputs


def model_class(name: str) -> type:
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    return {"flux": FluxTransformer2DModel, "wan": WanTransformer3DModel}[name]


def ensure_checkpoint(ctx: Ctx, name: str, args: argparse.Namespace) -> Path:
    """Rank 0 builds and saves the random-weight model unless a complete save is already there; all ranks wait."""
    folder = Path(args.ckpt_dir) / (f"{name}-smoke" if args.smoke else name)
    if ctx.rank == 0:
        if (folder / _DONE_MARKER).exists():
            ctx.log(f"{name}: reusing checkpoint {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
            start = time.perf_counter()
            model, nbytes = build_model(name, args.smoke)
            model.save_pretrained(folder, max_shard_size="5GB")
            (folder / _DONE_MARKER).write_text(json.dumps({"param_bytes": nbytes}))
            del model
            free_memory(torch.device("cpu"))
            ctx.log(f"{name}: built and saved {_gib(nbytes)} to {folder} in {time.perf_counter() - start:.1f} s")
    ctx.barrier()
    return folder


def distributed_mode(ctx: Ctx, name: str, folder: Path, args: argparse.Namespace, use_allgather: bool) -> dict:
    """mmap-load, enable distributed layerwise offload, time steps (this rank's own request), tear down."""
    cls = model_class(name)
    free_memory(ctx.device)
    rss = {"before_load": host_rss()}
    model = load_transformer_mmap(cls, folder, torch_dtype=torch.bfloat16)
    rss["after_load"] = host_rss()
    param_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    inputs = request_inputs(name, model, ctx.device, args.smoke, seed=1000 + ctx.rank)
    extra: dict[str, Any] = {}

    def setup():
        backend = apply_offload(model, OffloadConfig("distributed_layerwise", device=ctx.device,
                                                     use_allgather=use_allgather))
        trim_host_heap()
        rss["after_enable"] = host_rss()
        extra["host_bytes"] = backend.stats.host_bytes
        if use_allgather:
            extra["layouts"] = block_layouts(backend)
        ctx.barrier()  # steps start together (no-AllGather ranks would otherwise run at different times)
        return backend

    label = f"distributed {'AllGather' if use_allgather else 'no-AllGather'} N={ctx.world}"
    result = run_variant(label, setup, discard if use_allgather else (lambda b: b.disable()), model, inputs,
                         ctx.device, args)
    del model, inputs
    free_memory(ctx.device)
    growth = rss["after_enable"]["anon"] - rss["before_load"]["anon"]
    result.update(rss=rss, param_bytes=param_bytes, host_bytes=extra["host_bytes"], anon_growth=growth)
    if use_allgather:
        result["layouts"] = extra["layouts"]
        streamed = result["streamed_bytes"]
        limit = RSS_FACTOR * streamed / ctx.world + max(param_bytes - streamed, 0)
        ctx.log(f"{name}: anonymous RSS +{format_bytes(growth)} after mmap load + AllGather enable (target ≤ "
                f"{format_bytes(limit)}: {_fmt(growth <= limit)}); file-backed "
                f"{format_bytes(rss['after_enable']['file'])}")
    return result


def single_gpu_modes(ctx: Ctx, name: str, folder: Path, args: argparse.Namespace) -> dict:
    """Rank 0 alone: layerwise offload and resident on one device, from fresh mmap loads."""
    cls = model_class(name)
    model = load_transformer_mmap(cls, folder, torch_dtype=torch.bfloat16)
    inputs = request_inputs(name, model, ctx.device, args.smoke, seed=1000)
    config = OffloadConfig("layerwise", device=ctx.device, max_device_memory="none")
    layerwise = run_variant("layerwise (1 GPU)", lambda: apply_offload(model, config), lambda b: b.disable(), model,
                            inputs, ctx.device, args)
    del model
    free_memory(ctx.device)
    model = load_transformer_mmap(cls, folder, torch_dtype=torch.bfloat16)
    param_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    resident: dict[str, Any]
    free = torch.cuda.mem_get_info(ctx.device)[0] if ctx.device.type == "cuda" else None
    if free is not None and param_bytes + 8 * GiB > free:
        resident = {"skipped": f"{_gib(param_bytes)} of weights + 8 GiB for activations > {_gib(free)} free"}
    else:
        try:
            resident = run_variant("resident (1 GPU)", lambda: model.to(ctx.device), lambda _: None, model, inputs,
                                   ctx.device, args)
        except torch.OutOfMemoryError as error:
            resident = {"skipped": f"out of device memory: {str(error).splitlines()[0]}"}
    del model, inputs
    free_memory(ctx.device)
    if "skipped" in resident:
        ctx.log(f"resident step skipped: {resident['skipped']}")
    return {"layerwise": layerwise, "resident": resident}


def benchmark_model(ctx: Ctx, name: str, args: argparse.Namespace) -> dict:
    folder = ensure_checkpoint(ctx, name, args)
    allgather = distributed_mode(ctx, name, folder, args, use_allgather=True)
    layouts: Counter = allgather.pop("layouts")
    blocks = [{"shard_bytes": list(k), "block_bytes": sum(k) * ctx.world, "count": c,
               "gather_s": time_all_gathers(ctx, list(k))}
              for k, c in sorted(layouts.items(), key=lambda kv: -sum(kv[0]))]
    largest = blocks[0]["block_bytes"] if blocks else 0
    gather_bw = largest / time_all_gathers(ctx, [largest // ctx.world]) if largest else None
    no_allgather = distributed_mode(ctx, name, folder, args, use_allgather=False)
    single = None
    if ctx.rank == 0:
        single = single_gpu_modes(ctx, name, folder, args)
    ctx.barrier()
    return {"rank": ctx.rank, "allgather": allgather, "no_allgather": no_allgather, "blocks": blocks,
            "gather_bytes_per_s": gather_bw, "gather_per_step_s": sum(b["gather_s"] * b["count"] for b in blocks),
            "single_gpu": single}


# Targets and reports ---------------------------------------------------------------------------------------------


def summarize(name: str, ranks: list[dict], bandwidths: list[dict]) -> dict:
    """Rank 0: one model's per-rank records → the model's entry with its targets (slowest rank counts)."""
    world = len(ranks)
    first = ranks[0]
    streamed = first["allgather"]["streamed_bytes"]
    param_bytes = first["allgather"]["param_bytes"]
    h2d = min(b["h2d_bytes_per_s"] for b in bandwidths)
    gather_step = max(r["gather_per_step_s"] for r in ranks)
    allgather_step = max(r["allgather"]["step_s"] for r in ranks)
    single = first["single_gpu"]  # rank 0's; the other ranks have None
    for r in ranks:
        del r["single_gpu"]
    resident_step = single["resident"].get("step_s")
    layerwise_step = single["layerwise"]["step_s"]
    floor = streamed / (world * h2d) + gather_step
    nonblock = max(param_bytes - streamed, 0)
    worst = max(ranks, key=lambda r: r["allgather"]["anon_growth"])
    gather_bw = min(r["gather_bytes_per_s"] or float("inf") for r in ranks)
    blocks = [dict(b, gather_s=max(r["blocks"][i]["gather_s"] for r in ranks),
                   predicted_s=b["block_bytes"] / gather_bw) for i, b in enumerate(first["blocks"])]
    speedup = world * layerwise_step / allgather_step
    targets = [
        {"target": f"host anonymous RSS growth, load + enable AllGather (worst: rank {worst['rank']})",
         "measured": worst["allgather"]["anon_growth"], "limit": RSS_FACTOR * streamed / world + nonblock,
         "unit": "bytes", "rule": f"≤ {RSS_FACTOR} × streamed ÷ N + non-block bytes"},
        {"target": "AllGather step (slowest rank)", "measured": allgather_step,
         "limit": STEP_FACTOR * max(resident_step or 0.0, floor), "unit": "s",
         "rule": f"≤ {STEP_FACTOR} × max(resident {_fmt(resident_step)} s, streamed ÷ (N × H2D) + all-gathers "
                 f"{floor:.3f} s)" + ("" if resident_step else "; resident skipped")},
        {"target": f"data-parallel speed-up, N={world} vs 1 GPU layerwise", "measured": speedup,
         "limit": DP_FACTOR * world, "unit": "x", "rule": f"≥ {DP_FACTOR} × N", "at_least": True},
    ]
    for t in targets:
        t["meets"] = t["measured"] >= t["limit"] if t.pop("at_least", False) else t["measured"] <= t["limit"]
    return {
        "model": name, "world_size": world, "param_bytes": param_bytes, "streamed_bytes": streamed,
        "nonblock_bytes": nonblock, "h2d_bytes_per_s_min": h2d, "gather_bytes_per_s_min": gather_bw,
        "gather_per_step_s": gather_step, "stream_floor_s": floor, "blocks": blocks,
        "steps": {"allgather": allgather_step, "no_allgather": max(r["no_allgather"]["step_s"] for r in ranks),
                  "layerwise_1gpu": layerwise_step, "resident_1gpu": resident_step},
        "throughput": {"requests_per_s_n": world / allgather_step, "requests_per_s_1": 1 / layerwise_step,
                       "speedup": speedup},
        "single_gpu": single, "ranks": ranks, "targets": targets,
    }


def _bytes(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else format_bytes(nbytes)


def _value(value: float, unit: str) -> str:
    return {"bytes": _bytes, "s": lambda v: f"{v:.3f} s", "x": lambda v: f"{v:.2f}×"}[unit](value)


def markdown(report: dict) -> str:
    env, world = report["environment"], report["world_size"]
    lines = [
        "# Distributed layerwise offload, multi-GPU",
        "",
        f"{world} × {env['device_name']} ({report['backend']}), torch {env['torch']}, diffusers {env['diffusers']}. "
        f"Random-weight bf16 transformers saved once and mmap-loaded on every rank. A step is one transformer "
        f"forward under inference_mode (median of {report['args']['repeats']} after {report['args']['warmup']} "
        "warm-up); in AllGather mode every rank runs its own request (latents seeded by rank) in lockstep. "
        "Single-GPU rows ran on rank 0 while the other ranks waited.",
        "",
        "| Rank | H2D, all ranks at once | H2D, rank 0 alone |",
        "|---|---|---|",
    ]
    for b in report["bandwidth"]:
        alone = b.get("h2d_alone_bytes_per_s")
        lines.append(f"| {b['rank']} | {b['h2d_bytes_per_s'] / 1e9:.1f} GB/s | "
                     f"{'' if alone is None else f'{alone / 1e9:.1f} GB/s'} |")
    if report.get("smoke"):
        lines += ["", "**Smoke run** (tiny models on CPU with gloo): checks the script, not the targets."]
    for m in report["models"]:
        s = m["steps"]
        lines += [
            "",
            f"## {m['model']}: {_bytes(m['param_bytes'])} bf16, {_bytes(m['streamed_bytes'])} streamed per step, "
            f"N = {m['world_size']}",
            "",
            "| Mode | Step (s) | Requests/s |",
            "|---|---|---|",
            f"| AllGather, N ranks (slowest rank) | {s['allgather']:.3f} | {m['throughput']['requests_per_s_n']:.2f} |",
            f"| no-AllGather, N ranks (slowest rank) | {s['no_allgather']:.3f} | {world / s['no_allgather']:.2f} |",
            f"| layerwise, 1 GPU | {s['layerwise_1gpu']:.3f} | {m['throughput']['requests_per_s_1']:.2f} |",
            f"| resident, 1 GPU | {_fmt(s['resident_1gpu'])} | "
            f"{_fmt(None if s['resident_1gpu'] is None else 1 / s['resident_1gpu'], '.2f')} |",
        ]
        if "skipped" in m["single_gpu"]["resident"]:
            lines += ["", f"Resident step skipped: {m['single_gpu']['resident']['skipped']}."]
        lines += [
            "",
            "Per rank: host RSS (anonymous / file-backed) before loading → after mmap load → after enabling "
            "AllGather; device peak during steps.",
            "",
            "| Rank | Anon | File | Anon growth | Pinned shards | Peak AllGather | Peak no-AllGather | "
            "AllGather step | no-AllGather step |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in m["ranks"]:
            a, rss = r["allgather"], r["allgather"]["rss"]
            stages = ("before_load", "after_load", "after_enable")
            lines.append(
                f"| {r['rank']} | {' → '.join(_bytes(rss[k]['anon']) for k in stages)} | "
                f"{' → '.join(_bytes(rss[k]['file']) for k in stages)} | {_bytes(a['anon_growth'])} | "
                f"{_bytes(a['host_bytes'])} | {_bytes(a['peak_device_bytes'])} | "
                f"{_bytes(r['no_allgather']['peak_device_bytes'])} | {a['step_s']:.3f} | "
                f"{r['no_allgather']['step_s']:.3f} |")
        gbw = m["gather_bytes_per_s_min"]
        lines += [
            "",
            f"All-gather per block (slowest rank) against bytes ÷ {gbw / 1e9:.3g} GB/s (all-gather of the largest "
            f"block); {_fmt(m['gather_per_step_s'])} s of all-gathers per step, H2D floor + all-gathers "
            f"{m['stream_floor_s']:.3f} s:",
            "",
            "| Block | Blocks per step | Measured | Bytes ÷ bandwidth |",
            "|---|---|---|---|",
        ]
        lines += [f"| {_bytes(b['block_bytes'])} | {b['count']} | {b['gather_s'] * 1e3:.2f} ms | "
                  f"{b['predicted_s'] * 1e3:.2f} ms |" for b in m["blocks"]]
        lines += ["", "| Target | Measured | Limit | Rule | Meets |", "|---|---|---|---|---|"]
        lines += [f"| {t['target']} | {_value(t['measured'], t['unit'])} | {_value(t['limit'], t['unit'])} | "
                  f"{t['rule']} | {_fmt(t['meets'])} |" for t in m["targets"]]
    return "\n".join(lines) + "\n"


def chart(report: dict, path: Path) -> str | None:
    """Step time per mode and model, with the AllGather target; returns a note when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return "matplotlib not installed; no chart"
    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        labels = [f"AllGather\nN={m['world_size']}", f"no-AllGather\nN={m['world_size']}", "layerwise\n1 GPU",
                  "resident\n1 GPU"]
        steps = [m["steps"][k] or 0.0 for k in ("allgather", "no_allgather", "layerwise_1gpu", "resident_1gpu")]
        ax.bar(range(4), steps, color=["tab:green", "tab:olive", "tab:blue", "tab:gray"])
        ax.hlines(m["targets"][1]["limit"], -0.4, 0.4, colors="tab:red", linestyles="--", label="AllGather target")
        for i, step in enumerate(steps):
            ax.text(i, step, f"{step:.3f}s", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(4), labels, fontsize=8)
        ax.set_ylabel("seconds per transformer forward")
        ax.set_title(f"{m['model']}: {m['throughput']['speedup']:.2f}× data-parallel speed-up at N={m['world_size']}")
        ax.legend(fontsize=8)
    save_figure(plt, fig, path)
    return None


# Main ------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="flux,wan", help="comma-separated: flux, wan")
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU with gloo (checks the script)")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json, .md, .png (the runner, python -m benchmarks run, chooses it)")
    parser.add_argument("--ckpt-dir", default=str(Path(tempfile.gettempdir()) / "omni_distributed_offload_ckpt"),
                        help="where rank 0 saves the random-weight checkpoints (reused when complete)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bandwidth-bytes", type=int, default=4 * GiB, help="pinned buffer per rank for H2D")
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout, seconds")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - {"flux", "wan"})
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown or 'none given'}; allowed: flux, wan")
    if args.smoke:
        args.warmup, args.repeats = 1, 2
        args.bandwidth_bytes = min(args.bandwidth_bytes, 16 * 2**20)
        args.timeout = min(args.timeout, 120.0)
    return args


def run(args: argparse.Namespace, ctx: Ctx) -> None:
    out = Path(args.out)
    import accelerate  # noqa: F401 - load_transformer_mmap imports it; keep first imports out of RSS deltas

    for name in args.models:
        model_class(name)
    ctx.log(f"device {ctx.device}, backend {ctx.backend}; H2D bandwidth with every rank copying "
            f"({_gib(args.bandwidth_bytes)} each)")
    bandwidth = {"rank": ctx.rank, "h2d_bytes_per_s": concurrent_h2d_bandwidth(ctx, args.bandwidth_bytes)}
    if ctx.rank == 0:
        bandwidth["h2d_alone_bytes_per_s"] = measure_bandwidth(ctx.device, args.bandwidth_bytes)
    ctx.barrier()
    ctx.log(f"H2D {bandwidth['h2d_bytes_per_s'] / 1e9:.1f} GB/s")
    bandwidths = [None] * ctx.world if ctx.rank == 0 else None
    dist.gather_object(bandwidth, bandwidths, dst=0)
    env = environment(ctx.device)
    if ctx.backend == "nccl":
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    report = {"environment": env, "world_size": ctx.world, "backend": ctx.backend,
              "smoke": args.smoke, "args": vars(args), "bandwidth": bandwidths, "models": []}
    for name in args.models:
        record = benchmark_model(ctx, name, args)
        ranks = [None] * ctx.world if ctx.rank == 0 else None
        dist.gather_object(record, ranks, dst=0)
        if ctx.rank == 0:
            report["models"].append(summarize(name, ranks, bandwidths))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    if ctx.rank == 0:
        text = markdown(report)
        note = chart(report, out.with_suffix(".png"))
        if note:
            text += f"\n{note}.\n"
        out.with_suffix(".md").write_text(text)
        print(text, flush=True)
        ctx.log(f"wrote {out.with_suffix('.json')}, .md{'' if note else ', .png'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        ctx = Ctx(args.smoke, args.timeout)
        run(args, ctx)
        ctx.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException as error:  # noqa: BLE001 - any failure ends this rank now; torchrun stops the others
        if isinstance(error, SystemExit) and error.code in (0, None):
            raise
        rank = os.environ.get("RANK", "0")
        traceback.print_exc()
        print(f"[rank {rank}] FAILED: {type(error).__name__}: {error}; exiting so the other ranks stop too",
              file=sys.stderr, flush=True)
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
