"""Training/rollout alignment on a CUDA GPU (written for the H200; not run on CPU CI).

For every dense backend that can run here (TORCH_SDPA, CUDNN_ATTN, FLASH_ATTN when our backend runs an
implementation), at DiT attention shapes, in bf16:

1. gradients of Q, K, V against an fp32 reference (math SDPA on fp32 copies): max abs and relative error;
2. determinism run to run: the forward output and the Q/K/V gradients of N repeated runs on the same inputs,
   bitwise, with the deterministic switch off and on (on = ``enable_deterministic()`` plus
   ``torch.use_deterministic_algorithms(True)``, the documented requirement for deterministic backwards);
3. training-mode forward (inputs requiring grad, autograd on) == inference forward (``torch.no_grad``), bitwise;
4. the tiny FLUX.1 transformer on the GPU: ``check_alignment`` training vs inference and deterministic run to run
   per backend, and the kernel fingerprint.

A backend refused in deterministic mode (CUDNN_ATTN) is recorded with its reasons. Writes ``<out>.json`` and
``<out>.md``:

    PYTHONPATH=/path/to/diffusers python -m benchmarks run alignment
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # must precede the first cuBLAS call

import torch
import torch.nn.functional as F


from diffusers_omni.attention.platform import current_platform
from diffusers_omni.attention.registry import get_backend_class

# (label, batch, heads, q_len, kv_len, head_dim, masked)
SHAPES = [
    ("FLUX 1024² self", 1, 24, 4608, 4608, 128, False),
    ("Wan 480p self (8k crop)", 1, 40, 8192, 8192, 128, False),
    ("Wan cross 512 text", 1, 40, 8192, 512, 128, False),
    ("SDXL self hd64", 2, 10, 4096, 4096, 64, False),
    ("masked joint (text padding)", 1, 24, 4608, 4608, 128, True),
]
REPEATS = 5


def candidate_backends() -> list[str]:
    names = ["TORCH_SDPA", "CUDNN_ATTN", "FLASH_ATTN"]
    platform = current_platform()
    return [n for n in names if not get_backend_class(n).availability_reasons(platform)]


def make_inputs(batch, heads, q_len, kv_len, head_dim, masked, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(batch, q_len, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, kv_len, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, kv_len, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    grad = torch.randn(batch, q_len, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = None
    if masked:
        mask = torch.ones(batch, kv_len, dtype=torch.bool, device="cuda")
        mask[:, kv_len - kv_len // 8 :] = False
    return q, k, v, grad, mask


def reference(q, k, v, grad, mask):
    """fp32 math SDPA: output and Q/K/V gradients."""
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    attn_mask = mask[:, None, None, :] if mask is not None else None
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), attn_mask=attn_mask).transpose(1, 2)
    out.backward(grad.float())
    return out.detach(), [x.grad for x in leaves]


def run_backend(backend, q, k, v, grad, mask, training=True):
    if not training:
        with torch.no_grad():
            return backend(q, k, v, mask), None
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = backend(*leaves, mask)
    out.backward(grad)
    return out.detach(), [x.grad for x in leaves]


def errors(x, ref):
    diff = (x.float() - ref).abs().max().item()
    return {"max_abs": diff, "max_rel": diff / max(ref.abs().max().item(), 1e-30)}


def check_kernel(name, deterministic, shape):
    label, b, h, sq, skv, d, masked = shape
    cls = get_backend_class(name)
    platform = current_platform()
    row = {"backend": name, "deterministic_mode": deterministic, "shape": label}
    if deterministic and cls.determinism_reasons(platform):
        row["refused"] = cls.determinism_reasons(platform)
        return row
    backend = cls()
    if deterministic:
        backend.enable_deterministic()
    q, k, v, grad, mask = make_inputs(b, h, sq, skv, d, masked)
    if mask is not None and not cls.supports_mask:
        row["refused"] = [f"{name} accepts no mask"]
        return row
    ref_out, ref_grads = reference(q, k, v, grad, mask)
    outs, grads = [], []
    for _ in range(REPEATS):
        out, g = run_backend(backend, q, k, v, grad, mask)
        outs.append(out)
        grads.append(g)
    infer, _ = run_backend(backend, q, k, v, grad, mask, training=False)
    torch.cuda.synchronize()
    row.update(
        forward_vs_fp32=errors(outs[0], ref_out),
        grad_vs_fp32={n: errors(g, r) for n, g, r in zip("qkv", grads[0], ref_grads)},
        forward_run_to_run_bitwise=all(torch.equal(outs[0], o) for o in outs[1:]),
        grads_run_to_run_bitwise=all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g)),
        training_forward_equals_inference=bool(torch.equal(outs[0], infer)),
        training_vs_inference_max_abs=(outs[0].float() - infer.float()).abs().max().item(),
    )
    return row


def tiny_flux_setup():
    from diffusers_omni.alignment import record_transformer_inputs
    from diffusers_omni.testing import tiny_flux_pipeline

    pipe = tiny_flux_pipeline().to("cuda", torch.bfloat16)
    inputs = record_transformer_inputs(
        pipe, prompt="a red fox", height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(0)
    )
    return pipe, inputs


def tiny_flux_checks(pipe, inputs, names, deterministic):
    from diffusers_omni.alignment import AlignmentSide, check_alignment, kernel_fingerprint

    rows = []
    for name in names:
        config = {"default": name, "deterministic": deterministic}
        row = {"backend": name, "deterministic_mode": deterministic}
        try:
            train = check_alignment(pipe.transformer, inputs, AlignmentSide(config, mode="training"), AlignmentSide(config))
            repeat = check_alignment(pipe.transformer, inputs, config, config)
            stock = check_alignment(pipe.transformer, inputs, config, "stock")
            pipe.transformer.zero_grad(set_to_none=True)
            row.update(
                training_equals_inference=train.bitwise_equal,
                training_first_divergence=train.first_divergence,
                run_to_run_bitwise=repeat.bitwise_equal,
                vs_stock_bitwise=stock.bitwise_equal,
                vs_stock_max_abs=max(r.max_abs for r in stock.layers),
                fingerprint=kernel_fingerprint_for(pipe, config, kernel_fingerprint),
            )
        except Exception as exc:  # a refused backend is a result, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        rows.append(row)
    return rows


def kernel_fingerprint_for(pipe, config, kernel_fingerprint):
    from diffusers_omni import apply_attention, remove_attention

    apply_attention(pipe.transformer, config)
    try:
        return kernel_fingerprint(pipe.transformer)
    finally:
        remove_attention(pipe.transformer)


def markdown(result) -> str:
    lines = [
        f"# Alignment on {result['device']} (torch {result['torch']}, CUDA {result['cuda']}, cuDNN {result['cudnn']})",
        "",
        "Kernel checks, bf16, gradients against an fp32 math reference; run to run over "
        f"{REPEATS} repeats; deterministic mode = backend deterministic pin + torch.use_deterministic_algorithms(True).",
        "",
        "| backend | det. mode | shape | fwd rel err | max grad rel err | fwd run-to-run | grads run-to-run | train fwd == infer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["kernels"]:
        if "refused" in r or "error" in r:
            why = "; ".join(r.get("refused", [r.get("error", "")]))
            lines.append(f"| {r['backend']} | {r['deterministic_mode']} | {r['shape']} | refused: {why} | | | | |")
            continue
        grad_rel = max(e["max_rel"] for e in r["grad_vs_fp32"].values())
        lines.append(
            f"| {r['backend']} | {r['deterministic_mode']} | {r['shape']} | {r['forward_vs_fp32']['max_rel']:.2e} | "
            f"{grad_rel:.2e} | {r['forward_run_to_run_bitwise']} | {r['grads_run_to_run_bitwise']} | "
            f"{r['training_forward_equals_inference']} |"
        )
    lines += ["", "Tiny FLUX.1 transformer (bf16) through check_alignment:", "",
              "| backend | det. mode | train == infer | run to run | == stock | max abs vs stock |", "|---|---|---|---|---|---|"]
    for r in result["tiny_flux"]:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['deterministic_mode']} | error: {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['backend']} | {r['deterministic_mode']} | {r['training_equals_inference']} | {r['run_to_run_bitwise']} | "
            f"{r['vs_stock_bitwise']} | {r['vs_stock_max_abs']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="output prefix; writes <out>.json and <out>.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("alignment_gpu.py needs a CUDA GPU")
    names = candidate_backends()
    result = {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "backends": names,
        "kernels": [],
        "tiny_flux": [],
    }
    started = time.perf_counter()
    pipe, inputs = tiny_flux_setup()
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic)
        for name in names:
            for shape in SHAPES:
                try:
                    row = check_kernel(name, deterministic, shape)
                except Exception as exc:
                    row = {"backend": name, "deterministic_mode": deterministic, "shape": shape[0],
                           "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "trace": traceback.format_exc(limit=3)}
                result["kernels"].append(row)
                print(json.dumps(row, default=str), flush=True)
                torch.cuda.empty_cache()
        result["tiny_flux"] += tiny_flux_checks(pipe, inputs, names, deterministic)
    torch.use_deterministic_algorithms(False)
    result["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
