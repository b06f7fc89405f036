#!/usr/bin/env python
"""Offload benchmark: diffusers-omni layerwise / model-level offload against Diffusers' group offloading.

One process per model builds a full-size random-weight bf16 transformer once (parameters allocated directly in
bf16 on the host, filled from a small random pool) and measures, side by side:

* resident step time (whole model on the device, measured last);
* Diffusers ``enable_group_offload(block_level, num_blocks_per_group=1, use_stream=True)``, ``record_stream`` False
  and True;
* our layerwise offload, and (FLUX) with ``max_device_memory="12GiB"``;
* our model-level switch: time to bring the DiT in while an encoder is on the device, against bytes ÷ bandwidth;
* pinned host→device bandwidth (4 GiB) in the same process;
* per variant, host memory: RSS before and at its peak during enable, RSS while the steps run, and the
  page-locked bytes holding the weights (pinned tensors, and host memory diffusers-omni registered).

A step is one transformer forward under ``torch.inference_mode`` (median of several after warm-up, synchronised).

Usage (one process per model; results go to ``<out>.json``, ``<out>.md`` and ``<out>.png``)::

    python -m benchmarks run offload-flux       # (and offload-wan, offload-flux-budget, ...: python -m benchmarks --list)
    python -m benchmarks run offload-flux --smoke   # tiny models on CPU, checks the script's logic
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


import torch
import torch.nn as nn

from benchmarks.common import pyplot, save_figure

GiB = 2**30
TARGET_FACTOR = 1.05


# Environment probes ---------------------------------------------------------------------------------------------


def host_rss() -> dict[str, int]:
    """Current and peak resident set size of this process, in bytes (Linux; zeros elsewhere)."""
    values = {"rss": 0, "hwm": 0, "anon": 0, "file": 0}
    fields = {"VmRSS:": "rss", "VmHWM:": "hwm", "RssAnon:": "anon", "RssFile:": "file"}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = fields.get(line.split(":")[0] + ":")
            if key:
                values[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return values


class RssSampler:
    """Peaks of anonymous and file-backed resident memory (``RssAnon`` / ``RssFile``) while a ``with`` body runs,
    sampled every ``interval`` seconds by a thread (the kernel keeps a peak only for their sum, ``VmHWM``): whether
    a peak is memory the process owns or file pages it maps, which the kernel can drop."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.anon = self.file = 0

    def _sample(self) -> None:
        now = host_rss()
        self.anon, self.file = max(self.anon, now["anon"]), max(self.file, now["file"])

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            self._sample()

    def __enter__(self) -> "RssSampler":
        import threading

        self._done = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._sample()


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def trim_host_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def free_memory(device: torch.device) -> None:
    gc.collect()
    trim_host_heap()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def measure_bandwidth(device: torch.device, nbytes: int) -> float:
    """Pinned host→device copy bandwidth in bytes/s (median of 5)."""
    if device.type != "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return nbytes / statistics.median(times)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    free_memory(device)
    return nbytes / statistics.median(times)


# Model construction ---------------------------------------------------------------------------------------------


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters are created on the meta device (no host memory, no init); buffers stay real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def materialize_random(model: nn.Module, dtype: torch.dtype, seed: int = 0) -> int:
    """Give every meta parameter host storage in ``dtype`` filled from a random pool (std 0.02); returns bytes."""
    generator = torch.Generator().manual_seed(seed)
    pool = (torch.randn(2**24 + 7919, generator=generator) * 0.02).to(dtype)
    offset = 0
    total = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            data = torch.empty(param.shape, dtype=dtype)
            flat = data.view(-1)
            filled = 0
            while filled < flat.numel():
                count = min(flat.numel() - filled, pool.numel() - offset)
                flat[filled : filled + count].copy_(pool[offset : offset + count])
                filled += count
                offset = (offset + count) % (pool.numel() - 1)
            module._parameters[name] = nn.Parameter(data, requires_grad=False)
            total += data.numel() * data.element_size()
    return total


