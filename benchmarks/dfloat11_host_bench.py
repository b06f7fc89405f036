"""Blocks read from disk under ``max_host_memory``: from the bf16 checkpoint, or coded from a DFloat11 checkpoint
(#37 item 2).

A FLUX.1-dev-size transformer (``--double`` + ``--single`` blocks, random bf16 weights) is saved twice to a scratch
folder: as a Diffusers checkpoint (``save_pretrained``) and as a DFloat11 checkpoint with DFloat11's FLUX.1 pattern
(coded by ``benchmarks/dfloat11_probe.py``'s encoder, on the GPU). Then, each with the same ``max_host_memory`` and
the page cache dropped before every forward:

- ``bf16 checkpoint``: the transformer loaded as views of its files (``load_transformer_mmap``); the blocks the budget
  keeps off the host are read from the checkpoint at each load (the ``disk`` store);
- ``DFloat11 checkpoint``: the transformer loaded by ``load_dfloat11`` (decoded on the GPU); those blocks are read
  from the DFloat11 checkpoint, coded, and decoded on the GPU at each load (the ``disk (DFloat11)`` store).

Per run: the load and enable times, every forward's time (the first and the median), the bytes read from disk per
forward, and whether each output is bitwise the resident transformer's.

    python -m benchmarks run dfloat11-host          # --smoke: a tiny transformer on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import save_file

from benchmarks.common import flux_inputs, random_parameters_on
from benchmarks.dfloat11_probe import encode_unit
from benchmarks.host_auto_cgroup import drop_page_cache
from benchmarks.pipeline_offload_bench import FLUX_DEV, FLUX_TINY
from diffusers_omni import LayerwiseOffloadConfig, apply_offload, load_dfloat11
from diffusers_omni.offload.loading import load_transformer_mmap

GiB = 1 << 30
# DFloat11's FLUX.1 pattern (its FLUX.1 checkpoints' dfloat11_config): the Linear weights coded together per block
FLUX_PATTERN = {
    r"transformer_blocks\.\d+": ["norm1.linear", "norm1_context.linear", "attn.to_q", "attn.to_k", "attn.to_v",
                                 "attn.add_k_proj", "attn.add_v_proj", "attn.add_q_proj", "attn.to_out.0",
                                 "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                                 "ff_context.net.2"],
    r"single_transformer_blocks\.\d+": ["norm.linear", "proj_mlp", "proj_out", "attn.to_q", "attn.to_k",
                                        "attn.to_v"],
}


def write_dfloat11(model: torch.nn.Module, folder: Path) -> int:
    """``model`` as a DFloat11 checkpoint in ``folder`` (units coded on the weights' device); its bytes."""
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    coded: set[str] = set()
    for name, _ in model.named_modules():
        for pattern, attributes in FLUX_PATTERN.items():
            if re.fullmatch(pattern, name):
                weights = [f"{name}.{attribute}.weight" for attribute in attributes]
                for key, value in encode_unit([state[w] for w in weights]).items():
                    tensors[f"{name}.{key}"] = value.cpu().contiguous()
                coded.update(weights)
    tensors.update({k: v.cpu().contiguous() for k, v in state.items() if k not in coded})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "diffusion_pytorch_model.safetensors")
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    config["dfloat11_config"] = {"version": "0.5.0", "threads_per_block": [512], "bytes_per_thread": 8,
                                 "pattern_dict": FLUX_PATTERN}
    (folder / "config.json").write_text(json.dumps(config))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def forwards(model: torch.nn.Module, batch: dict[str, Any], folder: Path, repeats: int, device: torch.device,
             reference: torch.Tensor) -> tuple[list[float], bool]:
    times, same = [], True
    for _ in range(repeats):
        drop_page_cache(folder)
        start = time.perf_counter()
        with torch.inference_mode():
            output = model(**batch, return_dict=False)[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        same = same and bool(torch.equal(output.cpu(), reference))
    return times, same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--double", type=int, default=19)
    parser.add_argument("--single", type=int, default=38)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--host-budget-gib", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", default=None, help="scratch folder for the two checkpoints (default: a temporary "
                                                       "one, removed after)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.smoke:
        device, config, tokens, text, double, single = torch.device("cpu"), FLUX_TINY["transformer"], 16, 8, 6, 6
    elif not torch.cuda.is_available():
        raise SystemExit("dfloat11-host needs a CUDA device; --smoke checks the script on the CPU")
    else:
        device, config, tokens, text, double, single = (torch.device("cuda", torch.cuda.current_device()),
                                                        FLUX_DEV["transformer"], args.tokens, 512, args.double,
                                                        args.single)
    config = {**config, "num_layers": double, "num_single_layers": single}
    scratch = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="omni-df11-"))
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)",
                              "torch": torch.__version__, "double": double, "single": single, "tokens": tokens,
                              "repeats": args.repeats, "smoke": args.smoke, "runs": []}
    try:
        with torch.device("meta"):
            model = FluxTransformer2DModel.from_config(config)
        model = random_parameters_on(model, device).eval()
        batch = flux_inputs(config, tokens, text, device, seed=1)
        with torch.inference_mode():
            reference = model(**batch, return_dict=False)[0].cpu()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        started = time.perf_counter()
        model.save_pretrained(scratch / "bf16")
        report["save_bf16_s"] = time.perf_counter() - started
        started = time.perf_counter()
        report["dfloat11_bytes"] = write_dfloat11(model, scratch / "df11")
        report["write_dfloat11_s"] = time.perf_counter() - started
        report["weights_bytes"] = weights
        budget = int(weights * 0.8) if args.smoke else int(args.host_budget_gib * GiB)
        report["host_budget"] = budget
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for run in ("bf16 checkpoint", "DFloat11 checkpoint"):
            folder = scratch / ("bf16" if run.startswith("bf16") else "df11")
            drop_page_cache(folder)
            started = time.perf_counter()
            if run.startswith("bf16"):
                model = load_transformer_mmap(FluxTransformer2DModel, folder, torch_dtype=torch.bfloat16)
            else:
                with torch.device("meta"):
                    model = FluxTransformer2DModel.from_config(config).to(torch.bfloat16)
                model = load_dfloat11(model, folder, device=device if device.type == "cuda" else "cpu")
            load_s = time.perf_counter() - started
            started = time.perf_counter()
            backend = apply_offload(model, LayerwiseOffloadConfig(device=str(device), max_host_memory=budget))
            enable_s = time.perf_counter() - started
            try:
                times, same = forwards(model, batch, folder, args.repeats, device, reference)
                stats = backend.stats
                row = {"run": run, "load_s": load_s, "enable_s": enable_s, "forward_s": times,
                       "first_s": times[0], "median_s": statistics.median(times), "bitwise": same,
                       "disk_blocks": stats.disk_blocks, "disk_bytes_per_pass": stats.disk_bytes_per_pass,
                       "store_blocks": dict(stats.store_blocks), "host_bytes": stats.host_bytes,
                       "staging_bytes": stats.staging_bytes}
            finally:
                backend.disable()
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
            del model, backend
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if not args.folder:
            shutil.rmtree(scratch, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    lines = ["# Blocks read from disk: the bf16 checkpoint against the DFloat11 checkpoint", "",
             f"{report['device']}, torch {report['torch']}; a FLUX.1-dev-width transformer of {double} + {single} "
             f"blocks ({report['weights_bytes'] / GiB:.2f} GiB bf16, random weights; its DFloat11 checkpoint "
             f"{report['dfloat11_bytes'] / GiB:.2f} GiB), {tokens} image tokens; max_host_memory "
             f"{budget / GiB:.2f} GiB; the page cache dropped before each of {args.repeats} forwards.", "",
             "| run | load | enable | first forward | median forward | read from disk per forward | disk blocks | "
             "bitwise as resident |", "|---|---|---|---|---|---|---|---|"]
    for row in report["runs"]:
        lines.append(f"| {row['run']} | {row['load_s']:.1f} s | {row['enable_s']:.1f} s | {row['first_s']:.2f} s | "
                     f"{row['median_s']:.2f} s | {row['disk_bytes_per_pass'] / GiB:.2f} GiB | {row['disk_blocks']} | "
                     f"{'yes' if row['bitwise'] else '**NO**'} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    return 0 if all(row["bitwise"] for row in report["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
