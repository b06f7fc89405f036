"""Quality beside speed for the lossy attention modes (FP8 ``FLASH_ATTN``, ``RAINFUSION_ATTN``) on the H200.

Two sections, one process, one GPU; everything against the exact reference ``native`` (``TORCH_SDPA``):

* **Tiny pipelines** (``compare_pipelines``): tiny-flux at 256² (4,096 image tokens) and tiny-wan at 29 frames ×
  256 × 512 (4,096 video tokens: 32 blocks of 128, the least that runs block-sparse), bf16, same seed. Their DiTs
  are the tiny ones widened to head_dim 128 (2 heads): FlashAttention-3's FP8 forward and FlashInfer's paged prefill
  take head dims of 64/128/256 only, and the stock tiny head dims (16, 12) would be refused. Random weights. Each
  candidate writes a side-by-side PNG (reference | candidate | |difference| × 10; a frame grid for the video) and
  gets PSNR, SSIM, the per-module attention error of the first transformer call and both runs' wall times (after
  one untimed warm-up run each, so kernel compilation is not in them).
* **Full-size transformers, random weights** (``compare_transformer_call``; FLUX.1-dev at 1024² = 4,608 tokens and
  Wan-14B at 480p/81 frames = 32,760 tokens, bf16, ``hopper_bench``'s models and inputs): one forward per config —
  the relative error of the whole output and of every attention module's output against the reference — and the
  median seconds per forward of each config in the same process.

Candidates: ``FLASH_ATTN`` bf16 (an exact kernel: the rounding difference between two exact kernels, for scale),
FP8 as shipped (routed per shape by the committed routing table: FLUX's calls and short ones stay bf16), FP8 on
every call (routing off: what FP8 itself costs), RainFusion at sparsity 0.5 and 0.8 on the self-attention roles
(cross-attention stays dense).

    python -m benchmarks run quality            # H200, under 6 minutes (estimated)
    python -m benchmarks run quality --smoke    # CPU: tiny sizes, exact configs

Writes ``OUT/quality.json`` and ``OUT/<pipeline>__<candidate>.png``; ``python -m benchmarks.docs_tables`` renders
the ``quality-h200`` table of ``docs/user_guide/quality.md`` from the JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform as host_platform
import re
import subprocess
import time
import traceback
from pathlib import Path

import torch

from diffusers_omni.alignment import compare_pipelines, compare_transformer_call
from diffusers_omni.attention.backends.flash import FlashAttentionBackend
from diffusers_omni.attention.platform import current_platform
from diffusers_omni.attention.registry import register_backend, reset_backend
from diffusers_omni.attention.selector import clear_resolution_cache
from diffusers_omni.installer import apply_attention, remove_attention

REFERENCE = "native"
FP8 = {"default": {"backend": "FLASH_ATTN", "quant": {"dtype_qk": "fp8_e4m3", "dtype_vo": "fp8_e4m3"}}}


def rainfusion(sparsity: float) -> dict:
    return {"per_role": {"self": {"backend": "RAINFUSION_ATTN", "block_sparse": {"sparsity": sparsity}}}}


# name → (config, FP8 on every call)
CANDIDATES = {
    "FLASH_ATTN bf16 (exact)": ({"default": {"backend": "FLASH_ATTN"}}, False),
    "FP8 (routed)": (FP8, False),
    "FP8 (every call)": (FP8, True),
    "RainFusion 0.5": (rainfusion(0.5), False),
    "RainFusion 0.8": (rainfusion(0.8), False),
}
SMOKE_CANDIDATES = {"stock (Diffusers' processors)": ("stock", False)}


class EveryCallFP8(FlashAttentionBackend):
    """``FLASH_ATTN`` whose FP8 spec runs FP8 on every unmasked call (the routing table's bf16 fallback off)."""

    def __init__(self, spec=None, kernels=None, fp8_rule=None) -> None:
        super().__init__(spec, kernels=kernels, fp8_rule=lambda q_len, kv_len, head_dim: True)


class every_call_fp8:
    """Context: ``FLASH_ATTN`` is ``EveryCallFP8`` inside (when ``on``)."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self):
        if self.on:
            register_backend("FLASH_ATTN", EveryCallFP8)
            clear_resolution_cache()

    def __exit__(self, *exc):
        if self.on:
            reset_backend("FLASH_ATTN")
            clear_resolution_cache()


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# Tiny pipelines ---------------------------------------------------------------------------------------------------

def widened(pipe, name: str, head_dim: int = 128):
    """The pipeline with its DiT rebuilt (seeded random weights) at ``head_dim`` with 2 heads."""
    transformer = pipe.transformer
    config = dict(transformer.config)
    config.update(attention_head_dim=head_dim, num_attention_heads=2)
    if name == "flux":  # the rotary axes split the head dim
        config["axes_dims_rope"] = (16, (head_dim - 16) // 2, (head_dim - 16) // 2)
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    pipe.register_modules(transformer=type(transformer).from_config(config))
    return pipe


def tiny_cases(smoke: bool) -> dict:
    from diffusers_omni import testing

    if smoke:
        flux_call = {"prompt": "a lighthouse on a cliff", "num_inference_steps": 2, "height": 32, "width": 32}
        wan_call = {"prompt": "a lighthouse on a cliff", "num_inference_steps": 2, "height": 32, "width": 32,
                    "num_frames": 5}
    else:
        flux_call = {"prompt": "a lighthouse on a cliff", "num_inference_steps": 4, "height": 256, "width": 256}
        wan_call = {"prompt": "a lighthouse on a cliff", "num_inference_steps": 3, "height": 256, "width": 512,
                    "num_frames": 29}
    return {
        "tiny-flux": ("flux", testing.tiny_flux_pipeline, flux_call),
        "tiny-wan": ("wan", testing.tiny_wan_pipeline, wan_call),
    }


def tiny_section(args, candidates: dict, out: Path, results: dict, save) -> None:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    for label, (name, build, call) in tiny_cases(args.smoke).items():
        pipe = widened(build(), name).to(args.device, dtype)
        pipe.set_progress_bar_config(disable=True)
        entry = results["tiny"].setdefault(label, {
            "call": call, "dtype": str(dtype).removeprefix("torch."),
            "transformer": f"the tiny {type(pipe.transformer).__name__} widened to 2 heads of head_dim 128, "
                           "random weights", "candidates": {}})
        for candidate, (config, every_call) in candidates.items():
            try:
                with every_call_fp8(every_call):
                    report = compare_pipelines(pipe, REFERENCE, config, seed=0, warmup_runs=0 if args.smoke else 1,
                                               **call)
                image = out / f"{slug(label)}__{slug(candidate)}.png"
                report.save_image(image)
                entry["candidates"][candidate] = {**report.to_dict(), "image": image.name}
                print(f"{label} {candidate}: PSNR {report.psnr_db:.2f} dB, SSIM {report.ssim:.4f}, attention rel "
                      f"err max {entry['candidates'][candidate]['attention']['rel_err_max']:.3g}", flush=True)
            except Exception as exc:  # a candidate that cannot run here is a result
                results["unavailable"][f"{label}: {candidate}"] = f"{type(exc).__name__}: {exc}"[:600]
                print(f"{label} {candidate}: unavailable: {exc}", flush=True)
            save()
        del pipe
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# Full-size transformers (random weights) --------------------------------------------------------------------------

def full_section(args, candidates: dict, results: dict, save) -> None:
    from benchmarks.hopper_bench import build_model, model_inputs, step_seconds

    warmup, repeats = (0, 1) if args.smoke else (1, 2)
    labels = {"flux": "FLUX.1-dev size, 1024² (4,608 tokens)", "wan": "Wan-14B size, 480p/81 frames (32,760 tokens)"}
    for name, label in labels.items():
        if args.smoke:
            label = f"{name} smoke size"
        model = build_model(name, args.device, args.smoke)
        inputs, tokens = model_inputs(name, model, args.device, args.smoke)
        entry = results["full_size"].setdefault(label, {"tokens": tokens, "random_weights": True, "dtype": "bfloat16",
                                                         "reference": REFERENCE, "step_s": {}, "candidates": {}})
        store = args.device  # the reference's per-module outputs stay on the GPU (Wan: ~27 GB), no copies
        try:
            apply_attention(model, REFERENCE)
            entry["step_s"][REFERENCE] = step_seconds(model, inputs, warmup, repeats)
        finally:
            remove_attention(model)
        print(f"{label} {REFERENCE}: {entry['step_s'][REFERENCE]:.4f} s/forward", flush=True)
        for candidate, (config, every_call) in candidates.items():
            try:
                with every_call_fp8(every_call):
                    # Errors first (no_grad), then the timing (inference_mode): kernel state made lazily on a first
                    # call (FlashInfer's shared workspace) is then an ordinary tensor, usable in both modes.
                    report = compare_transformer_call(model, inputs, REFERENCE, config, store_device=store)
                    try:
                        if config != "stock":
                            apply_attention(model, config)
                        entry["step_s"][candidate] = step_seconds(model, inputs, warmup, repeats)
                    finally:
                        remove_attention(model)
                entry["candidates"][candidate] = report.to_dict()
                step = entry["step_s"].get(candidate)
                print(f"{label} {candidate}: output rel err {report.output_rel_err:.3g}, attention rel err max "
                      f"{entry['candidates'][candidate]['attention']['rel_err_max']:.3g}"
                      + (f", {step:.4f} s/forward" if step else ""), flush=True)
            except Exception as exc:
                results["unavailable"][f"{label}: {candidate}"] = f"{type(exc).__name__}: {exc}"[:600]
                print(f"{label} {candidate}: unavailable: {exc}", flush=True)
            save()
        del model, inputs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# Report -----------------------------------------------------------------------------------------------------------

def _commit() -> str | None:
    if os.environ.get("OMNI_COMMIT"):
        return os.environ["OMNI_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict:
    found = {"python": host_platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for package in ("diffusers", "diffusers-omni", "triton", "flashinfer-python", "fa3-fwd"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def _fmt(value, spec: str = ".2e") -> str:
    if value is None:
        return "—"
    if value == float("inf"):
        return "∞"
    return format(value, spec)


def to_markdown(results: dict, image_base: str = "") -> str:
    """The tables of ``docs/user_guide/quality.md`` (``image_base``: a URL prefix for the PNG links)."""
    lines = []
    rows = []
    for label, entry in results.get("tiny", {}).items():
        for candidate, c in entry["candidates"].items():
            att = c["attention"]
            image = f"[png]({image_base}{c['image']})" if image_base else c["image"]
            rows.append([label, candidate, _fmt(c["psnr_db"], ".1f"), _fmt(c["ssim"], ".4f"),
                         f"{_fmt(att['rel_err_max'])} ({_fmt(att['rel_err_mean'])})", _fmt(att["local_rel_err_max"]),
                         f"{c['wall_s']['reference']:.2f} / {c['wall_s']['candidate']:.2f}", image])
    if rows:
        lines.append("| Tiny pipeline | Candidate vs native | PSNR dB | SSIM | attention rel err, max (mean) "
                     "| local max "
                     "| wall s native / candidate | side by side |")
        lines.append("|" + "---|" * 8)
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    rows = []
    for label, entry in results.get("full_size", {}).items():
        ref_step = entry["step_s"].get(entry["reference"])
        if ref_step is not None:
            rows.append([label, f"{entry['reference']} (reference)", f"{ref_step:.4f}", "1.00×", "0", "0", "0"])
        for candidate, c in entry["candidates"].items():
            step = entry["step_s"].get(candidate)
            speed = f"{ref_step / step:.2f}×" if step and ref_step else "—"
            att = c["attention"]
            rows.append([label, candidate, f"{step:.4f}" if step else "—", speed, _fmt(c["output_rel_err"]),
                         f"{_fmt(att['rel_err_max'])} ({_fmt(att['rel_err_mean'])})", _fmt(att["local_rel_err_max"])])
    if rows:
        lines.append("| Transformer (random weights, bf16) | Config | s / forward | speed-up (native s ÷ this s) "
                     "| output rel err | "
                     "attention rel err, max (mean) | local max |")
        lines.append("|" + "---|" * 7)
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    lines.append(f"{results.get('device', '?')}, torch {results.get('versions', {}).get('torch')}, "
                 f"{results.get('date', '?')}, commit {(results.get('commit') or '?')[:10]} "
                 "(`benchmarks/quality_bench.py`). Random weights throughout: the errors show what each mode does to "
                 "these activations, not image quality on a trained model. Attention errors: each attention "
                 "module's output in the first transformer call, ‖candidate − native‖ / ‖native‖; "
                 "\"local\": the "
                 "module's own kernel on the same inputs.")
    for where, message in results.get("unavailable", {}).items():
        lines.append(f"\n- not run: {where}: {message.splitlines()[0][:200]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder: quality.json and the side-by-side PNGs")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, exact configs only")
    parser.add_argument("--sections", default="tiny,full", help="comma-separated: tiny, full")
    args = parser.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in ("tiny", "full")]
    if unknown or not sections:
        parser.error(f"--sections={args.sections!r}: allowed: tiny, full (comma-separated)")
    args.device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("quality_bench.py needs a CUDA GPU (or --smoke)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plat = current_platform()
    results = {"script": "benchmarks/quality_bench.py", "date": time.strftime("%Y-%m-%d"), "commit": _commit(),
               "device": plat.device_name, "platform": plat.to_dict(), "versions": versions(), "smoke": args.smoke,
               "reference": f"{REFERENCE} (TORCH_SDPA)", "tiny": {}, "full_size": {}, "unavailable": {},
               "errors": {}, "elapsed_s": {}}
    candidates = SMOKE_CANDIDATES if args.smoke else CANDIDATES

    def save():
        (out / "quality.json").write_text(json.dumps(results, indent=2, default=str) + "\n")

    started = time.perf_counter()
    for section, run in (("tiny", lambda: tiny_section(args, candidates, out, results, save)),
                         ("full", lambda: full_section(args, candidates, results, save))):
        if section not in sections:
            continue
        section_start = time.perf_counter()
        try:
            run()
        except Exception:
            results["errors"][section] = traceback.format_exc()[-3000:]
            print(results["errors"][section], flush=True)
        results["elapsed_s"][section] = time.perf_counter() - section_start
        save()
    results["elapsed_s"]["total"] = time.perf_counter() - started
    save()
    print(to_markdown(results))


if __name__ == "__main__":
    main()