def meta_transformer(name: str, overrides: dict[str, Any]) -> nn.Module:
    """FLUX.1-dev (``name="flux"``, with guidance embeddings) or Wan 2.1 (otherwise) transformer at its default
    (full-size) config updated with ``overrides``, parameters on the meta device."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    if name == "flux":
        cls, kwargs = FluxTransformer2DModel, {"guidance_embeds": True}
    else:
        cls, kwargs = WanTransformer3DModel, {}
    with parameters_on_meta():
        return cls(**kwargs, **overrides)


SMOKE_CONFIG = {
    "flux": dict(num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)),
    "wan": dict(num_layers=3, num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32, freq_dim=32),
}


def build_model(name: str, smoke: bool) -> tuple[nn.Module, int]:
    model = meta_transformer(name, SMOKE_CONFIG.get(name, SMOKE_CONFIG["wan"]) if smoke else {})
    # Buffers (rotary tables and the like) stay as the model built them.
    nbytes = materialize_random(model, torch.bfloat16)
    return model.eval(), nbytes


def transformer_inputs(
    name: str, config: Any, device: torch.device | str, text: int, image: int | tuple[int, int, int]
) -> dict[str, Any]:
    """Seeded random keyword inputs of one transformer forward on ``device``, in bfloat16 (ids and timestep stay
    float32): FLUX.1 (``name="flux"``) with an ``image`` × ``image`` grid of packed latent tokens, Wan otherwise
    with ``image = (frames, height, width)`` latents; ``text`` text tokens."""
    generator = torch.Generator().manual_seed(0)
    if name == "flux":
        side = image
        ids = torch.zeros(side * side, 3)
        ids[:, 1] = torch.arange(side).repeat_interleave(side)
        ids[:, 2] = torch.arange(side).repeat(side)
        inputs = {
            "hidden_states": torch.randn(1, side * side, config.in_channels, generator=generator),
            "encoder_hidden_states": torch.randn(1, text, config.joint_attention_dim, generator=generator),
            "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=generator),
            "timestep": torch.tensor([0.5]),
            "guidance": torch.tensor([3.5]),
            "img_ids": ids,
            "txt_ids": torch.zeros(text, 3),
        }
    else:
        inputs = {
            "hidden_states": torch.randn(1, config.in_channels, *image, generator=generator),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, text, config.text_dim, generator=generator),
        }
    out = {}
    for key, value in inputs.items():
        value = value.to(device)
        keep = key in ("img_ids", "txt_ids", "timestep")
        out[key] = value.to(torch.bfloat16) if value.is_floating_point() and not keep else value
    out["return_dict"] = False
    return out


def make_inputs(name: str, model: nn.Module, device: torch.device, smoke: bool) -> dict[str, Any]:
    if name == "flux":
        image: Any = 4 if smoke else 64  # 1024² image → 64×64 packed latent tokens
    else:
        image = (2, 4, 4) if smoke else (9, 60, 104)  # 33 frames, 480×832 → 14,040 tokens
    return transformer_inputs(name, model.config, device, 8 if smoke else 512, image)


# Measurements ---------------------------------------------------------------------------------------------------


def output_digest(output: Any) -> str:
    """SHA-256 of the bytes of a forward's first output tensor (bit-for-bit comparison across variants)."""
    import hashlib

    tensor = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
    return hashlib.sha256(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def time_steps(model: nn.Module, inputs: dict[str, Any], device: torch.device, warmup: int, repeats: int) -> dict:
    times, digests = [], set()
    with torch.inference_mode():
        for index in range(warmup + repeats):
            synchronize(device)
            start = time.perf_counter()
            output = model(**inputs)
            synchronize(device)
            if index >= warmup:
                times.append(time.perf_counter() - start)
            if index in (0, warmup + repeats - 1):  # the first and the last step's output, outside the timing
                digests.add(output_digest(output))
            del output
    return {"step_s": statistics.median(times), "step_all_s": times, "output_digests": sorted(digests)}


def run_variant(label: str, setup: Callable[[], Any], teardown: Callable[[Any], None], model: nn.Module,
                inputs: dict, device: torch.device, args: argparse.Namespace) -> dict:
    print(f"[{label}] setting up", flush=True)
    free_memory(device)
    reset_peak(device)
    rss_before = host_rss()["rss"]
    peak_reset = reset_peak_rss()
    start = time.perf_counter()
    handle = setup()
    synchronize(device)
    setup_s = time.perf_counter() - start
    rss = host_rss()
    result = {
        "variant": label,
        "setup_s": setup_s,
        "host_rss_before": rss_before,
        "host_rss_after_setup": rss["rss"],
        "host_rss_peak_setup": rss["hwm"] if peak_reset else None,
    }
    result.update(pinned_host_bytes(model))
    reset_peak(device)
    result.update(time_steps(model, inputs, device, args.warmup, args.repeats))
    result["peak_device_bytes"] = peak_bytes(device)
    # Steady state: what the offload holds on the host while steps run (the peak since setup started).
    rss = host_rss()
    result["host_rss_steady"] = rss["rss"]
    result["host_rss_peak_run"] = rss["hwm"] if peak_reset else None
    stats = getattr(handle, "stats", None)
    if stats is not None and hasattr(stats, "streamed_bytes_per_pass"):
        result.update({
            "streamed_bytes": stats.streamed_bytes_per_pass,
            "streamed_blocks": stats.streamed_blocks,
            "resident_blocks": stats.resident_blocks,
            "slot_bytes": stats.slot_bytes,
            "slot_count": stats.slot_count,
            "on_demand_loads": stats.on_demand_loads,
            "host_memory_mode": stats.host_memory_mode,
        })
        if "lossless" in getattr(stats, "store_bytes", {}):  # compression="lossless": what moves is the code
            from diffusers_omni.offload.codec import kernel_name

            result.update({
                "coded_blocks": stats.store_blocks["lossless"],
                "coded_logical_bytes": stats.store_bytes["lossless"],
                "coded_host_bytes": stats.store_host_bytes["lossless"],
                "coded_ratio": stats.store_host_bytes["lossless"] / max(stats.store_bytes["lossless"], 1),
                "codec_counters": stats.store_counters.get("lossless", {}),
                "decode_kernel": kernel_name(device),
                "moved_bytes": stats.streamed_bytes_per_pass - stats.store_bytes["lossless"]
                + stats.store_host_bytes["lossless"],
            })
            if getattr(stats, "cache_counters", None):  # compression_cache_dir: what the enable read or wrote
                result["cache_counters"] = dict(stats.cache_counters)
                result["cache_seconds"] = dict(stats.cache_seconds)
    start = time.perf_counter()
    teardown(handle)
    synchronize(device)
    result["teardown_s"] = time.perf_counter() - start
    print(f"[{label}] step {result['step_s']:.4f} s, setup {setup_s:.2f} s, peak "
          f"{_gib(result['peak_device_bytes'])}", flush=True)
    return result


def pinned_host_bytes(model: nn.Module) -> dict[str, int]:
    """Page-locked host memory holding ``model``'s weights: ``pinned_host_bytes`` counts the unique storages that
    report ``is_pinned()`` among its parameters and buffers and the host copies of Diffusers' group-offload hooks
    (``cpu_param_dict``); ``registered_host_bytes`` is what diffusers-omni registered with ``cudaHostRegister``."""
    from diffusers_omni.offload.memory import registered_host_bytes

    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in (getattr(registry, "hooks", None) or {}).values():
            copies = getattr(getattr(hook, "group", None), "cpu_param_dict", None) or {}
            tensors += [t for t in copies.values() if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    pinned = 0
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        try:
            is_pinned = tensor.is_pinned()
        except RuntimeError:  # no accelerator to ask
            is_pinned = False
        storage = tensor.untyped_storage()
        if is_pinned and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            pinned += storage.nbytes()
    return {"pinned_host_bytes": pinned, "registered_host_bytes": registered_host_bytes()}


def remove_group_offload(model: nn.Module) -> None:
    from diffusers.hooks import HookRegistry

    registry = HookRegistry.check_if_exists_or_initialize(model)
    for name in ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading"):
        registry.remove_hook(name, recurse=True)
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.device.type != "cpu":
                tensor.data = tensor.data.cpu()


class _SwitchHolder:
    """A minimal pipeline for the model-level switch: one DiT and one encoder."""

    _dit_modules = ("transformer",)
    _encoder_modules = ("text_encoder",)
    _vae_modules = ()
    _resident_modules = ()

    def __init__(self, transformer: nn.Module, text_encoder: nn.Module) -> None:
        self.transformer = transformer
        self.text_encoder = text_encoder


def synthetic_encoder(nbytes: int) -> nn.Module:
    width = 4096
    layers = max(1, nbytes // (width * width * 2))
    with parameters_on_meta():
        encoder = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    materialize_random(encoder, torch.bfloat16, seed=1)
    return encoder.eval()


def measure_model_level_switch(model: nn.Module, model_bytes: int, device: torch.device, bandwidth: float,
                               args: argparse.Namespace) -> dict:
    from diffusers_omni import OffloadConfig, get_offload_backend

    encoder = synthetic_encoder(args.encoder_bytes)
    encoder_bytes = sum(p.numel() * p.element_size() for p in encoder.parameters())
    holder = _SwitchHolder(model, encoder)
    backend = get_offload_backend(OffloadConfig("model_level", device=device))
    start = time.perf_counter()
    backend.enable(holder)
    setup_s = time.perf_counter() - start
    to_dit, to_encoder = [], []
    for _ in range(args.switch_repeats):
        for path, sink in (("text_encoder", to_encoder), ("transformer", to_dit)):
            synchronize(device)
            start = time.perf_counter()
            with backend.use(path):
                synchronize(device)
            sink.append(time.perf_counter() - start)
    backend.disable()
    del holder, encoder, backend
    free_memory(device)
    dit_s = statistics.median(to_dit)
    floor = model_bytes / bandwidth
    result = {
        "variant": "omni model-level switch",
        "setup_s": setup_s,
        "encoder_to_dit_s": dit_s,
        "dit_to_encoder_s": statistics.median(to_encoder),
        "dit_bytes": model_bytes,
        "encoder_bytes": encoder_bytes,
        "dit_floor_s": floor,
        "ratio_to_floor": dit_s / floor,
        "target_ratio": 1.1,
        "meets_target": dit_s <= 1.1 * floor,
    }
    print(f"[model-level] encoder→DiT {dit_s:.3f} s for {_gib(model_bytes)} (floor {floor:.3f} s)", flush=True)
    return result


def benchmark_model(name: str, args: argparse.Namespace, device: torch.device, bandwidth: float) -> dict:
    from diffusers_omni import OffloadConfig, apply_offload

    print(f"== {name}: building", flush=True)
    start = time.perf_counter()
    model, model_bytes = build_model(name, args.smoke)
    build_s = time.perf_counter() - start
    inputs = make_inputs(name, model, device, args.smoke)
    print(f"== {name}: {_gib(model_bytes)} of bf16 parameters built in {build_s:.1f} s", flush=True)
    variants: list[dict] = []
    use_stream = device.type == "cuda"

    def omni(budget: str | None, compression: str | None = None, cache_dir: str | None = None):
        def setup():
            return apply_offload(model, OffloadConfig("layerwise", device=device, max_device_memory=budget or "none",
                                                      compression=compression, compression_cache_dir=cache_dir))
        return setup

    def omni_teardown(backend):
        backend.disable()

    if "layerwise" in args.variants:
        variants.append(run_variant("omni layerwise", omni(None), omni_teardown, model, inputs, device, args))
    if "lossless" in args.variants:  # bfloat16 blocks moved coded, decoded on the device (#37)
        variants.append(run_variant("omni layerwise lossless", omni(None, "lossless"), omni_teardown, model, inputs,
                                    device, args))
    if "lossless-cache" in args.variants:  # compression_cache_dir: the enable that writes it, then one that reads it
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="omni-lossless-cache-", dir=args.cache_parent)
        try:
            for how in ("writes", "reads"):
                variants.append(run_variant(f"omni layerwise lossless, cache {how}", omni(None, "lossless", folder),
                                            omni_teardown, model, inputs, device, args))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    if "distributed" in args.variants:
        # Issue #4 on one GPU: world_size=1 process group (NCCL on CUDA, gloo on CPU); AllGather with one rank is the
        # single-device ring plus a staging copy and a one-rank all-gather per block.
        for use_allgather in (True, False):
            label = f"omni distributed-layerwise N=1 allgather={use_allgather}"

            def setup(use_allgather=use_allgather):
                return apply_offload(model, OffloadConfig("distributed_layerwise", device=device,
                                                          use_allgather=use_allgather))

            variants.append(run_variant(label, setup, omni_teardown, model, inputs, device, args))
    if name in args.budget_models and "budget" in args.variants:
        variants.append(run_variant(f"omni layerwise {args.budget}", omni(args.budget), omni_teardown, model,
                                    inputs, device, args))
    if name in args.budget_models and "lossless-budget" in args.variants:
        variants.append(run_variant(f"omni layerwise lossless {args.budget}", omni(args.budget, "lossless"),
                                    omni_teardown, model, inputs, device, args))
    switch = None
    if not args.skip_model_level and "model-level" in args.variants:
        switch = measure_model_level_switch(model, model_bytes, device, bandwidth, args)

    record_streams = ((False, True) if use_stream else (False,)) if "diffusers" in args.variants else ()
    for record_stream in record_streams:
        def diffusers_setup(record_stream=record_stream):
            model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                       offload_type="block_level", num_blocks_per_group=1, use_stream=use_stream,
                                       record_stream=record_stream)
            return None

        label = f"diffusers group_offload record_stream={record_stream}"
        variants.append(run_variant(label, diffusers_setup, lambda _: remove_group_offload(model), model, inputs,
                                    device, args))

    def resident_setup():
        model.to(device)
        return None

    variants.append(run_variant("resident", resident_setup, lambda _: model.to("cpu"), model, inputs, device, args))
    resident_step = variants[-1]["step_s"]
    diffusers_peaks = [v["peak_device_bytes"] for v in variants if v["variant"].startswith("diffusers")]
    for variant in variants:
        if "streamed_bytes" not in variant:
            continue
        floor = variant["streamed_bytes"] / bandwidth
        target = TARGET_FACTOR * max(resident_step, floor)
        variant.update({
            "stream_floor_s": floor,
            "target_step_s": target,
            "meets_step_target": variant["step_s"] <= target,
            "meets_peak_target": None if variant["peak_device_bytes"] is None or not diffusers_peaks
            else variant["peak_device_bytes"] <= min(diffusers_peaks),
            "meets_setup_target": variant["setup_s"] <= 10 * model_bytes / (22.17 * GiB),
            "meets_rss_target": None if not variant["host_rss_peak_setup"]
            else variant["host_rss_peak_setup"] <= 1.1 * model_bytes + variant["host_rss_before"] - model_bytes,
        })
    reference = next((v["output_digests"] for v in variants if v["variant"] == "resident"), None)
    for variant in variants:  # bit for bit: every step of every variant gave the resident model's output
        variant["same_output_as_resident"] = (None if reference is None or variant["variant"] == "resident"
                                              else len(variant["output_digests"]) == 1
                                              and variant["output_digests"] == reference)
        if "coded_ratio" in variant:  # compression: against the bf16 floor (the issue's target: ≤ 0.75×)
            variant["ratio_to_bf16_floor"] = variant["step_s"] / variant["stream_floor_s"]
    single = next((v["step_s"] for v in variants if v["variant"] == "omni layerwise"), None)
    for variant in variants:
        if variant["variant"].startswith("omni distributed") and single:
            # Distributed issue's rule: at world size 1 the collective path costs at most 5% over plain layerwise.
            variant["ratio_to_layerwise"] = variant["step_s"] / single
            variant["meets_distributed_target"] = variant["step_s"] <= 1.05 * single
    mmap = measure_mmap_loading(model, model_bytes, device) if "mmap" in args.variants else None
    del model
    free_memory(device)
    return {"model": name, "param_bytes": model_bytes, "build_s": build_s, "variants": variants,
            "model_level_switch": switch, "mmap_loading": mmap}


def measure_mmap_loading(model: nn.Module, model_bytes: int, device: torch.device) -> dict:
    """Save the model, load it back as mmap views (``load_transformer_mmap``), enable distributed layerwise offload
    (or layerwise without a process group) and report host memory at each stage: file-backed pages are the shared
    page cache, anonymous pages are this rank's own."""
    import shutil
    import tempfile

    import torch.distributed as dist

    from diffusers_omni import OffloadConfig, apply_offload, load_transformer_mmap

    folder = Path(tempfile.mkdtemp(prefix="omni_mmap_"))
    try:
        start = time.perf_counter()
        model.save_pretrained(folder, max_shard_size="5GB")
        save_s = time.perf_counter() - start
        trim_host_heap()
        before = host_rss()
        start = time.perf_counter()
        loaded = load_transformer_mmap(type(model), folder, torch_dtype=torch.bfloat16)
        load_s = time.perf_counter() - start
        after_load = host_rss()
        strategy = "distributed_layerwise" if dist.is_initialized() else "layerwise"
        start = time.perf_counter()
        backend = apply_offload(loaded, OffloadConfig(strategy, device=device, **(
            {} if strategy == "distributed_layerwise" else {"max_device_memory": "none"})))
        pack_s = time.perf_counter() - start
        trim_host_heap()
        after_pack = host_rss()
        backend.disable()
        del loaded, backend
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    result = {
        "strategy": strategy, "world_size": world, "save_s": save_s, "load_s": load_s, "pack_s": pack_s,
        "before": before, "after_load": after_load, "after_pack": after_pack,
        "anon_growth_after_pack": after_pack["anon"] - before["anon"],
        "target_anon_growth": 1.05 * model_bytes / world,
    }
    result["meets_rss_target"] = result["anon_growth_after_pack"] <= result["target_anon_growth"]
    print(f"[mmap] load {load_s:.1f} s, pack {pack_s:.1f} s; anon RSS +{_gib(result['anon_growth_after_pack'])} "
          f"(target ≤ {_gib(result['target_anon_growth'])}), file RSS {_gib(after_pack['file'])}", flush=True)
    return result


# Reports --------------------------------------------------------------------------------------------------------


def _gib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GiB:.2f} GiB"


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# Offload benchmark",
        "",
        f"{env['device_name']}, torch {env['torch']}, diffusers {env['diffusers']}; pinned host→device "
        f"{report['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (4 GiB copy, same process). Median of "
        f"{report['args']['repeats']} steps after {report['args']['warmup']} warm-up, one transformer forward under "
        "inference_mode. Targets: step ≤ 1.05 × max(resident, streamed bytes ÷ bandwidth); peak ≤ Diffusers'; "
        "setup ≤ 10 s per 22.17 GiB; host RSS growth ≤ 0.1 × model.",
        "",
    ]
    for entry in report["models"]:
        lines += [
            f"## {entry['model']} ({_gib(entry['param_bytes'])} bf16)",
            "",
            "| Variant | Step (s) | Target (s) | Peak device | Setup (s) | Host RSS peak in setup | Host RSS while "
            "stepping | Pinned / registered host | Streamed | Meets | Same output as resident |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in entry["variants"]:
            meets = [v.get(k) for k in ("meets_step_target", "meets_peak_target", "meets_setup_target",
                                        "meets_rss_target") if k in v]
            verdict = "n/a" if not meets else ("yes" if all(m is not False for m in meets) else "NO: " + ", ".join(
                k.split("_")[1] for k in ("meets_step_target", "meets_peak_target", "meets_setup_target",
                                          "meets_rss_target") if v.get(k) is False))
            lines.append(
                f"| {v['variant']} | {_fmt(v['step_s'])} | {_fmt(v.get('target_step_s'))} | "
                f"{_gib(v['peak_device_bytes'])} | {_fmt(v['setup_s'], '.1f')} | {_gib(v['host_rss_peak_setup'])} | "
                f"{_gib(v.get('host_rss_steady'))} | {_gib(v.get('pinned_host_bytes'))} / "
                f"{_gib(v.get('registered_host_bytes'))} | {_gib(v.get('streamed_bytes'))} | {verdict} | "
                f"{_same(v.get('same_output_as_resident'))} |"
            )
        coded = [v for v in entry["variants"] if "coded_ratio" in v]
        if coded:
            lines += ["", "compression=\"lossless\" (target: step ≤ 0.75 × streamed bf16 bytes ÷ bandwidth):", ""]
            lines += [f"- {v['variant']}: {v['coded_blocks']} blocks coded to {v['coded_ratio']:.3f} of their bf16 "
                      f"bytes ({_gib(v['coded_host_bytes'])} for {_gib(v['coded_logical_bytes'])}), "
                      f"{_gib(v['moved_bytes'])} moved per step, decoded by {v['decode_kernel']}; step "
                      f"{v['step_s']:.3f} s = {v['ratio_to_bf16_floor']:.3f} × the bf16 floor "
                      f"({v['stream_floor_s']:.3f} s); setup (coding included) {v['setup_s']:.1f} s"
                      + (f" = {v['setup_s'] / (v['coded_logical_bytes'] / 1e9):.2f} s per GB of coded weights"
                         if v.get("coded_logical_bytes") else "")
                      + (f"; compression_cache_dir: read {v['cache_counters']['cache blocks read']} blocks, wrote "
                         f"{v['cache_counters']['cache blocks written']}" if v.get("cache_counters") else "")
                      for v in coded]
        distributed = [v for v in entry["variants"] if "ratio_to_layerwise" in v]
        if distributed:
            lines += ["", "Distributed layerwise at world size 1 against single-GPU layerwise (target ≤ 1.05×):", ""]
            lines += [f"- {v['variant']}: {v['step_s']:.3f} s = {v['ratio_to_layerwise']:.3f} × layerwise "
                      f"({_fmt(v['meets_distributed_target'])})" for v in distributed]
        mmap = entry.get("mmap_loading")
        if mmap:
            lines += [
                "",
                f"mmap loading ({mmap['strategy']}, world size {mmap['world_size']}): load {mmap['load_s']:.1f} s, "
                f"pack {mmap['pack_s']:.1f} s; anonymous RSS growth {_gib(mmap['anon_growth_after_pack'])} (target ≤ "
                f"{_gib(mmap['target_anon_growth'])}: {_fmt(mmap['meets_rss_target'])}); file-backed RSS after packing "
                f"{_gib(mmap['after_pack']['file'])}.",
            ]
        switch = entry.get("model_level_switch")
        if switch:
            lines += [
                "",
                f"Model-level switch: encoder→DiT {switch['encoder_to_dit_s']:.3f} s for {_gib(switch['dit_bytes'])} "
                f"(bytes ÷ bandwidth {switch['dit_floor_s']:.3f} s, ratio {switch['ratio_to_floor']:.2f}, target ≤ "
                f"1.10: {_fmt(switch['meets_target'])}); DiT→encoder {switch['dit_to_encoder_s']:.3f} s for "
                f"{_gib(switch['encoder_bytes'])}.",
            ]
        lines.append("")
    return "\n".join(lines)


def _same(value: bool | None) -> str:
    return "reference" if value is None else ("yes" if value else "NO")


def chart(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        print("matplotlib not installed; no chart", flush=True)
        return
    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, entry in zip(axes[0], models):
        labels = [v["variant"].replace("diffusers group_offload ", "diffusers\n").replace("omni ", "omni\n")
                  for v in entry["variants"]]
        steps = [v["step_s"] for v in entry["variants"]]
        colors = ["tab:green" if v["variant"].startswith("omni") else "tab:gray" for v in entry["variants"]]
        ax.bar(range(len(steps)), steps, color=colors)
        for i, v in enumerate(entry["variants"]):
            if "target_step_s" in v:
                ax.hlines(v["target_step_s"], i - 0.4, i + 0.4, colors="tab:red", linestyles="--")
            peak = v["peak_device_bytes"]
            ax.text(i, steps[i], f"{steps[i]:.3f}s\n{_gib(peak)}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(steps)), labels, fontsize=7)
        ax.set_ylabel("seconds per transformer forward")
        ax.set_title(f"{entry['model']} ({_gib(entry['param_bytes'])}); red: target")
    save_figure(plt, fig, path)


def environment(device: torch.device) -> dict:
    import diffusers

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpu_count": os.cpu_count(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="flux,wan", help="comma-separated: flux, wan")
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU (checks the script, not speed)")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json, .md, .png (the runner, python -m benchmarks run, chooses it)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", default="12GiB", help="max_device_memory for the budgeted layerwise run")
    parser.add_argument("--budget-models", default="flux", help="models that also run the budgeted variant")
    parser.add_argument("--bandwidth-bytes", type=int, default=4 * GiB)
    parser.add_argument("--encoder-bytes", type=int, default=4 * GiB, help="synthetic encoder for the switch test")
    parser.add_argument("--switch-repeats", type=int, default=3)
    parser.add_argument("--skip-model-level", action="store_true")
    parser.add_argument("--cache-parent", default=None,
                        help="lossless-cache: the folder under which its compression_cache_dir is made (default: the "
                             "temporary directory; it needs the coded model's bytes free)")
    parser.add_argument(
        "--variants",
        default="layerwise,budget,model-level,diffusers",
        help="comma-separated subset of layerwise, lossless (compression=lossless), lossless-budget (both), "
        "lossless-cache (with compression_cache_dir: the enable that writes it, then one that reads it), budget, "
        "model-level, diffusers, "
        "distributed (world_size=1), mmap (save the model, mmap-load it, report host RSS) (resident always runs: "
        "the targets need it)",
    )
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - {"flux", "wan"})
    if unknown:
        parser.error(f"--models: unknown {unknown}; allowed: flux, wan")
    args.budget_models = [m.strip() for m in args.budget_models.split(",") if m.strip()]
    args.variants = {v.strip() for v in args.variants.split(",") if v.strip()}
    allowed_variants = {"layerwise", "lossless", "lossless-budget", "lossless-cache", "budget", "model-level",
                        "diffusers", "distributed", "mmap"}
    unknown_variants = sorted(args.variants - allowed_variants)
    if unknown_variants:
        parser.error(f"--variants: unknown {unknown_variants}; allowed: {', '.join(sorted(allowed_variants))}")
    if args.smoke:
        args.warmup, args.repeats = 1, 2
        args.bandwidth_bytes = min(args.bandwidth_bytes, 64 * 2**20)
        args.encoder_bytes = min(args.encoder_bytes, 4 * 2**20)
        args.switch_repeats = 2
        if args.budget == "12GiB":
            args.budget = "300KiB"
    return args


def init_single_rank_group(device: torch.device) -> None:
    """A world_size=1 process group, so distributed layerwise offload runs on one GPU (NCCL) or the CPU (gloo)."""
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531")):
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.variants & {"distributed", "mmap"}:
        init_single_rank_group(device)
    print(f"measuring host→device bandwidth ({_gib(args.bandwidth_bytes)})", flush=True)
    bandwidth = measure_bandwidth(device, args.bandwidth_bytes)
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    report = {"environment": environment(device), "args": vars(args), "bandwidth_bytes_per_s": bandwidth,
              "models": []}
    for name in args.models:
        report["models"].append(benchmark_model(name, args, device, bandwidth))
        # Write after every model so a later failure keeps what was measured.
        out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    out.with_suffix(".md").write_text(markdown(report))
    chart(report, out.with_suffix(".png"))
    print()
    print(f"{'model':6} {'variant':44} {'step s':>8} {'target':>8} {'peak':>10} {'setup s':>8}")
    for entry in report["models"]:
        for v in entry["variants"]:
            print(f"{entry['model']:6} {v['variant']:44} {v['step_s']:8.3f} {_fmt(v.get('target_step_s')):>8} "
                  f"{_gib(v['peak_device_bytes']):>10} {v['setup_s']:8.1f}")
    print(f"wrote {out.with_suffix('.json')}, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
