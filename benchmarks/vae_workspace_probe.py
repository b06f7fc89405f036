"""Does the FLUX.1 VAE's decode give other bits when the device has less free memory? (#40: auto and the 10/11 GiB
budgets gave an image that is not the resident one, with no VAE tiling and no out-of-memory error recorded.)

PyTorch's cuDNN convolutions try the heuristics' plans in order and take the next one when a plan's workspace cannot
be allocated: under a memory cap (a card, a per-process fraction) a full device can change the algorithm, so the
bits and the time, with no error. This probe decodes the same latents (1024², bf16, the FLUX.1 VAE's configuration
with random weights) with the per-process fraction capping the process at ``--card-gib``, first with nothing else on
the device, then with ballast tensors leaving less and less free under the cap; each decode's SHA-256 and time, and
whether it matches the first. Then the same with ``torch.backends.cudnn.benchmark`` off and on, and the decode's own
peak.

    python -m benchmarks run vae-workspace-probe
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel

from benchmarks.pipeline_offload_bench import FLUX_DEV

GiB = 1 << 30


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.float().cpu().numpy().tobytes()).hexdigest()


def decode(vae: AutoencoderKL, latents: torch.Tensor) -> tuple[str, float, int]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with torch.inference_mode():
        image = vae.decode(latents, return_dict=False)[0]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before
    return digest(image), seconds, peak


def transformer_forward(model: FluxTransformer2DModel, inputs: dict) -> tuple[str, float, int]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model(**inputs, return_dict=False)[0]
    torch.cuda.synchronize()
    return digest(out), time.perf_counter() - start, torch.cuda.max_memory_allocated() - before


def flux_slice(device: torch.device, tokens: int) -> tuple[FluxTransformer2DModel, dict]:
    """FLUX.1-dev's transformer at its real widths with one double- and two single-stream blocks, and inputs of
    ``tokens`` image tokens and 512 text tokens (bf16)."""
    config = {**FLUX_DEV["transformer"], "num_layers": 1, "num_single_layers": 2}
    torch.manual_seed(0)
    model = FluxTransformer2DModel.from_config(config).to(device=device, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(2)
    inputs = {"hidden_states": torch.randn(1, tokens, 64, generator=g), "encoder_hidden_states":
              torch.randn(1, 512, 4096, generator=g), "pooled_projections": torch.randn(1, 768, generator=g),
              "timestep": torch.tensor([0.5]), "guidance": torch.tensor([3.5]),
              "img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(512, 3)}
    inputs = {k: v.to(device, torch.bfloat16 if k not in ("img_ids", "txt_ids") else torch.float32)
              for k, v in inputs.items()}
    return model, inputs


def under_pressure(run, card: int, frees: list[float], label: str, benchmark: bool) -> list[dict]:
    """``run()`` with all free, then with ballast leaving each of ``frees`` GiB free under the cap."""
    torch.cuda.empty_cache()
    reference, seconds, peak = run()
    rows = [{"what": label, "cudnn_benchmark": benchmark, "free_gib": None, "sha256": reference, "seconds": seconds,
             "peak_bytes": peak, "same": True}]
    for free in frees:
        torch.cuda.empty_cache()
        ballast = torch.empty(max(card - torch.cuda.memory_allocated() - int(free * GiB), 0), dtype=torch.uint8,
                              device="cuda")
        try:
            sha, seconds, peak = run()
            rows.append({"what": label, "cudnn_benchmark": benchmark, "free_gib": free, "sha256": sha,
                         "seconds": seconds, "peak_bytes": peak, "same": sha == reference})
        except torch.OutOfMemoryError as error:
            rows.append({"what": label, "cudnn_benchmark": benchmark, "free_gib": free,
                         "error": str(error).splitlines()[0]})
        del ballast
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card-gib", type=float, default=12.0)
    parser.add_argument("--free-gib", default="8,6,4,3,2.5,2,1.5,1", help="free GiB left under the cap, in order")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true", help="not on the CPU: the probe needs CUDA (exits 0 there)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not torch.cuda.is_available():
        report = {"skipped": "no CUDA device: the probe reads the CUDA allocator and cuDNN"}
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        out.with_suffix(".md").write_text(f"# VAE decode under device-memory pressure\n\n{report['skipped']}\n")
        return 0
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(args.card_gib * GiB / total, 1.0), device)
    torch.manual_seed(0)
    vae = AutoencoderKL.from_config(FLUX_DEV["vae"]).to(device=device, dtype=torch.bfloat16).eval()
    side = args.size // 8
    latents = torch.randn(1, 16, side, side, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    card = int(args.card_gib * GiB)
    frees = [float(f) for f in args.free_gib.split(",")]
    rows = []
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        rows += under_pressure(lambda: decode(vae, latents), card, frees, f"VAE decode {args.size}²", benchmark)
    torch.backends.cudnn.benchmark = False
    vae = None  # its memory goes back before the transformer slice is built
    model, inputs = flux_slice(device, (args.size // 16) ** 2)
    rows += under_pressure(lambda: transformer_forward(model, inputs), card, frees,
                           f"FLUX.1 transformer slice, {(args.size // 16) ** 2} tokens", False)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "card_gib": args.card_gib, "size": args.size, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = ["# VAE decode under device-memory pressure", "",
             f"{report['device']}, torch {report['torch']}, cuDNN {report['cudnn']}; FLUX.1 VAE (random weights, bf16), "
             f"{args.size}² decode, process capped at {args.card_gib:g} GiB by the per-process fraction; ballast leaves "
             "the free GiB shown under the cap.", "",
             "| what | cudnn.benchmark | free under the cap | time | peak | same bits as with all free |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        free = "all" if row["free_gib"] is None else f"{row['free_gib']:g} GiB"
        if "error" in row:
            lines.append(f"| {row['what']} | {row['cudnn_benchmark']} | {free} | out of memory | | |")
            continue
        lines.append(f"| {row['what']} | {row['cudnn_benchmark']} | {free} | {row['seconds'] * 1e3:.1f} ms | "
                     f"{row['peak_bytes'] / GiB:.2f} GiB | {'yes' if row['same'] else '**no**'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
