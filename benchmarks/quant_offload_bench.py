#!/usr/bin/env python
"""Quantized offload benchmark: resident quantized step, Diffusers' group offload and omni layerwise offload.

For each model (FLUX.1-dev size at 1024², Wan-14B size at 480p/33 frames) and each weight format, one process
builds the full-size transformer with random bf16 weights directly on the device, quantizes it there, and
measures side by side:

* resident quantized step (the whole quantized model on the device);
* omni layerwise offload (packed bytes streamed from pinned host memory), enabled from the device-resident model;
* Diffusers ``enable_group_offload(block_level, num_blocks_per_group=1, use_stream=True, record_stream=True)``
  where it runs (the error is recorded where it does not);
* pinned host→device bandwidth (4 GiB copy, same process), so streamed bytes ÷ bandwidth is the copy floor.

Formats: torchao ``Float8WeightOnlyConfig`` and ``Int8WeightOnlyConfig`` (``quantize_``), GGUF ``Q8_0`` (quantized
exactly as gguf-py does, in torch on the GPU) and ``Q4_K`` (random *valid* blocks: gguf-py has no Q4_K quantizer) as
Diffusers ``GGUFLinear``/``GGUFParameter`` layers, and bitsandbytes NF4 with double quantization (``Linear4bit``).
Linear layers of Diffusers' ``_keep_in_fp32_modules`` stay unquantized, as Diffusers' quantizers leave them.

Every offloaded output is compared bit for bit with the resident quantized output of the same inputs.
Targets (issue 14): step ≤ 1.05 × max(resident quantized step, streamed bytes ÷ bandwidth); peak device memory ≤
Diffusers' for the same format; setup ≤ 10 s for the FLUX size.

Usage (results go to ``<out>.json``, ``<out>.md`` and ``<out>.png``)::

    python -m benchmarks run quant-offload-flux           # (and the other quant-offload-*: python -m benchmarks --list)
    python -m benchmarks run quant-offload-flux --smoke   # --smoke --device cpu: tiny models, checks the script's logic
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from benchmarks.common import pyplot, save_figure
from benchmarks.offload_bench import (
    _fmt,
    _gib,
    environment,
    free_memory,
    make_inputs,
    measure_bandwidth,
    parameters_on_meta,
    peak_bytes,
    remove_group_offload,
    reset_peak,
    synchronize,
)

GiB = 2**30
TARGET_FACTOR = 1.05
SETUP_TARGET_S = 10.0
FORMATS = ("torchao-float8", "torchao-int8", "gguf-q8_0", "gguf-q4_k", "bnb-nf4")


# Models -----------------------------------------------------------------------------------------------------------


def build_model(name: str, device: torch.device, smoke: bool, seed: int = 0, layers: int | None = None) -> nn.Module:
    """The transformer with random bf16 weights (std 0.02) allocated directly on ``device`` (``layers``: fewer
    blocks at full width, for quick checks)."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    if name == "flux":
        cls, kwargs = FluxTransformer2DModel, {"guidance_embeds": True}
        if smoke:  # widths that every format accepts (GGUF Q4_K needs 256 columns, bnb on CPU multiples of 64)
            kwargs.update(num_layers=2, num_single_layers=3, attention_head_dim=64, num_attention_heads=2,
                          joint_attention_dim=64, pooled_projection_dim=64, axes_dims_rope=(16, 24, 24))
    else:
        cls, kwargs = WanTransformer3DModel, {}
        if smoke:
            kwargs.update(num_layers=3, num_attention_heads=2, attention_head_dim=64, ffn_dim=256, text_dim=64,
                          freq_dim=64)
    if layers is not None:
        kwargs.update(num_layers=layers, **({"num_single_layers": 2 * layers} if name == "flux" else {}))
    with parameters_on_meta():
        model = cls(**kwargs)
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                data = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
                data.normal_(0, 0.02, generator=generator)
                module._parameters[key] = nn.Parameter(data, requires_grad=False)
    return model.to(device).eval()  # buffers (rotary tables) were built on the host


def quantize(model: nn.Module, fmt: str, device: torch.device) -> dict[str, Any]:
    """Quantize ``model`` in place on its device; returns what was done."""
    from diffusers_omni.testing.quantized import bnb_quantize_, gguf_quantize_

    if fmt.startswith("torchao"):
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        config = Float8WeightOnlyConfig() if fmt == "torchao-float8" else Int8WeightOnlyConfig()
        keep = getattr(model, "_keep_in_fp32_modules", None) or []

        def wanted(module: nn.Module, name: str) -> bool:
            return isinstance(module, nn.Linear) and not any(part in keep for part in name.split("."))

        quantize_(model, config, filter_fn=wanted)
        detail = type(config).__name__
    elif fmt.startswith("gguf"):
        chosen = gguf_quantize_(model, prefer="Q8_0" if fmt == "gguf-q8_0" else "Q4_K", compute_dtype=torch.bfloat16)
        counts: dict[str, int] = {}
        for quant in chosen.values():
            counts[quant] = counts.get(quant, 0) + 1
        detail = ", ".join(f"{n} × {q}" for q, n in sorted(counts.items()))
    elif fmt == "bnb-nf4":
        skip = (lambda name, layer: bool(layer.in_features % 64 or layer.out_features % 64)) \
            if device.type == "cpu" else (lambda name, layer: False)
        count = bnb_quantize_(model, bits=4, quant_type="nf4", double_quant=True, compute_dtype=torch.bfloat16,
                              skip=skip)
        detail = f"{count} × Linear4bit nf4, double quant"
    else:
        raise ValueError(f"format {fmt!r}; allowed: {', '.join(FORMATS)}")
    kinds: dict[str, int] = {}
    for param in model.parameters():
        kinds[type(param).__name__] = kinds.get(type(param).__name__, 0) + 1
    return {"detail": detail, "parameter_types": kinds}


