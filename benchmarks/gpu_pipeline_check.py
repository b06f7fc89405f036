"""Tiny FLUX.1 pipeline on a GPU through omni attention: platform default and a per-role CUDNN_ATTN override.

Checks that the report shows each role's backend and source, and compares latents with stock Diffusers at the
same seed (bf16). Writes JSON to --out.

    python -m benchmarks run gpu-pipeline-check
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


from diffusers_omni import omnify
from diffusers_omni.testing import tiny_flux_pipeline

CALL = {"prompt": "a red fox", "height": 64, "width": 64, "num_inference_steps": 2, "output_type": "latent"}


def latents(pipe) -> torch.Tensor:
    return pipe(**CALL, generator=torch.Generator("cpu").manual_seed(0)).images.float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    stock = tiny_flux_pipeline()
    for component in stock.components.values():
        if isinstance(component, torch.nn.Module):
            component.to(device="cuda", dtype=torch.bfloat16)
    expected = latents(stock)
    results = {"transformer_dtype": str(stock.transformer.dtype), "device": torch.cuda.get_device_name()}
    configs = {
        "platform default": None,
        "CUDNN_ATTN on flux.single": {"per_role": {"flux.single": {"backend": "CUDNN_ATTN"}}},
        "TORCH_SDPA everywhere": "TORCH_SDPA",
    }
    pipe = omnify(stock, enable_attention=False)
    for label, config in configs.items():
        report = pipe.enable_omni_attention(config)
        out = latents(pipe)
        results[label] = {
            "roles": sorted({(e["role"], e["backend"], e["source"]) for e in report}),
            "bitwise_equal_to_stock": bool(torch.equal(out, expected)),
            "max_abs_diff": (out - expected).abs().max().item(),
        }
        print(label, json.dumps(results[label]), flush=True)
    pipe.disable_omni_attention()
    results["after disable, bitwise equal to stock"] = bool(torch.equal(latents(pipe), expected))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
