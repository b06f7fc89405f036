#!/usr/bin/env python
"""Where an offloaded quantized step loses time against the resident one: a GPU timeline and the host hooks.

For each format (FLUX.1-dev size at 1024², built and quantized on the device as ``quant_offload_bench`` does), one
process measures:

* **copy contention**: the resident step alone, then the same step while a side stream copies pinned host memory
  to the device without pause (how much slower compute gets while the copy engine runs, and the bandwidth the
  copies get meanwhile);
* **timelines** (``torch.profiler``, CUDA activity) of one resident and one omni layerwise step: busy time and idle
  gaps of the compute stream (and how many gaps end when a host→device copy finishes: waits for a load), the
  kernels' summed time (the same kernels run in both: a difference is compute slowed by the copies), and the
  copies' effective bandwidth and overlap with kernels;
* **host hooks**: where the layerwise hooks' host time goes (per call of the streamer's load/bind/park and the
  CUDA calls they make), from ``perf_counter`` around each.

Usage::

    python -m benchmarks run offload-timeline [-- --formats torchao-int8,bnb-nf4,gguf-q4_k]
"""

from __future__ import annotations

import argparse
import bisect
import functools
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.offload_bench import environment, free_memory, make_inputs
from benchmarks.quant_offload_bench import FORMATS, build_model, quantize, versions

GiB = 2**30


def cuda_step(model, inputs, device, wait_first: bool = True) -> float:
    """One forward timed with CUDA events on the compute stream (seconds); ``wait_first=False`` does not wait for
    work already queued (copies running on a side stream) before it starts."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if wait_first:
        torch.cuda.synchronize(device)
    start.record()
    model(**inputs)
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3


def copy_contention(model, inputs, device, repeats: int = 3) -> dict[str, Any]:
    """The resident step alone and while a side stream copies pinned memory to the device nonstop."""
    alone = sorted(cuda_step(model, inputs, device) for _ in range(repeats))[repeats // 2]
    chunk = 256 * 2**20
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(chunk, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    copies = int(alone * 60e9 / chunk * 1.5) + 4  # more than the step lasts, at up to 60 GB/s
    results = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        c_start, c_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            c_start.record(stream)
            for _ in range(copies):
                dst.copy_(host, non_blocking=True)
            c_end.record(stream)
        step = cuda_step(model, inputs, device, wait_first=False)
        torch.cuda.synchronize(device)
        copy_s = c_start.elapsed_time(c_end) / 1e3
        results.append((step, copies * chunk / copy_s))
    results.sort()
    step, bandwidth = results[repeats // 2]
    # The copies alone (same chunk, same stream), for the bandwidth they get without compute.
    torch.cuda.synchronize(device)
    c_start, c_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        c_start.record(stream)
        for _ in range(16):
            dst.copy_(host, non_blocking=True)
        c_end.record(stream)
    torch.cuda.synchronize(device)
    alone_bw = 16 * chunk / (c_start.elapsed_time(c_end) / 1e3)
    del host, dst
    return {"step_alone_s": alone, "step_with_copies_s": step, "compute_slowdown": step / alone,
            "copy_bw_alone_gbs": alone_bw / 1e9, "copy_bw_during_compute_gbs": bandwidth / 1e9}


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def timeline(model, inputs, device) -> dict[str, Any]:
    """One profiled forward: the compute stream's busy time and gaps, the copies' bandwidth and overlap."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(**inputs)
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    by_stream: dict[Any, list[dict]] = {}
    for e in kernels:
        by_stream.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append(e)
    compute_stream = max(by_stream, key=lambda s: len(by_stream[s])) if by_stream else None
    main = sorted(by_stream.get(compute_stream, []), key=lambda e: e["ts"])
    busy = _merge([(e["ts"], e["ts"] + e["dur"]) for e in main])
    h2d = [e for e in copies if "HtoD" in e.get("name", "")]
    h2d_iv = _merge([(e["ts"], e["ts"] + e["dur"]) for e in h2d])
    copy_ends = sorted(e["ts"] + e["dur"] for e in h2d)
    gaps = []
    for (a0, a1), (b0, _) in zip(busy, busy[1:]):
        gap = b0 - a1
        if gap > 0:
            i = bisect.bisect_left(copy_ends, b0 - 8.0)
            waited = i < len(copy_ends) and copy_ends[i] <= b0 + 1.0
            gaps.append((gap, waited, a1))
    gaps.sort(reverse=True)
    span = (busy[-1][1] - busy[0][0]) if busy else 0.0
    busy_us = sum(b - a for a, b in busy)
    kernel_sum_us = sum(e["dur"] for e in main)
    copy_bytes = sum(e.get("args", {}).get("bytes", 0) for e in h2d)
    copy_us = sum(e["dur"] for e in h2d)
    top_kernels: dict[str, float] = {}
    for e in main:
        top_kernels[e["name"][:90]] = top_kernels.get(e["name"][:90], 0.0) + e["dur"]
    return {
        "span_ms": span / 1e3, "busy_ms": busy_us / 1e3, "idle_ms": (span - busy_us) / 1e3,
        "kernel_sum_ms": kernel_sum_us / 1e3, "kernels": len(main),
        "gaps_over_20us": sum(1 for g in gaps if g[0] > 20), "gap_ms_over_20us": sum(g[0] for g in gaps if g[0] > 20) / 1e3,
        "gaps_ending_at_a_copy": sum(1 for g in gaps if g[1] and g[0] > 20),
        "gap_ms_ending_at_a_copy": sum(g[0] for g in gaps if g[1] and g[0] > 20) / 1e3,
        "largest_gaps_us": [round(g[0], 1) for g in gaps[:12]],
        "h2d_copies": len(h2d), "h2d_gb": copy_bytes / 1e9, "h2d_ms": copy_us / 1e3,
        "h2d_bw_gbs": copy_bytes / (copy_us * 1e-6) / 1e9 if copy_us else None,
        "h2d_overlapping_kernels_ms": _overlap(h2d_iv, busy) / 1e3,
        "top_kernels_ms": {k: round(v / 1e3, 3) for k, v in sorted(top_kernels.items(), key=lambda kv: -kv[1])[:12]},
    }