# Measurements -----------------------------------------------------------------------------------------------------


ALLOC_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def allocator_counters(device: torch.device) -> dict[str, int] | None:
    """The caching allocator's counters that say whether a step went to cudaMalloc/cudaFree (None on the CPU)."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {key: int(stats.get(key, 0)) for key in ALLOC_KEYS}


def copy_traffic(nbytes: int, device: torch.device, chunk: int = 256 * 2**20) -> Callable[[], None]:
    """A function that copies ``nbytes`` host→device (pinned, in ``chunk``-byte pieces into one scratch buffer) on
    a side stream, queued after the work already on the current stream and waited for by nothing: a step's
    streamed bytes with no dependency on its compute. On the CPU the copies run before the step (logic only)."""
    chunk = max(1, min(chunk, nbytes))
    cuda = device.type == "cuda"
    src = torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(chunk, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device) if cuda else None

    def enqueue() -> None:
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            left = nbytes
            while left > 0:
                n = min(chunk, left)
                dst[:n].copy_(src[:n], non_blocking=cuda)
                left -= n

    return enqueue


def time_steps(model: nn.Module, inputs: dict, device: torch.device, warmup: int, repeats: int,
               alloc_stats: bool = False, before_step: Callable[[], None] | None = None) -> tuple[dict, Any]:
    """Median step time; ``host_s`` is how long the forward took to return on the host (kernels launched, before
    the wait): when it is close to ``step_s`` the step is bound by the host, not the GPU. ``alloc_stats``: also
    the allocator counters' deltas over the timed steps (``alloc_deltas``) and the reserved bytes before them.
    ``before_step`` runs right before each forward, inside the timed interval (``copy_traffic``)."""
    times, hosts, first = [], [], None
    counters = extra = None
    with torch.inference_mode():
        for index in range(warmup + repeats):
            synchronize(device)
            if alloc_stats and index == warmup:
                counters = allocator_counters(device)
                extra = {"reserved_before_timed_steps": torch.cuda.memory_reserved(device)
                         if device.type == "cuda" else None}
            start = time.perf_counter()
            if before_step is not None:
                before_step()
            out = model(**inputs)[0]
            launched = time.perf_counter()
            synchronize(device)
            if index >= warmup:
                times.append(time.perf_counter() - start)
                hosts.append(launched - start)
            if first is None:
                first = out.clone()
            del out
    result = {"step_s": statistics.median(times), "step_all_s": times, "host_s": statistics.median(hosts)}
    if alloc_stats:
        synchronize(device)
        after = allocator_counters(device)
        result.update(extra or {})
        if counters is None or after is None:
            result["alloc_deltas"] = None
            result["alloc_note"] = "torch.cuda.memory_stats skipped: not a CUDA device"
        else:
            result["alloc_deltas"] = {key: after[key] - counters[key] for key in ALLOC_KEYS}
    return result, first


def block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks in execution order (FLUX: double then single; Wan: blocks)."""
    names = ("transformer_blocks", "single_transformer_blocks") if hasattr(model, "single_transformer_blocks") \
        else ("blocks",)
    return [(f"{name}.{i}", block) for name in names for i, block in enumerate(getattr(model, name))]


def peak_trace(model: nn.Module, inputs: dict, device: torch.device) -> dict[str, Any] | None:
    """One more forward with the device memory allocated while each block runs (the caching allocator counts in
    host order, so no wait is needed): where a variant's peak is, and how far above the allocation before the
    first block (weights that stay resident, inputs) each block goes."""
    if device.type != "cuda":
        return None
    rows: list[list] = []
    handles = []
    for label, block in block_modules(model):
        def before(module, args, kwargs, label=label):
            torch.cuda.reset_peak_memory_stats(device)
            rows.append([label, torch.cuda.memory_allocated(device)])

        def after(module, args, kwargs, output):
            rows[-1].append(torch.cuda.max_memory_allocated(device))

        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(block.register_forward_hook(after, with_kwargs=True))
    try:
        synchronize(device)
        start = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            model(**inputs)
        synchronize(device)
    finally:
        for handle in handles:
            handle.remove()
    top = max(rows, key=lambda row: row[-1])
    return {"allocated_before_forward": start, "peak_bytes": top[-1], "peak_block": top[0],
            "blocks": [{"block": r[0], "allocated_at_start": r[1], "peak": r[2]} for r in rows if len(r) == 3]}


