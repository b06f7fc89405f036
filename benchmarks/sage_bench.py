"""SAGE_ATTN on a GPU (written for the H200; not run yet): kernel accuracy and speed, the short-KV finding, and
end-to-end latents against TORCH_SDPA on the tiny pipelines.

1. Every shape of ``attention_bench.SHAPES`` (unmasked; SageAttention takes no mask): TFLOP/s (4·B·H·Sq·Skv·D / time)
   and relative error against the fp32 reference, for ``sageattention.sageattn`` and SDPA.
2. KV-length sweep at SDXL's cross-attention shape (B=2, H=10, Sq=4096, D=64): measured relative error next to the
   error predicted by the padded-K-block explanation in ``diffusers_omni/attention/backends/sage.py`` (zero K rows
   padding the last 64-row block count in the softmax normaliser but not in P·V). If the two track each other at
   77, 100, 141, … and vanish at multiples of 64, the explanation holds.
3. Tiny FLUX.1 and Wan pipelines (bf16) through omni attention: latents with SAGE_ATTN as the default (short-KV
   cross roles go to TORCH_SDPA) and with SAGE_ATTN on every role, against TORCH_SDPA at the same seed. A role the
   installed sageattention refuses (e.g. a tiny head_dim) is recorded with its reasons.

    python benchmarks/sage_bench.py --out benchmarks/results/sage_h200

Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_bench import SHAPES, reference, rel_err, time_ms  # noqa: E402
from diffusers_omni.attention.backends.sage import K_BLOCK  # noqa: E402

SWEEP_KV = [64, 77, 100, 128, 141, 256, 333, 512, 1000, 1024, 4096]


def tflops(b, h, sq, skv, d, ms):
    return 4 * b * h * sq * skv * d / (ms * 1e-3) / 1e12


def predicted_padding_error(q, k, v) -> float:
    """Relative error of attention whose last K block is zero-padded to ``K_BLOCK`` rows that stay in the softmax
    normaliser (score computed on mean-subtracted K, as SageAttention smooths K) but contribute nothing to P·V."""
    qf, kf, vf = (x.float().permute(0, 2, 1, 3) for x in (q, k, v))
    kf = kf - kf.mean(dim=2, keepdim=True)
    pad = (-kf.shape[2]) % K_BLOCK
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(qf.shape[-1])
    exact = scores.softmax(-1) @ vf
    if pad == 0:
        return 0.0
    m = scores.amax(-1, keepdim=True).clamp_min(0.0)
    weights = (scores - m).exp()
    denom = weights.sum(-1, keepdim=True) + pad * (-m).exp()
    wrong = (weights @ vf) / denom
    return ((wrong - exact).norm() / exact.norm()).item()


def kernel_rows(sageattn, args) -> list[dict]:
    rows = []
    for name, b, h, sq, skv, d, _category, masked in SHAPES:
        if masked:
            continue
        g = torch.Generator("cuda").manual_seed(0)
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in (sq, skv, skv))
        ref = reference(q, k, v)
        row = {"shape": name, "dims": [b, h, sq, skv, d]}
        sdpa = lambda: F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))  # noqa: E731
        sage = lambda: sageattn(q, k, v, tensor_layout="NHD")  # noqa: E731
        for label, fn, out in (("sdpa", sdpa, lambda: sdpa().transpose(1, 2)), ("sageattn", sage, sage)):
            try:
                row[f"{label}_rel_err"] = rel_err(out(), ref)
                row[f"{label}_tflops"] = tflops(b, h, sq, skv, d, time_ms(fn, args.warmup, args.repeats, args.inner))
            except Exception as exc:  # record and continue: one refused shape must not lose the others
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sweep_rows(sageattn) -> list[dict]:
    rows = []
    for skv in SWEEP_KV:
        g = torch.Generator("cuda").manual_seed(0)
        q, k, v = (torch.randn(2, n, 10, 64, device="cuda", dtype=torch.bfloat16, generator=g) for n in (4096, skv, skv))
        ref = reference(q, k, v)
        row = {"kv_len": skv, "padding_rows": (-skv) % K_BLOCK, "predicted_rel_err": predicted_padding_error(q, k, v)}
        try:
            row["sageattn_rel_err"] = rel_err(sageattn(q, k, v, tensor_layout="NHD"), ref)
        except Exception as exc:
            row["sageattn_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def pipeline_rows() -> list[dict]:
    from diffusers_omni import omnify
    from diffusers_omni.testing import tiny_flux_pipeline, tiny_wan_pipeline

    calls = {
        "FLUX.1 (tiny)": (tiny_flux_pipeline, {"prompt": "a red fox", "height": 64, "width": 64, "num_inference_steps": 2, "output_type": "latent"}),
        "Wan (tiny)": (tiny_wan_pipeline, {"prompt": "a red fox", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "output_type": "latent"}),
    }
    rows = []
    for name, (factory, call) in calls.items():
        pipe = factory()
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.to(device="cuda", dtype=torch.bfloat16)
        pipe = omnify(pipe, enable_attention=False)

        def run():
            out = pipe(**call, generator=torch.Generator("cpu").manual_seed(0))
            return (out.images if hasattr(out, "images") else out.frames).float().cpu()

        try:
            pipe.enable_omni_attention("TORCH_SDPA")
            expected = run()
        except Exception as exc:
            rows.append({"pipeline": name, "config": "TORCH_SDPA", "error": f"{type(exc).__name__}: {exc}"})
            continue
        for label, config in (("SAGE_ATTN default", "SAGE_ATTN"), ("SAGE_ATTN every role", {"default": "SAGE_ATTN", "per_role": {"cross": "SAGE_ATTN"}})):
            row = {"pipeline": name, "config": label}
            try:
                report = pipe.enable_omni_attention(config)
                out = run()
                row["roles"] = sorted({(e["role"], e["backend"], e["source"]) for e in report})
                row["latent_rel_err_vs_sdpa"] = ((out - expected).norm() / expected.norm()).item()
                row["max_abs_diff"] = (out - expected).abs().max().item()
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        pipe.disable_omni_attention()
    return rows


def to_markdown(results: dict) -> str:
    lines = [f"# SAGE_ATTN on {results['device']} (sageattention {results['sageattention']}, torch {results['torch']})", ""]
    lines += ["| Shape | SDPA TFLOP/s | sageattn TFLOP/s | sageattn rel err |", "|---|---|---|---|"]
    for r in results["kernels"]:
        lines.append(
            f"| {r['shape']} | {r.get('sdpa_tflops', float('nan')):.0f} | {r.get('sageattn_tflops', float('nan')):.0f} | "
            f"{r.get('sageattn_rel_err', r.get('sageattn_error', ''))} |"
        )
    lines += ["", "| KV len | padding rows | predicted rel err | measured rel err |", "|---|---|---|---|"]
    for r in results["kv_sweep"]:
        lines.append(f"| {r['kv_len']} | {r['padding_rows']} | {r['predicted_rel_err']:.3g} | {r.get('sageattn_rel_err', r.get('sageattn_error'))} |")
    lines += ["", "| Pipeline | Config | latent rel err vs TORCH_SDPA | note |", "|---|---|---|---|"]
    for r in results["pipelines"]:
        lines.append(f"| {r['pipeline']} | {r['config']} | {r.get('latent_rel_err_vs_sdpa', '')} | {r.get('error', '')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output prefix; writes <out>.json and <out>.md")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--inner", type=int, default=3)
    args = parser.parse_args()
    from importlib import metadata

    from sageattention import sageattn

    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sageattention": metadata.version("sageattention"),
        "kernels": kernel_rows(sageattn, args),
        "kv_sweep": sweep_rows(sageattn),
        "pipelines": pipeline_rows(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=2))
    Path(f"{out}.md").write_text(to_markdown(results))
    print(to_markdown(results))


if __name__ == "__main__":
    main()