class HostTimers:
    """``perf_counter`` totals around the streamer's hot-path methods (patched on their classes)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()

    def undo(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def report(self, steps: int) -> dict[str, dict[str, float]]:
        return {label: {"us_per_call": self.totals[label] / self.calls[label] * 1e6,
                        "ms_per_step": self.totals[label] / steps * 1e3, "calls_per_step": self.calls[label] / steps}
                for label in sorted(self.totals, key=lambda k: -self.totals[k])}


def host_timers() -> HostTimers:
    from diffusers_omni.offload import memory, streamer

    timers = HostTimers()
    timers.wrap(streamer.Streamer, "_begin", "begin (total)")
    timers.wrap(streamer.Streamer, "end", "end (total)")
    timers.wrap(streamer.Streamer, "load", "load (total)")
    timers.wrap(streamer.StreamedBlock, "allocate", "load: allocate device buffers")
    timers.wrap(memory.Transfers, "copy", "load: copy (stream switch, wait, copies, record)")
    timers.wrap(memory.Transfers, "record_on_compute", "load: event record on compute")
    timers.wrap(memory.Transfers, "compute_waits_for", "begin: compute waits for load")
    timers.wrap(memory.PackedWeights, "views_into", "begin: views_into")
    timers.wrap(memory.PackedWeights, "bind", "begin: bind")
    timers.wrap(memory.PackedWeights, "park", "end: park")
    return timers


def run_format(fmt: str, args, device) -> dict[str, Any]:
    from diffusers_omni import OffloadConfig, apply_offload

    print(f"== {fmt}", flush=True)
    free_memory(device)
    model = build_model("flux", device, False, layers=args.layers)
    detail = quantize(model, fmt, device)
    inputs = make_inputs("flux", model, device, False)
    entry: dict[str, Any] = {"format": fmt, **detail}
    with torch.inference_mode():
        model(**inputs)
        entry["contention"] = copy_contention(model, inputs, device)
        print(f"  contention {entry['contention']}", flush=True)
        entry["resident_timeline"] = timeline(model, inputs, device)
    torch.cuda.empty_cache()
    timers = host_timers()  # before enabling: the hooks bind the streamer's methods when installed
    handle = apply_offload(model, OffloadConfig("layerwise", device=device, max_device_memory="none"))
    try:
        with torch.inference_mode():
            model(**inputs)
            entry["omni_step_s"] = sorted(cuda_step(model, inputs, device) for _ in range(3))[1]
            timers.reset()
            steps = 3
            for _ in range(steps):
                model(**inputs)
            torch.cuda.synchronize(device)
            entry["omni_host_hooks"] = timers.report(steps)
            entry["omni_timeline"] = timeline(model, inputs, device)
    finally:
        timers.undo()
        handle.disable()
    print(f"  omni step {entry['omni_step_s']:.4f} s", flush=True)
    for key in ("resident_timeline", "omni_timeline"):
        t = entry[key]
        print(f"  {key}: span {t['span_ms']:.1f} busy {t['busy_ms']:.1f} kernels {t['kernel_sum_ms']:.1f} idle "
              f"{t['idle_ms']:.1f} ms; gaps>20us {t['gaps_over_20us']} ({t['gap_ms_over_20us']:.1f} ms, "
              f"{t['gaps_ending_at_a_copy']} / {t['gap_ms_ending_at_a_copy']:.1f} ms at a copy end); h2d "
              f"{t['h2d_gb']:.2f} GB at {t['h2d_bw_gbs'] or 0:.1f} GB/s, overlapping kernels "
              f"{t['h2d_overlapping_kernels_ms']:.1f} of {t['h2d_ms']:.1f} ms", flush=True)
    for label, row in entry["omni_host_hooks"].items():
        print(f"    {label}: {row['us_per_call']:.1f} us/call, {row['ms_per_step']:.2f} ms/step", flush=True)
    del model, handle
    gc.collect()
    free_memory(device)
    return entry


def api_costs(device, repeats: int = 2000) -> dict[str, float]:
    """Host microseconds per call of the CUDA operations a streamed block's hooks make."""
    stream = torch.cuda.Stream(device)
    event = torch.cuda.Event()
    host = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
    keep = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    del keep  # cached: the allocations below take it from the cache
    base = torch.empty(4096, dtype=torch.bfloat16, device=device)
    costs: dict[str, float] = {}

    def timed(label, fn, n=repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(n):
            fn()
        costs[label] = (time.perf_counter() - start) / n * 1e6
        torch.cuda.synchronize(device)

    timed("torch.empty 64 MiB (cached)", lambda: torch.empty(64 * 2**20, dtype=torch.uint8, device=device))
    timed("event.record", lambda: event.record())
    timed("stream.wait_event", lambda: torch.cuda.current_stream(device).wait_event(event))

    def switch():
        with torch.cuda.stream(stream):
            pass

    timed("with torch.cuda.stream(s)", switch)
    dst = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    timed("copy_ 64 MiB non_blocking (host time)", lambda: dst.copy_(host, non_blocking=True), n=50)
    timed("record_stream", lambda: dst.record_stream(stream))
    timed("as_strided", lambda: base.as_strided((64, 64), (64, 1), 0))

    def rebind():
        base.data = base.data

    timed("tensor.data = view", rebind)
    with torch.inference_mode():
        def flip():
            with torch.inference_mode(False):
                pass

        timed("inference_mode(False) enter/exit", flip)
    return {k: round(v, 2) for k, v in costs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="torchao-int8,bnb-nf4,gguf-q4_k")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json (the runner, python -m benchmarks run, chooses it)")
    parser.add_argument("--time-budget", type=float, default=None, help="start no format after this many seconds")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    report: dict[str, Any] = {"environment": environment(device), "versions": versions(), "entries": []}
    report["api_costs_us"] = api_costs(device)
    print(f"api costs (host us per call): {report['api_costs_us']}", flush=True)
    began = time.perf_counter()
    for fmt in args.formats.split(","):
        if fmt not in FORMATS:
            raise SystemExit(f"--formats: {fmt!r} is not one of {', '.join(FORMATS)}")
        if args.time_budget is not None and time.perf_counter() - began > args.time_budget:
            report.setdefault("skipped", []).append(fmt)
            continue
        report["entries"].append(run_format(fmt, args, device))
        Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