def block_compute_times(model: nn.Module, inputs: dict, device: torch.device, repeats: int) -> list[float]:
    """Each block's forward time (median over ``repeats`` forwards of the resident model): CUDA events recorded on
    the current stream by forward pre/post hooks (so a block's time includes any gap while the host is still
    launching its kernels), ``perf_counter`` on the CPU."""
    blocks = block_modules(model)
    marks: list[list] = [[] for _ in blocks]
    handles = []
    cuda = device.type == "cuda"

    def stamp():
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    for index, (_, block) in enumerate(blocks):
        def before(module, args, kwargs, index=index):
            marks[index].append([stamp()])

        def after(module, args, kwargs, output, index=index):
            marks[index][-1].append(stamp())

        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(block.register_forward_hook(after, with_kwargs=True))
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                model(**inputs)
        synchronize(device)
    finally:
        for handle in handles:
            handle.remove()

    def elapsed(pair) -> float:
        return pair[0].elapsed_time(pair[1]) / 1e3 if cuda else pair[1] - pair[0]

    return [statistics.median(elapsed(pair) for pair in rows) for rows in marks]


def block_copy_times(sizes: list[int], device: torch.device, repeats: int = 3) -> list[float]:
    """Each block's packed bytes copied host→device in one piece (pinned host tensor → device tensor, CUDA events;
    median of ``repeats`` after one warm-up copy); ``perf_counter`` around a host copy on the CPU."""
    biggest = max(sizes)
    cuda = device.type == "cuda"
    src = torch.empty(biggest, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(biggest, dtype=torch.uint8, device=device)
    times = []
    for size in sizes:
        runs = []
        for attempt in range(repeats + 1):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst[:size].copy_(src[:size], non_blocking=True)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                start = time.perf_counter()
                dst[:size].copy_(src[:size])
                seconds = time.perf_counter() - start
            if attempt:
                runs.append(seconds)
        times.append(statistics.median(runs))
    del src, dst
    return times


def cyclic_window_bound(compute: list[float], copy: list[float]) -> float:
    """Σ_i max(compute_i, copy_{i+1}) with block n+1 = block 0 (the next step's first block): with a window of two
    blocks (the one running and the one loading), block i+1 can only load while block i runs."""
    n = len(compute)
    return sum(max(compute[i], copy[(i + 1) % n]) for i in range(n))


def pass_window_bound(compute: list[float], copy: list[float], between: float) -> float:
    """The 2-block bound when the next step's first block loads only after the last block ends (layerwise without a
    budget): Σ_{i<n-1} max(compute_i, copy_{i+1}) + compute_{n-1} + max(between, copy_0), where ``between`` is the
    step's time outside the blocks (embeddings, final norm) that the wrap-around copy can overlap."""
    n = len(compute)
    return sum(max(compute[i], copy[i + 1]) for i in range(n - 1)) + compute[-1] + max(between, copy[0])


def per_block_bound(model: nn.Module, inputs: dict, device: torch.device, bandwidth: float,
                    repeats: int, resident_step: float | None = None) -> dict[str, Any]:
    """compute_i (resident quantized model), copy_i (block i's packed bytes from pinned memory) and the 2-block
    bounds on a streamed step (cyclic, and with the wrap-around load after the last block)."""
    from diffusers_omni.offload.tensors import storage_nbytes

    start = time.perf_counter()
    blocks = block_modules(model)
    sizes = [storage_nbytes(block) for _, block in blocks]
    compute = block_compute_times(model, inputs, device, repeats)
    copy = block_copy_times(sizes, device)
    n = len(blocks)
    deficits = sorted(((copy[(i + 1) % n] - compute[i], i) for i in range(n)), reverse=True)[:3]
    return {
        "blocks": [{"block": label, "packed_bytes": size, "compute_s": c, "copy_s": k}
                   for (label, _), size, c, k in zip(blocks, sizes, compute, copy)],
        "sum_compute_s": sum(compute),
        "sum_copy_s": sum(copy),
        "sum_bytes_over_bandwidth_s": sum(sizes) / bandwidth,
        "block_bytes": sum(sizes),
        "bound_s": cyclic_window_bound(compute, copy),
        "bound_after_last_s": None if resident_step is None else
        pass_window_bound(compute, copy, max(resident_step - sum(compute), 0.0)),
        "largest_deficits": [{"running": blocks[i][0], "loading": blocks[(i + 1) % n][0],
                              "compute_s": compute[i], "copy_s": copy[(i + 1) % n], "deficit_s": d}
                             for d, i in deficits],
        "repeats": repeats,
        "timer": "cuda events" if device.type == "cuda" else "perf_counter (CPU: checks the logic, not a bound)",
        "seconds": time.perf_counter() - start,
    }



def profile_top(fn: Callable[[], Any], rows: int = 25) -> tuple[Any, dict]:
    """Run ``fn`` under cProfile: its result and the ``rows`` costliest functions by own time and by cumulative
    time (text, as pstats prints them) — where the host time of a setup or a step goes."""
    profiler = cProfile.Profile()
    result = profiler.runcall(fn)
    tables = {}
    for key in ("tottime", "cumulative"):
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats(key).print_stats(rows)
        tables[key] = stream.getvalue()[-12000:]
    return result, tables


def run_variant(label: str, setup: Callable[[], Any], teardown: Callable[[Any], None], model: nn.Module,
                inputs: dict, device: torch.device, args: argparse.Namespace,
                reference: torch.Tensor | None, alloc_stats: bool = False,
                trace: bool = True, before_step: Callable[[], None] | None = None) -> tuple[torch.Tensor | None, dict]:
    print(f"  [{label}] setting up", flush=True)
    gc.collect()
    reset_peak(device)
    result: dict[str, Any] = {"variant": label}
    start = time.perf_counter()
    try:
        handle = setup()
        synchronize(device)
    except Exception as error:  # noqa: BLE001 - recorded: the variant does not run for this format
        result["error"] = f"{type(error).__name__}: {error}"[:400]
        print(f"  [{label}] setup failed: {result['error']}", flush=True)
        return None, result
    result["setup_s"] = time.perf_counter() - start
    reset_peak(device)
    try:
        timing, first = time_steps(model, inputs, device, args.warmup, args.repeats, alloc_stats, before_step)
    except Exception as error:  # noqa: BLE001 - recorded
        result["error"] = f"{type(error).__name__}: {error}"[:400]
        print(f"  [{label}] step failed: {result['error']}", flush=True)
        first = None
    else:
        result.update(timing)
        result["peak_device_bytes"] = peak_bytes(device)
        result["bitwise_equal_to_resident"] = None if reference is None else bool(torch.equal(first, reference))
    stats = getattr(handle, "stats", None)
    if stats is not None and hasattr(stats, "streamed_bytes_per_pass"):
        result.update({"streamed_bytes": stats.streamed_bytes_per_pass, "streamed_blocks": stats.streamed_blocks,
                       "slot_bytes": stats.slot_bytes, "on_demand_loads": stats.on_demand_loads,
                       "resident_blocks": getattr(stats, "resident_blocks", None),
                       "host_memory_mode": stats.host_memory_mode,
                       "in_flight_blocks": getattr(stats, "in_flight_blocks", None),
                       "max_in_flight_bytes": getattr(stats, "max_in_flight_bytes", None),
                       "hook_s_per_step": getattr(stats, "hook_seconds", 0.0) / max(args.warmup + args.repeats, 1)})
    if "step_s" in result and args.peak_trace and trace:
        try:
            result["peak_trace"] = peak_trace(model, inputs, device)
        except Exception as error:  # noqa: BLE001 - a diagnostic; the measurement stands without it
            result["peak_trace_error"] = f"{type(error).__name__}: {error}"[:300]
    start = time.perf_counter()
    try:
        teardown(handle)
        synchronize(device)
        result["teardown_s"] = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 - recorded
        result["teardown_error"] = f"{type(error).__name__}: {error}"[:400]
    if "step_s" in result:
        print(f"  [{label}] step {result['step_s']:.4f} s, setup {result['setup_s']:.2f} s, peak "
              f"{_gib(result['peak_device_bytes'])}, bitwise {result['bitwise_equal_to_resident']}", flush=True)
    return first if label == "resident" else None, result


def _bnb_quant_state_on(model: nn.Module, device: torch.device) -> bool:
    states = [p.quant_state for p in model.parameters() if getattr(p, "quant_state", None) is not None]
    return all(s.absmax.device == device for s in states)


def benchmark_format(name: str, fmt: str, args: argparse.Namespace, device: torch.device, bandwidth: float) -> dict:
    from diffusers_omni import OffloadConfig, apply_offload
    from diffusers_omni.offload.tensors import storage_nbytes

    print(f"== {name} / {fmt}", flush=True)
    free_memory(device)
    start = time.perf_counter()
    model = build_model(name, device, args.smoke, layers=args.layers)
    bf16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    info = quantize(model, fmt, device)
    synchronize(device)
    build_s = time.perf_counter() - start
    free_memory(device)
    packed = storage_nbytes(model)
    inputs = make_inputs(name, model, device, args.smoke)
    print(f"  {_gib(bf16_bytes)} bf16 → {_gib(packed)} packed ({info['detail']}) in {build_s:.1f} s", flush=True)
    entry: dict[str, Any] = {"model": name, "format": fmt, "bf16_bytes": bf16_bytes, "packed_bytes": packed,
                             "build_s": build_s, **info, "variants": []}

    reference, resident = run_variant("resident", lambda: None, lambda _: None, model, inputs, device, args, None)
    entry["variants"].append(resident)
    if args.per_block and "step_s" in resident:
        try:
            entry["per_block"] = per_block_bound(model, inputs, device, bandwidth, max(args.repeats, 3),
                                                 resident["step_s"])
            pb = entry["per_block"]
            print(f"  [per block] Σ compute {pb['sum_compute_s']:.4f} s, Σ copy {pb['sum_copy_s']:.4f} s, 2-block "
                  f"bound {pb['bound_s']:.4f} s ({pb['seconds']:.1f} s)", flush=True)
        except Exception as error:  # noqa: BLE001 - a diagnostic; the measurement stands without it
            entry["per_block_error"] = f"{type(error).__name__}: {error}"[:300]
            print(f"  [per block] failed: {entry['per_block_error']}", flush=True)

    if args.copy_traffic and "step_s" in resident:
        # The resident model while the copy engine moves the model's packed bytes once per step, with no dependency
        # between the two: what any streaming schedule costs compute through the copies alone (memory traffic,
        # DMA), however well it is ordered and with no memory limit. Before the offload variants: they leave the
        # blocks on the host.
        _, traffic = run_variant("resident, copy traffic", lambda: None, lambda _: None, model, inputs, device,
                                 args, reference, trace=False, before_step=copy_traffic(packed, device))
        traffic.update({"traffic_bytes": packed, "traffic_floor_s": packed / bandwidth})
        if "step_s" in traffic:
            traffic["over_resident"] = traffic["step_s"] / resident["step_s"]
        entry["variants"].append(traffic)

    def omni_setup():
        return apply_offload(model, OffloadConfig("layerwise", device=device, max_device_memory="none"))

    _, omni = run_variant("omni layerwise", omni_setup, lambda backend: backend.disable(), model, inputs, device,
                          args, reference, alloc_stats=args.cache_probe)
    entry["variants"].append(omni)
    # disable() left the block weights on the host: enabling again packs from the host (a GGUF file read with
    # from_single_file, a torchao model quantized on the CPU), not from the device.
    _, from_host = run_variant("omni layerwise from host", omni_setup, lambda backend: backend.disable(), model,
                               inputs, device, args, reference, alloc_stats=args.cache_probe)
    entry["variants"].append(from_host)
    if args.deeper:
        # The step a deeper window buys, and the peak it costs (from the host copies, like the pass above).
        _, deeper = run_variant(f"omni layerwise prefetch_depth={args.deeper}",
                                lambda: apply_offload(model, OffloadConfig("layerwise", device=device,
                                                                           max_device_memory="none",
                                                                           prefetch_depth=args.deeper)),
                                lambda backend: backend.disable(), model, inputs, device, args, reference)
        entry["variants"].append(deeper)

    for budget in args.budget:
        # The trade a budget buys: blocks kept resident and more loads in flight for more device memory (the
        # step target with its own, fewer, streamed bytes).
        _, budgeted = run_variant(f"omni layerwise, max_device_memory={budget:g} GiB",
                                  lambda: apply_offload(model, OffloadConfig("layerwise", device=device,
                                                                             max_device_memory=int(budget * GiB))),
                                  lambda backend: backend.disable(), model, inputs, device, args, reference,
                                  trace=False)
        if "step_s" in budgeted and "step_s" in resident:
            target = TARGET_FACTOR * max(resident["step_s"], budgeted["streamed_bytes"] / bandwidth)
            budgeted.update({"target_step_s": target, "meets_step_target": budgeted["step_s"] <= target})
        entry["variants"].append(budgeted)

    use_stream = device.type == "cuda"

    def diffusers_setup():
        if fmt.startswith("bnb"):  # Diffusers moves .data to the host but not quant_state: start on the device
            model.to(device)
        model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=use_stream,
                                   record_stream=use_stream)
        if fmt.startswith("bnb") and not _bnb_quant_state_on(model, device):
            raise RuntimeError("group offload left the bitsandbytes quant_state off the onload device")
        return None

    _, diffusers = run_variant("diffusers group_offload", diffusers_setup, lambda _: remove_group_offload(model),
                               model, inputs, device, args, reference)
    entry["variants"].append(diffusers)

    if "step_s" in omni and "step_s" in resident:
        floor = omni["streamed_bytes"] / bandwidth
        target = TARGET_FACTOR * max(resident["step_s"], floor)
        omni.update({
            "stream_floor_s": floor,
            "target_step_s": target,
            "meets_step_target": omni["step_s"] <= target,
            "meets_peak_target": None if "peak_device_bytes" not in diffusers or omni["peak_device_bytes"] is None
            else omni["peak_device_bytes"] <= diffusers["peak_device_bytes"],
            "meets_setup_target": None if name != "flux" else omni["setup_s"] <= SETUP_TARGET_S,
        })
        if "setup_s" in from_host:
            from_host["meets_setup_target"] = None if name != "flux" else from_host["setup_s"] <= SETUP_TARGET_S
    pb = entry.get("per_block")
    if pb is not None:
        target = omni.get("target_step_s")
        pb["target_step_s"] = target
        bound = pb.get("bound_after_last_s") or pb["bound_s"]  # the rule layerwise without a budget follows
        pb["bound_over_target"] = None if not target else bound / target
        pb["omni_step_over_bound"] = None if "step_s" not in omni else omni["step_s"] / bound
        pb["omni_from_host_step_over_bound"] = None if "step_s" not in from_host else from_host["step_s"] / bound

    if args.cache_probe:
        # The first pass again on a fresh model (same seed: the same weights, so the same reference), with the
        # caching allocator emptied right before apply_offload and again right after it (packing frees the
        # device weights during apply_offload, so only the second empty_cache returns those to the driver).
        model = None  # the closures above share this name: rebinding (not del) frees the old model
        free_memory(device)
        model = build_model(name, device, args.smoke, layers=args.layers)
        quantize(model, fmt, device)
        synchronize(device)
        free_memory(device)
        reserved: dict[str, int | None] = {}
        profiles: dict[str, dict] = {}

        def probe_teardown(backend):
            # One more offloaded forward under cProfile (host side: hooks, torchao dispatch, allocator waits).
            def step():
                with torch.inference_mode():
                    model(**inputs)
                synchronize(device)
            profiles["step"] = profile_top(step)[1]
            backend.disable()

        def probe_setup():
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.empty_cache()
            reserved["before_apply_offload"] = torch.cuda.memory_reserved(device) if cuda else None
            backend, profiles["apply_offload"] = profile_top(
                lambda: apply_offload(model, OffloadConfig("layerwise", device=device, max_device_memory="none")))
            if cuda:
                torch.cuda.synchronize(device)
                reserved["after_apply_offload"] = torch.cuda.memory_reserved(device)
                torch.cuda.empty_cache()
            reserved["after_second_empty_cache"] = torch.cuda.memory_reserved(device) if cuda else None
            return backend

        _, probe = run_variant("omni layerwise, empty_cache", probe_setup, probe_teardown,
                               model, inputs, device, args, reference, alloc_stats=True, trace=False)
        probe["reserved_bytes"] = reserved
        probe["profiles"] = profiles
        entry["variants"].append(probe)
    del model, inputs, reference
    free_memory(device)
    return entry


