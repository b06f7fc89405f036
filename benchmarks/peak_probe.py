#!/usr/bin/env python
"""What is allocated on the device when each of the first blocks starts, under omni layerwise offload (H200 probe).

FLUX-size GGUF Q4_K (as ``quant_offload_bench`` builds it): one warm offloaded step, then one more with the
caching allocator's history recorded; at the start of ``transformer_blocks.0/1/2`` the live allocations are
snapshotted, and the ones alive at block 1 but not at block 2 are listed with the frames that allocated them.

    python -m benchmarks.peak_probe --out benchmarks/results/peak_probe_h200
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.offload_bench import make_inputs
from benchmarks.quant_offload_bench import build_model, quantize


def live_blocks() -> dict[int, dict]:
    snapshot = torch.cuda.memory._snapshot()
    live = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                          for f in block.get("frames", [])
                          if "torch/" not in f["filename"] or "nn/modules" in f["filename"]][:8]
                live[block["address"]] = {"size": block["size"], "frames": frames}
    return live


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="gguf-q4_k")
    parser.add_argument("--out", default="benchmarks/results/peak_probe_h200")
    args = parser.parse_args(argv)
    from diffusers_omni import OffloadConfig, apply_offload

    device = torch.device("cuda")
    model = build_model("flux", device, False)
    quantize(model, args.format, device)
    inputs = make_inputs("flux", model, device, False)
    apply_offload(model, OffloadConfig("layerwise", device=device))
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
