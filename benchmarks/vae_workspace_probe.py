"""Does the FLUX.1 VAE's decode give other bits when the device has less free memory? (#40: auto and the 10/11 GiB
budgets gave an image that is not the resident one, with no VAE tiling and no out-of-memory error recorded.)

PyTorch's cuDNN convolutions try the heuristics' plans in order and take the next one when a plan's workspace cannot
be allocated: under a memory cap (a card, a per-process fraction) a full device can change the algorithm, so the
bits and the time, with no error. This probe decodes the same latents (1024², bf16, the FLUX.1 VAE's configuration
with random weights) with the per-process fraction capping the process at ``--card-gib``, first with nothing else on
the device, then with ballast tensors leaving less and less free under the cap; each decode's SHA-256 and time, and
whether it matches the first. Then the same with ``torch.backends.cudnn.benchmark`` off and on, and the decode's own
peak.

    python -m benchmarks run vae-workspace-probe            # --smoke: the script on the CPU, tiny models
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel

from benchmarks.common import flux_inputs
from benchmarks.pipeline_offload_bench import FLUX_DEV, FLUX_TINY

GiB = 1 << 30


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.float().cpu().numpy().tobytes()).hexdigest()


def timed(call, device: torch.device) -> tuple[str, float, int | None]:
    """``call()``'s output digest, its seconds and (CUDA) the peak it allocated above what was allocated before."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with torch.inference_mode():
        output = call()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return digest(output), seconds, torch.cuda.max_memory_allocated() - before if cuda else None


def flux_slice(device: torch.device, tokens: int, config: dict, text_tokens: int
               ) -> tuple[FluxTransformer2DModel, dict]:
    """A FLUX.1 transformer of ``config`` (FLUX.1-dev's widths on the device) with one double- and two single-stream
    blocks, and inputs of ``tokens`` image tokens and ``text_tokens`` text tokens (bf16)."""
    config = {**config, "num_layers": 1, "num_single_layers": 2}
    torch.manual_seed(0)
    model = FluxTransformer2DModel.from_config(config).to(device=device, dtype=torch.bfloat16).eval()
    return model, flux_inputs(config, tokens, text_tokens, device, seed=2)


def under_pressure(call, device: torch.device, card: int, frees: list[float], label: str,
                   benchmark: bool) -> list[dict]:
    """``call()`` with all free, then (CUDA) with ballast leaving each of ``frees`` GiB free under the cap."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reference, seconds, peak = timed(call, device)
    rows = [{"what": label, "cudnn_benchmark": benchmark, "free_gib": None, "sha256": reference, "seconds": seconds,
             "peak_bytes": peak, "same": True}]
    for free in frees:
        torch.cuda.empty_cache()
        ballast = torch.empty(max(card - torch.cuda.memory_allocated() - int(free * GiB), 0), dtype=torch.uint8,
                              device=device)
        try:
            sha, seconds, peak = timed(call, device)
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
    parser.add_argument("--smoke", action="store_true", help="check the script on the CPU: tiny models, no pressure")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.smoke:  # the script itself, on the CPU: tiny models, no cap, no ballast (nothing to press on)
        device, spec, size, text_tokens, frees = torch.device("cpu"), FLUX_TINY, 64, 8, []
    elif not torch.cuda.is_available():
        raise SystemExit("vae-workspace-probe needs a CUDA device (it reads the CUDA allocator and cuDNN); "
                         "--smoke checks the script on the CPU")
    else:
        device, spec, size, text_tokens = torch.device("cuda", torch.cuda.current_device()), FLUX_DEV, args.size, 512
        frees = [float(f) for f in args.free_gib.split(",")]
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(args.card_gib * GiB / total, 1.0), device)
    torch.manual_seed(0)
    vae = AutoencoderKL.from_config(spec["vae"]).to(device=device, dtype=torch.bfloat16).eval()
    scale = 2 ** (len(spec["vae"]["block_out_channels"]) - 1)
    latents = torch.randn(1, spec["vae"]["latent_channels"], size // scale, size // scale,
                          generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    card = int(args.card_gib * GiB)
    rows = []
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        rows += under_pressure(lambda: vae.decode(latents, return_dict=False)[0], device, card, frees,
                               f"VAE decode {size}²", benchmark)
    torch.backends.cudnn.benchmark = False
    vae = None  # its memory goes back before the transformer slice is built
    tokens = (size // 16) ** 2
    model, inputs = flux_slice(device, tokens, spec["transformer"], text_tokens)
    rows += under_pressure(lambda: model(**inputs, return_dict=False)[0], device, card, frees,
                           f"FLUX.1 transformer slice, {tokens} tokens", False)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)",
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "card_gib": args.card_gib,
              "size": size, "smoke": args.smoke, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = ["# VAE decode under device-memory pressure", "",
             f"{report['device']}, torch {report['torch']}, cuDNN {report['cudnn']}; FLUX.1 VAE (random weights, bf16), "
             f"{size}² decode" + ("; the smoke: tiny models on the CPU, no cap and no ballast." if args.smoke else
                                   f", process capped at {args.card_gib:g} GiB by the per-process fraction; ballast "
                                   "leaves the free GiB shown under the cap."), "",
             "| what | cudnn.benchmark | free under the cap | time | peak | same bits as with all free |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        free = "all" if row["free_gib"] is None else f"{row['free_gib']:g} GiB"
        if "error" in row:
            lines.append(f"| {row['what']} | {row['cudnn_benchmark']} | {free} | out of memory | | |")
            continue
        peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / GiB:.2f} GiB"
        lines.append(f"| {row['what']} | {row['cudnn_benchmark']} | {free} | {row['seconds'] * 1e3:.1f} ms | "
                     f"{peak} | {'yes' if row['same'] else '**no**'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