# Reports ----------------------------------------------------------------------------------------------------------


def _variant(entry: dict, label: str) -> dict:
    return next(v for v in entry["variants"] if v["variant"] == label)


def _variant_table(report: dict, prefix: str, intro: str, columns: list[str],
                   cells: Callable[[dict, dict], list[str]]) -> list[str]:
    """Markdown lines of a table of the variants named ``prefix…`` (none when no entry has one), after ``intro``."""
    rows = [(entry, v) for entry in report["entries"] for v in entry["variants"] if v["variant"].startswith(prefix)]
    if not rows:
        return []
    header = ["Model", "Format", *columns]
    return ["", intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join([entry["model"], entry["format"], *cells(entry, v)]) + " |" for entry, v in rows]


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# Quantized offload benchmark",
        "",
        f"{env['device_name']}, torch {env['torch']}, diffusers {env['diffusers']}, torchao {report['versions']['torchao']}, "
        f"gguf {report['versions']['gguf']}, bitsandbytes {report['versions']['bitsandbytes']}; pinned host→device "
        f"{report['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (same process). Median of {report['args']['repeats']} "
        f"steps after {report['args']['warmup']} warm-up, one transformer forward under inference_mode. Random "
        "weights; GGUF Q4_K blocks are random valid blocks. Targets: step ≤ 1.05 × max(resident quantized step, "
        "streamed bytes ÷ bandwidth); peak ≤ Diffusers'; setup ≤ 10 s (FLUX size).",
        "",
        "| Model | Format | Packed | Resident step | Diffusers group offload | omni layerwise | Target | Peak omni / "
        "Diffusers | Setup omni from device / host | Host launch resident / omni, omni hooks per step | Bitwise "
        "omni / Diffusers | Meets |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in report["entries"]:
        resident, omni, diff = (_variant(entry, n) for n in ("resident", "omni layerwise", "diffusers group_offload"))
        from_host = next((v for v in entry["variants"] if v["variant"] == "omni layerwise from host"), {})
        diff_step = f"{diff['step_s']:.3f}" if "step_s" in diff else f"error: {diff.get('error', '')[:90]}"
        meets = [omni.get(k) for k in ("meets_step_target", "meets_peak_target", "meets_setup_target")]
        verdict = "yes" if all(m is not False for m in meets) and meets[0] is not None else "NO: " + ", ".join(
            k for k, m in zip(("step", "peak", "setup"), meets) if m is False)
        lines.append(
            f"| {entry['model']} | {entry['format']} | {_gib(entry['packed_bytes'])} | {_fmt(resident.get('step_s'))} | "
            f"{diff_step} | {_fmt(omni.get('step_s'))} | {_fmt(omni.get('target_step_s'))} | "
            f"{_gib(omni.get('peak_device_bytes'))} / {_gib(diff.get('peak_device_bytes'))} | "
            f"{_fmt(omni.get('setup_s'), '.1f')} / {_fmt(from_host.get('setup_s'), '.1f')} | "
            f"{_fmt(resident.get('host_s'))} / {_fmt(omni.get('host_s'))}, {_fmt(omni.get('hook_s_per_step'), '.4f')} | "
            f"{_fmt(omni.get('bitwise_equal_to_resident'))} / "
            f"{_fmt(diff.get('bitwise_equal_to_resident'))} | {verdict} |")
    lines += _variant_table(
        report, "omni layerwise prefetch_depth=",
        "A deeper window (no budget, `prefetch_depth` > 1: more blocks in flight) against the same target and "
        "Diffusers' peak:", ["Variant", "Step", "Target", "Peak", "Diffusers' peak", "Bitwise"],
        lambda entry, v: [v["variant"], _fmt(v.get("step_s")), _fmt(_variant(entry, "omni layerwise").get("target_step_s")),
                          _gib(v.get("peak_device_bytes")),
                          _gib(_variant(entry, "diffusers group_offload").get("peak_device_bytes")),
                          _fmt(v.get("bitwise_equal_to_resident"))])
    lines += _variant_table(
        report, "omni layerwise, max_device_memory=",
        "With a budget (`max_device_memory`: blocks kept resident, more loads in flight), against the target of its "
        "own streamed bytes and the peak it costs:", ["Variant", "Streamed", "Step", "Target", "Meets", "Peak", "Bitwise"],
        lambda entry, v: [v["variant"], _gib(v.get("streamed_bytes")), _fmt(v.get("step_s")),
                          _fmt(v.get("target_step_s")), _fmt(v.get("meets_step_target")),
                          _gib(v.get("peak_device_bytes")), _fmt(v.get("bitwise_equal_to_resident"))])
    lines += _variant_table(
        report, "resident, copy traffic",
        "The resident model while its packed bytes are copied host→device alongside once per step, with no "
        "dependency between the two (what the copies alone cost compute, under no schedule and no memory limit):",
        ["Resident step", "With copy traffic", "Over resident", "Copied", "Copy floor", "omni layerwise", "Target"],
        lambda entry, v: [_fmt(_variant(entry, "resident").get("step_s")), _fmt(v.get("step_s")),
                          _fmt(v.get("over_resident")), _gib(v.get("traffic_bytes")), _fmt(v.get("traffic_floor_s")),
                          _fmt(_variant(entry, "omni layerwise").get("step_s")),
                          _fmt(_variant(entry, "omni layerwise").get("target_step_s"))])
    traced = [(entry, v) for entry in report["entries"] for v in entry["variants"] if v.get("peak_trace")]
    if traced:
        lines += ["", "Where the peak is (one more forward, device memory allocated while each block runs):", "",
                  "| Model | Format | Variant | Before the first block | Peak | At block | In flight at most |",
                  "|---|---|---|---|---|---|---|"]
        for entry, v in traced:
            trace = v["peak_trace"]
            lines.append(f"| {entry['model']} | {entry['format']} | {v['variant']} | "
                         f"{_gib(trace['allocated_before_forward'])} | {_gib(trace['peak_bytes'])} | "
                         f"{trace['peak_block']} | {_gib(v.get('max_in_flight_bytes'))} |")
    bounded = [entry for entry in report["entries"] if entry.get("per_block")]
    if bounded:
        lines += ["", "## Per-block bound", "",
                  "compute_i: block i's forward in the resident quantized model (timer around the block, median); "
                  "copy_i: block i's packed bytes in one pinned host→device copy (median). With a window of two "
                  "blocks, block i+1 loads only while block i runs, so a streamed step takes at least "
                  "Σ_i max(compute_i, copy_i+1) (cyclic: the last block runs while the next step's first loads). "
                  "Without a budget layerwise loads the next step's first block after the last block ends: "
                  "\"after last\" replaces the last term by compute_last + max(time outside the blocks, copy_0).",
                  "",
                  "| Model | Format | Σ compute | Σ copy | Bound cyclic / after last | Bound / target | omni step / "
                  "bound | Largest copy−compute deficits (running → loading: deficit) |",
                  "|---|---|---|---|---|---|---|---|"]
        for entry in bounded:
            pb = entry["per_block"]
            worst = "; ".join(f"{d['running']} → {d['loading']}: {d['deficit_s'] * 1e3:+.2f} ms"
                              for d in pb["largest_deficits"])
            lines.append(f"| {entry['model']} | {entry['format']} | {_fmt(pb['sum_compute_s'], '.4f')} | "
                         f"{_fmt(pb['sum_copy_s'], '.4f')} | {_fmt(pb['bound_s'], '.4f')} / "
                         f"{_fmt(pb.get('bound_after_last_s'), '.4f')} | "
                         f"{_fmt(pb.get('bound_over_target'), '.2f')} | {_fmt(pb.get('omni_step_over_bound'), '.2f')} | {worst} |")
    probed = [(entry, v) for entry in report["entries"] for v in entry["variants"] if "alloc_deltas" in v]
    if probed:
        lines += ["", "## Cache probe", "",
                  "Allocator counters over the timed steps (num_alloc_retries / num_device_alloc / num_device_free "
                  "deltas) and the bytes reserved by PyTorch's caching allocator before them. \"omni layerwise, "
                  "empty_cache\": the from-device pass again on a fresh model, torch.cuda.empty_cache() right before "
                  "and right after apply_offload.", "",
                  "| Model | Format | Variant | Step | Host launch | Reserved before steps | Retries / mallocs / "
                  "frees |", "|---|---|---|---|---|---|---|"]
        for entry, v in probed:
            d = v["alloc_deltas"]
            counts = v.get("alloc_note", "n/a") if d is None else \
                f"{d['num_alloc_retries']} / {d['num_device_alloc']} / {d['num_device_free']}"
            lines.append(f"| {entry['model']} | {entry['format']} | {v['variant']} | {_fmt(v.get('step_s'))} | "
                         f"{_fmt(v.get('host_s'))} | {_gib(v.get('reserved_before_timed_steps'))} | {counts} |")
    if report.get("skipped"):
        lines += ["", f"Not measured (time budget of {report['args']['time_budget']} s spent): "
                  + ", ".join(report["skipped"])]
    lines += ["", "Errors:", ""]
    for entry in report["entries"]:
        for v in entry["variants"]:
            if "error" in v:
                lines.append(f"- {entry['model']} / {entry['format']} / {v['variant']}: `{v['error']}`")
    return "\n".join(lines) + "\n"


