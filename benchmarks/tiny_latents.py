"""Latent error of the lossy Hopper modes on the tiny pipelines (CPU, bf16), against TORCH_SDPA at the same seed.

The GPU kernels cannot run here, so each mode runs through the reference implementation the tests hold the kernels
to (and that ``hopper_bench.py`` compares them with on the H200):

* FP8: ``fp8_quant.quantize_qkv_reference`` (bit-identical to the Triton kernels) then ``fa3_fp8_emulation``: the
  kernel's arithmetic, FA3's e4m3 rounding of the softmax probabilities included. Every call runs FP8 (no routing).
* RAINFUSION_ATTN: the CUDA path's selection and page tables through ``block_sparse.ReferencePagedPrefill``.
  Tiny Wan at 29 frames × 256 × 512 (4,096 self-attention tokens: 32 blocks, the minimum that runs sparse).

    python -m benchmarks run tiny-latents
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from diffusers_omni.attention.backends.rainfusion import block_sparse as bs
from diffusers_omni.attention.backends.flash import fp8_quant as fq
from diffusers_omni.attention.backends.flash import FlashAttentionBackend, FlashKernels
from diffusers_omni.attention.backends.rainfusion import RainFusionBackend
from diffusers_omni.attention.registry import register_backend, reset_backend

FP8 = {"default": {"backend": "FLASH_ATTN", "quant": {"dtype_qk": "fp8_e4m3", "dtype_vo": "fp8_e4m3"}}}


def fa3_reference(q, k, v, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None, **_):
    if q.dtype == fq.fp8_dtype():
        quant = fq.QuantizedQKV(q, k, v, q_descale, k_descale, v_descale, None)
        return fq.fa3_fp8_emulation(quant, softmax_scale).to(torch.bfloat16)
    return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=softmax_scale).transpose(1, 2)


class ReferenceFP8(FlashAttentionBackend):
    devices = frozenset({"cpu"})

    def __init__(self, spec=None):
        super().__init__(spec, kernels=FlashKernels(fa3_reference, None, "FA3-fwd"))

    def fp8_route(self, q_len, kv_len, head_dim):
        return True

    def _run_fp8(self, query, key, value, scale):
        return fq.fp8_attention(self.kernels.func, query, key, value, scale, quantize=fq.quantize_qkv_reference)


class ReferenceRainFusion(RainFusionBackend):
    devices = frozenset({"cpu"})
    dtypes = None

    def __init__(self, spec=None):
        super().__init__(spec, runner=bs.BlockSparseRunner(lambda device: bs.ReferencePagedPrefill()))

    @classmethod
    def extra_availability_reasons(cls, platform):
        return []


def latents(pipe, config, call: dict) -> torch.Tensor:
    from diffusers_omni.installer import apply_attention

    apply_attention(pipe.transformer, config or "TORCH_SDPA")
    out = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent")
    frames = getattr(out, "frames", None)
    return (frames if frames is not None else out.images).float()


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    mse = (a - b).double().square().mean().item()
    value_range = (a.max() - a.min()).item()
    return {"rel_err": ((b - a).double().norm() / a.double().norm()).item(),
            "psnr_db": math.inf if mse == 0 else 10 * math.log10(value_range**2 / mse)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from diffusers_omni import testing

    register_backend("FLASH_ATTN", ReferenceFP8)
    register_backend("RAINFUSION_ATTN", ReferenceRainFusion)
    results = {"device": "CPU", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "script": "benchmarks/tiny_latents.py", "dtype": "bfloat16", "pipelines": {}}
    try:
        cases = {
            "tiny-flux (64×64, 4 steps)": (testing.tiny_flux_pipeline(),
                                          {"prompt": "a lighthouse", "num_inference_steps": 4, "height": 64,
                                           "width": 64}, {"FP8 (FLASH_ATTN quant)": FP8}),
            "tiny-wan (29 frames, 256×512, 3 steps)": (
                testing.tiny_wan_pipeline(),
                {"prompt": "a lighthouse", "num_inference_steps": 3, "height": 256, "width": 512, "num_frames": 29},
                {"FP8 (FLASH_ATTN quant)": FP8, **{
                    f"RAINFUSION_ATTN sparsity {s}": {"per_role": {"wan.self": {
                        "backend": "RAINFUSION_ATTN", "block_sparse": {"sparsity": s}}}} for s in (0.5, 0.8)},
                 **{f"RAINFUSION_ATTN mass threshold {t}": {"per_role": {"wan.self": {
                     "backend": "RAINFUSION_ATTN", "block_sparse": {"mass_threshold": t}}}} for t in (0.9, 0.5)}}),
        }
        for name, (pipe, call, modes) in cases.items():
            pipe.to(torch.bfloat16)
            reference = latents(pipe, None, call)
            rows = {}
            for mode, config in modes.items():
                rows[mode] = compare(reference, latents(pipe, config, call))
                print(f"{name} {mode}: {rows[mode]}", flush=True)
            results["pipelines"][name] = {"latent_shape": list(reference.shape), "reference": "TORCH_SDPA",
                                          "modes": rows}
    finally:
        reset_backend("FLASH_ATTN")
        reset_backend("RAINFUSION_ATTN")
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
