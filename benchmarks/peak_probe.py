#!/usr/bin/env python
"""What is allocated on the device when each of the first blocks starts, under omni layerwise offload (H200 probe).

FLUX-size GGUF Q4_K (as ``quant_offload_bench`` builds it): one warm offloaded step, then one more with the
caching allocator's history recorded; at the start of ``transformer_blocks.0/1/2`` the live allocations are
snapshotted, and the ones alive at block 1 but not at block 2 are listed with the frames that allocated them.

    python -m benchmarks run peak-probe
    python -m benchmarks run peak-diff     # --diff: vs Diffusers, at each peak
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.offload_bench import free_memory, make_inputs, remove_group_offload
from benchmarks.quant_offload_bench import build_model, quantize


def live_blocks() -> dict[int, dict]:
    snapshot = torch.cuda.memory._snapshot()
    live = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live[block["address"]] = {"size": block["size"], "frames": _user_frames(block.get("frames", []))[:8]}
    return live


def peak_live_set(model, inputs, device) -> dict:
    """One forward with the caching allocator's history recorded; the allocation events replayed to the moment the
    allocated bytes peak, and what is live then (allocations made before the forward by size, the forward's own by
    the frames that made them)."""
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
    try:
        before = {b["address"]: b["size"] for s in torch.cuda.memory._snapshot()["segments"]
                  for b in s["blocks"] if b["state"] == "active_allocated"}
        torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            model(**inputs)
        torch.cuda.synchronize(device)
        stat_peak = torch.cuda.max_memory_allocated(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for e in snapshot["device_traces"][device.index or 0]
              if e["action"] in ("alloc", "free_requested")]
    live = dict(before)
    total = sum(live.values())
    peak, peak_at = total, -1
    for n, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
        elif e["addr"] in live:
            total -= live.pop(e["addr"])
        if total > peak:
            peak, peak_at = total, n
    live = {a: ("before the forward", s) for a, s in before.items()}
    for e in events[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (_where(e.get("frames", [])), e["size"])
        else:
            live.pop(e["addr"], None)
    groups: dict[str, list[int]] = {}
    for where, size in live.values():
        groups.setdefault(where, []).append(size)
    return {"stat_peak": stat_peak, "replayed_peak": peak, "events": len(events),
            "live_at_peak": {k: {"bytes": sum(v), "count": len(v)} for k, v in
                             sorted(groups.items(), key=lambda kv: -sum(kv[1]))}}


def _user_frames(frames: list[dict]) -> list[str]:
    """The frames outside torch's own modules (the model code, the offload hooks), innermost first."""
    return [f"{f['filename'].split('site-packages/')[-1].split('/work/')[-1]}:{f['line']} {f['name']}"
            for f in frames if ("torch/" not in f["filename"] or "nn/modules" in f["filename"])
            and "contextlib" not in f["filename"]]


def _where(frames: list[dict]) -> str:
    """The three innermost frames outside torch's own modules that allocated."""
    return " < ".join(_user_frames(frames)[:3]) or "(no python frame)"


def _quantized_flux(fmt: str, device: torch.device):
    """The FLUX-size model quantized as ``quant_offload_bench`` does it, and its inputs."""
    model = build_model("flux", device, False)
    quantize(model, fmt, device)
    return model, make_inputs("flux", model, device, False)


def diff_main(args) -> int:
    """Omni layerwise and Diffusers' group offload (the benchmark's settings) on one quantized model: what is live
    at each one's peak, allocations of the forward grouped by the frames that made them."""
    from diffusers_omni import OffloadConfig, apply_offload

    device = torch.device("cuda")
    model, inputs = _quantized_flux(args.format, device)
    report = {"format": args.format}
    backend = apply_offload(model, OffloadConfig("layerwise", device=device, max_device_memory="none"))
    with torch.inference_mode():
        model(**inputs)
    report["omni layerwise"] = peak_live_set(model, inputs, device)
    backend.disable()
    free_memory(device)
    # The same with the streamed blocks' device buffers in a private memory pool (kept apart from activations).
    from diffusers_omni.offload import streamer

    pool = torch.cuda.MemPool()
    original = streamer.StreamedBlock.allocate

    def allocate_in_pool(self):
        with torch.cuda.use_mem_pool(pool):
            return original(self)

    streamer.StreamedBlock.allocate = allocate_in_pool
    try:
        backend = apply_offload(model, OffloadConfig("layerwise", device=device, max_device_memory="none"))
        with torch.inference_mode():
            model(**inputs)
        report["omni layerwise, private pool"] = peak_live_set(model, inputs, device)
        backend.disable()
    finally:
        streamer.StreamedBlock.allocate = original
    del pool
    free_memory(device)
    model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                               num_blocks_per_group=1, use_stream=True, record_stream=True)
    with torch.inference_mode():
        model(**inputs)
    report["diffusers group_offload"] = peak_live_set(model, inputs, device)
    remove_group_offload(model)
    for variant in ("omni layerwise", "omni layerwise, private pool", "diffusers group_offload"):
        r = report[variant]
        print(f"{variant}: stat peak {r['stat_peak']}, replayed {r['replayed_peak']} ({r['events']} events)")
        for where, g in list(r["live_at_peak"].items())[:30]:
            print(f"  {g['bytes']:>12} {g['count']:>5}  {where}")
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="gguf-q4_k")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json (the runner, python -m benchmarks run, chooses it)")
    parser.add_argument("--diff", action="store_true",
                        help="omni layerwise vs Diffusers' group offload: what is live at each one's peak")
    args = parser.parse_args(argv)
    if args.diff:
        return diff_main(args)
    from diffusers_omni import OffloadConfig, apply_offload

    device = torch.device("cuda")
    model, inputs = _quantized_flux(args.format, device)
    apply_offload(model, OffloadConfig("layerwise", device=device, max_device_memory="none"))
    with torch.inference_mode():
        model(**inputs)
    torch.cuda.synchronize()
    snapshots: dict[str, dict] = {}

    def take(name):
        def hook(module, args_, kwargs_=None):
            torch.cuda.synchronize()
            snapshots[name] = {"allocated": torch.cuda.memory_allocated(), "live": live_blocks()}
        return hook

    handles = [model.transformer_blocks[i].register_forward_pre_hook(take(f"transformer_blocks.{i}"))
               for i in range(3)]
    torch.cuda.memory._record_memory_history(max_entries=200000)
    with torch.inference_mode():
        model(**inputs)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled=None)
    for handle in handles:
        handle.remove()
    report = {"format": args.format, "allocated": {k: v["allocated"] for k, v in snapshots.items()}}
    for a, b in (("transformer_blocks.1", "transformer_blocks.2"), ("transformer_blocks.0", "transformer_blocks.2")):
        live_a, live_b = snapshots[a]["live"], snapshots[b]["live"]
        sizes_b: dict[int, int] = {}
        for block in live_b.values():
            sizes_b[block["size"]] = sizes_b.get(block["size"], 0) + 1
        extra = []
        for address, block in sorted(live_a.items(), key=lambda kv: -kv[1]["size"]):
            if sizes_b.get(block["size"], 0):
                sizes_b[block["size"]] -= 1
                continue
            extra.append(block)
        report[f"alive at {a}, not at {b}"] = {"bytes": sum(x["size"] for x in extra), "blocks": extra[:25]}
        print(a, "vs", b, "extra bytes", sum(x["size"] for x in extra), flush=True)
        for block in extra[:12]:
            print("  ", block["size"], " | ".join(block["frames"][:5]), flush=True)
    print(report["allocated"], flush=True)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