def chart(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        print("matplotlib not installed; no chart", flush=True)
        return
    models = sorted({e["model"] for e in report["entries"]}, key=["flux", "wan"].index)
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        entries = [e for e in report["entries"] if e["model"] == model]
        width = 0.27
        for k, (label, color) in enumerate((("resident", "tab:blue"), ("diffusers group_offload", "tab:gray"),
                                            ("omni layerwise", "tab:green"))):
            steps = [_variant(e, label).get("step_s", 0.0) for e in entries]
            ax.bar([i + (k - 1) * width for i in range(len(entries))], steps, width, color=color, label=label)
        for i, e in enumerate(entries):
            target = _variant(e, "omni layerwise").get("target_step_s")
            if target:
                ax.hlines(target, i + 0.5 * width, i + 1.5 * width, colors="tab:red", linestyles="--")
        ax.set_xticks(range(len(entries)), [e["format"] for e in entries], fontsize=8)
        ax.set_ylabel("seconds per transformer forward")
        ax.set_title(f"{model}: quantized step (red: omni target; no bar: did not run)")
        ax.legend(fontsize=7)
    save_figure(plt, fig, path)


def versions() -> dict[str, str]:
    out = {}
    for name in ("torchao", "gguf", "bitsandbytes"):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed
            out[name] = "not installed"
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="flux,wan", help="comma-separated: flux, wan")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {FORMATS}")
    parser.add_argument("--device", default="cuda", help="cuda (measurements) or cpu (with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny models (checks the script, not speed)")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json, .md, .png (the runner, python -m benchmarks run, chooses it)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth-bytes", type=int, default=4 * GiB)
    parser.add_argument("--layers", type=int, default=None, help="fewer blocks at full width (quick checks)")
    parser.add_argument("--no-peak-trace", dest="peak_trace", action="store_false",
                        help="skip the per-block device-memory trace (one more forward per variant)")
    parser.add_argument("--per-block", action="store_true",
                        help="per-block compute (resident) and packed-bytes copy times, and the 2-block cyclic bound "
                             "Σ max(compute_i, copy_i+1)")
    parser.add_argument("--deeper", type=int, default=0, metavar="DEPTH",
                        help="also time layerwise with this prefetch_depth (a deeper window: its step and peak)")
    parser.add_argument("--budget", default="", metavar="GIB[,GIB...]",
                        help="also time layerwise with each max_device_memory=GIB (comma-separated; empty: off)")
    parser.add_argument("--cache-probe", action="store_true",
                        help="allocator counters over the omni steps, and the from-device pass once more on a fresh "
                             "model with torch.cuda.empty_cache() before (and after) apply_offload")
    parser.add_argument("--copy-traffic", action="store_true",
                        help="also time the resident model while its packed bytes are copied once per step "
                             "host→device alongside (no dependency): the compute cost of the copies alone")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: start no further format after this (what was measured is written)")
    args = parser.parse_args(argv)
    try:
        args.budget = [float(b) for b in args.budget.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--budget {args.budget!r}; allowed: GiB values separated by commas, e.g. 2.5,3")
    if any(b <= 0 for b in args.budget):
        parser.error(f"--budget {args.budget}; allowed: values above 0")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for field, values, allowed in (("--models", args.models, ("flux", "wan")), ("--formats", args.formats, FORMATS)):
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            parser.error(f"{field}: unknown {unknown}; allowed: {', '.join(allowed)}")
    if args.device not in ("cuda", "cpu"):
        parser.error(f"--device {args.device!r}; allowed: cuda, cpu")
    if args.device == "cpu" and not args.smoke:
        parser.error("--device cpu measures nothing useful; allowed only with --smoke")
    if args.smoke:
        args.warmup, args.repeats = 1, 2
        args.bandwidth_bytes = min(args.bandwidth_bytes, 64 * 2**20)
        if args.device == "cpu":  # bitsandbytes' CPU backend needs it installed; skip quietly otherwise
            args.formats = [f for f in args.formats if not f.startswith("bnb") or versions()["bitsandbytes"] !=
                            "not installed"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bandwidth = measure_bandwidth(device, args.bandwidth_bytes)
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    report = {"environment": environment(device), "versions": versions(), "args": vars(args),
              "bandwidth_bytes_per_s": bandwidth, "entries": []}
    started = time.perf_counter()
    report["skipped"] = []
    for name in args.models:
        for fmt in args.formats:
            if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
                report["skipped"].append(f"{name}/{fmt}")
                continue
            report["entries"].append(benchmark_format(name, fmt, args, device, bandwidth))
            # Written after every format, so a later failure keeps what was measured.
            out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
            out.with_suffix(".md").write_text(markdown(report))
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    out.with_suffix(".md").write_text(markdown(report))
    chart(report, out.with_suffix(".png"))
    print(markdown(report))
    print(f"wrote {out.with_suffix('.json')}, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
