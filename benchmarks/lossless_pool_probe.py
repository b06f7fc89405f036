"""Where the lossless code's device buffers come from, and what the caching allocator then holds (#37, #40).

A FLUX.1-dev-width transformer slice (``--double`` + ``--single`` blocks, bf16, random weights) streamed by layerwise
offload with no budget, plain and ``compression="lossless"``; lossless three times in the same run: the code's
upload (``stores.lossless.CodeRing``: one code buffer per window block, made once and reused in turn), the ring with
one buffer more (as the probe first measured it) and the upload it replaced (a fresh device buffer per load, made
by the copy on the copy stream; an H100 run of the full FLUX.1-dev pipeline held several times as much reserved as
allocated with it, which auto's per-shape measurement reads as activations). Per run: the median step,
``max_memory_allocated`` and ``max_memory_reserved`` over the timed forwards, its ratio to the resident step, and
whether the output is bitwise the resident one. Last, lossless under a budget every block fits in (nothing streams:
#37 asks for the step within 3 % of resident).

    python -m benchmarks run lossless-pool-probe          # --smoke: the tiny transformer on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxTransformer2DModel

from benchmarks.common import flux_inputs, random_parameters_on
from benchmarks.pipeline_offload_bench import FLUX_DEV, FLUX_TINY
from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.offload.stores import lossless

GiB = 1 << 30
NOW = lossless.upload_and_decode


def fresh_buffer_upload(block: Any, flat: torch.Tensor, buffers: dict[torch.dtype, torch.Tensor], transfers: Any,
                        wait_for: Any, done: Any, ring: Any = None) -> None:
    """Before (up to commit 5017140): a fresh device buffer per load, made by the copy on the copy stream and freed
    after the decode (on the CPU: the code's upload, which decodes from the host buffer)."""
    device = next(iter(buffers.values())).device
    if device.type == "cpu":
        return NOW(block, flat, buffers, transfers, wait_for, done, ring)
    staged, copied = [], transfers.new_event()

    def copy() -> None:
        staged.append(flat.to(device, non_blocking=True))

    def decode() -> None:
        buffer = staged.pop()
        buffer.record_stream(torch.get_device_module(device).current_stream(device))  # freed after the decode
        block.decode_into(buffer, buffers)

    transfers.run(copy, done=copied)
    transfers.run_decode(decode, wait_for=(copied, wait_for), done=done)


def build(config: dict[str, Any], double: int, single: int) -> FluxTransformer2DModel:
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config({**config, "num_layers": double, "num_single_layers": single})
    return random_parameters_on(model, "cpu", torch.bfloat16).eval()


def forward(model: FluxTransformer2DModel, batch: dict[str, Any]) -> torch.Tensor:
    with torch.inference_mode():
        return model(**batch, return_dict=False)[0]


def measure(model: FluxTransformer2DModel, batch: dict[str, Any], device: torch.device, repeats: int
            ) -> tuple[torch.Tensor, list[float], int | None, int | None]:
    cuda = device.type == "cuda"
    output = forward(model, batch)  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    steps = []
    for _ in range(repeats):
        start = time.perf_counter()
        output = forward(model, batch)
        if cuda:
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - start)
    peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if cuda else (None, None)
    return output, steps, *peaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--double", type=int, default=4)
    parser.add_argument("--single", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.smoke:
        device, config, tokens, text = torch.device("cpu"), FLUX_TINY["transformer"], 16, 8
    elif not torch.cuda.is_available():
        raise SystemExit("lossless-pool-probe needs a CUDA device; --smoke checks the script on the CPU")
    else:
        device, config, tokens, text = torch.device("cuda", torch.cuda.current_device()), FLUX_DEV["transformer"], \
            args.tokens, 512
    start = time.perf_counter()
    model = build(config, args.double, args.single)
    batch = flux_inputs(config, tokens, text, device, seed=1)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)",
                              "torch": torch.__version__, "double": args.double, "single": args.single,
                              "tokens": tokens, "repeats": args.repeats, "smoke": args.smoke,
                              "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                              "build_s": time.perf_counter() - start, "runs": []}
    model.to(device)
    reference, steps, allocated, reserved = measure(model, batch, device, args.repeats)
    report["runs"].append({"run": "resident", "step_s": statistics.median(steps), "allocated": allocated,
                           "reserved": reserved, "bitwise": True})
    model.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    current, buffers = lossless.upload_and_decode, lossless.ring_buffers
    everything = 2 * report["weights_bytes"]  # a budget every block fits in: nothing streams
    for name, compression, upload, count, budget in (
            ("layerwise", None, current, buffers, "none"),
            ("lossless (the code: a ring of one code buffer per window block, made once)", "lossless", current,
             buffers, "none"),
            ("lossless (a ring of window + 1 buffers, as first measured)", "lossless", current,
             lambda window: window + 1, "none"),
            ("lossless (before: a fresh code buffer per load)", "lossless", fresh_buffer_upload, buffers, "none"),
            ("lossless, every block resident (a budget above the weights: #37's within 3 % of resident)",
             "lossless", current, buffers, everything)):
        lossless.upload_and_decode, lossless.ring_buffers = upload, count
        try:
            enable = time.perf_counter()
            backend = apply_offload(model, OffloadConfig("layerwise", device=str(device), max_device_memory=budget,
                                                         compression=compression))
            enable = time.perf_counter() - enable
            try:
                output, steps, allocated, reserved = measure(model, batch, device, args.repeats)
                streamed = backend.stats.streamed_blocks
                ring = backend.stats.code_buffer_bytes
            finally:
                backend.disable()
        finally:
            lossless.upload_and_decode, lossless.ring_buffers = current, buffers
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row = {"run": name, "step_s": statistics.median(steps), "allocated": allocated, "reserved": reserved,
               "bitwise": bool(torch.equal(output.cpu(), reference.cpu())), "enable_s": enable,
               "of_resident": statistics.median(steps) / report["runs"][0]["step_s"], "streamed_blocks": streamed,
               "code_buffer_bytes": ring}
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    lines = ["# The lossless code's device buffers and the caching allocator", "",
             f"{report['device']}, torch {report['torch']}; a FLUX.1-dev-width transformer of {args.double} + "
             f"{args.single} blocks ({report['weights_bytes'] / GiB:.2f} GiB bf16, random weights), {tokens} image "
             f"tokens; layerwise offload with no budget; median of {args.repeats} forwards after one warm-up.", "",
             "| run | step | ÷ resident | max allocated | max reserved | code ring | bitwise as resident |",
             "|---|---|---|---|---|---|---|"]
    for row in report["runs"]:
        gib = (lambda n: "" if n is None else f"{n / GiB:.2f} GiB")
        lines.append(f"| {row['run']} | {row['step_s']:.3f} s | {row.get('of_resident', 1.0):.3f} | "
                     f"{gib(row['allocated'])} | {gib(row['reserved'])} | {gib(row.get('code_buffer_bytes'))} | "
                     f"{'yes' if row['bitwise'] else '**NO**'} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["bitwise"] for r in report["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
