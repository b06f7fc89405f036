"""SAGE_ATTN on a GPU: kernel accuracy and speed, the short-KV finding, tiny-pipeline latents vs TORCH_SDPA.

Written for and run on an NVIDIA H200 (``benchmarks/results/sage/latest.{json,md}``).

1. Every shape of ``attention_bench.SHAPES`` (unmasked; SageAttention takes no mask): TFLOP/s (4·B·H·Sq·Skv·D / time)
   and relative error against the fp32 reference, for ``sageattention.sageattn`` and SDPA.
2. KV-length sweep at SDXL's cross-attention shape (B=2, H=10, Sq=4096, D=64): measured relative error next to the
   error predicted by the padded-K-block explanation in ``diffusers_omni/attention/backends/sage/backend.py`` (zero K rows
   padding the last 64-row block count in the softmax normaliser but not in P·V). If the two track each other at
   77, 100, 141, … and vanish at multiples of 64, the explanation holds.
3. Tiny FLUX.1 and Wan pipelines (bf16) through omni attention: latents with SAGE_ATTN as the default (short-KV
   cross roles go to TORCH_SDPA) and with SAGE_ATTN on every role, against TORCH_SDPA at the same seed. The tiny
   pipelines of ``diffusers_omni.testing`` have head_dim 16 (FLUX) and 12 (Wan), which sageattention 1.x refuses
   (it takes 64, 96, 128), so this part rebuilds their transformers from the same configs with head_dim 64 (two
   layers of each kind; FLUX RoPE axes 8+28+28 = 64) and sizes the calls so that every KV is a multiple of
   SageAttention's 64-row K block (FLUX 512 text + 256 image tokens; Wan 128 video tokens, 512 text tokens).
   Each row counts the SageAttention kernel calls by KV length, so it shows which roles really ran on it. A role
   the installed sageattention refuses is recorded with its reasons.

    python -m benchmarks run sage
    # part 3 only, keeping parts 1-2 of an earlier run in the written files:
    python -m benchmarks.sage_bench --only pipelines --reuse benchmarks/results/sage/latest.json --out <out>
    # CPU dry run of part 3 (no SageAttention): the head_dim-64 pipelines build and run on TORCH_SDPA; then, on a
    # simulated Hopper sm_90 with sageattention 1.0.6 reported installed and a FAKE exact kernel (SDPA) at the
    # kernel boundary, SAGE_ATTN is accepted for every role and the short-KV guard routes as on the GPU
    python -m benchmarks.sage_bench --only pipelines --device cpu --out /tmp/sage_cpu_dry

Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import types
from pathlib import Path

import torch
import torch.nn.functional as F


from benchmarks import results_io
from benchmarks.attention_bench import SHAPES
from benchmarks.common import reference, rel_err, time_ms
from diffusers_omni.attention.backends.sage import K_BLOCK, configured_as_default

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
                row[f"{label}_tflops"] = tflops(b, h, sq, skv, d, time_ms(fn, args.repeats, args.inner, warmup=args.warmup))
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


HEAD_DIM = 64
PIPELINE_CONFIGS = (
    ("SAGE_ATTN default", "SAGE_ATTN"),
    ("SAGE_ATTN every role", {"default": "SAGE_ATTN", "per_role": {"cross": "SAGE_ATTN"}}),
)
SIMULATED_PLATFORM = ("cuda", "NVIDIA H200", (9, 0), 91900)
SIMULATED_SAGE_VERSION = "1.0.6"
SIMULATED_LABEL = f" [simulated sm_90, sageattention {SIMULATED_SAGE_VERSION} reported installed, FAKE exact kernel]"


def _rebuild_transformer(model: torch.nn.Module, seed: int, **overrides) -> torch.nn.Module:
    """``model``'s class built from its config with ``overrides``, seeded like the tiny builders (forked RNG)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rebuilt = type(model).from_config(model.config, **overrides)
    return rebuilt.eval()


def tiny_head_dim_64_pipelines(seed: int = 0) -> dict:
    """``{name: (pipeline, call kwargs)}``: the tiny FLUX.1 and Wan T2V pipelines of ``diffusers_omni.testing`` with
    their transformers rebuilt at head_dim 64 (text encoders, tokenizers, VAE and scheduler unchanged)."""
    from diffusers_omni.testing import tiny_flux_components, tiny_wan_components

    flux = tiny_flux_components(seed)
    flux["transformer"] = _rebuild_transformer(
        flux["transformer"],
        seed,
        num_layers=2,
        num_single_layers=2,
        num_attention_heads=2,
        attention_head_dim=HEAD_DIM,
        axes_dims_rope=(8, 28, 28),  # FLUX RoPE: the axes must sum to head_dim
    )
    wan = tiny_wan_components(seed)
    wan["transformer"] = _rebuild_transformer(
        wan["transformer"], seed, num_layers=2, num_attention_heads=2, attention_head_dim=HEAD_DIM, ffn_dim=256
    )
    from diffusers import FluxPipeline, WanPipeline

    return {
        # 64×64 → 16×16 packed latent = 256 image tokens; joint KV 512 + 256 = 768 (a multiple of 64)
        "FLUX.1 (tiny, head_dim 64)": (
            FluxPipeline(**flux),
            {"prompt": "a red fox", "height": 64, "width": 64, "num_inference_steps": 2, "max_sequence_length": 512,
             "output_type": "latent"},
        ),
        # 128×128, 5 frames → 2 latent frames × 8×8 patches = 128 video tokens; text cross KV 512
        "Wan (tiny, head_dim 64)": (
            WanPipeline(**wan),
            {"prompt": "a red fox", "height": 128, "width": 128, "num_frames": 5, "num_inference_steps": 2,
             "max_sequence_length": 512, "output_type": "latent"},
        ),
    }


@contextlib.contextmanager
def _counting_sage_kernel(counts: dict, fake: bool):
    """Count ``sageattn`` calls by KV length at omni's kernel boundary. ``fake=True`` puts a FAKE exact kernel
    (SDPA, not SageAttention) there and reports sageattention 1.0.6 as installed (CPU dry run only)."""
    from diffusers_omni.attention.backends import base
    from diffusers_omni.attention.backends.sage import backend as sage

    saved = sage._import_sageattention, sage.installed_version, base.package_importable
    real = None if fake else saved[0]()

    def sageattn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=None, smooth_k=True):
        counts[k.shape[1]] = counts.get(k.shape[1], 0) + 1
        if real is not None:
            return real.sageattn(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal, sm_scale=sm_scale,
                                 smooth_k=smooth_k)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=is_causal, scale=sm_scale).transpose(1, 2)

    sage._import_sageattention = lambda: types.SimpleNamespace(sageattn=sageattn)
    if fake:
        sage.installed_version = lambda *dists: SIMULATED_SAGE_VERSION if "sageattention" in dists else saved[1](*dists)
        base.package_importable = lambda name: name == "sageattention" or saved[2](name)
    try:
        yield counts
    finally:
        sage._import_sageattention, sage.installed_version, base.package_importable = saved


def simulated_control_rows() -> list[dict]:
    """CPU dry run only: the unmodified tiny transformers of ``diffusers_omni.testing`` (head_dim 16 and 12) must be
    refused under the same simulation, which shows the simulated sageattention 1.0.6 head_dim rule is in force."""
    from diffusers_omni.attention.plan import AttentionPlan
    from diffusers_omni.installer import plan_attention
    from diffusers_omni.attention.platform import Platform
    from diffusers_omni.attention.selector import clear_resolution_cache
    from diffusers_omni.testing import tiny_flux_components, tiny_wan_components

    rows = []
    controls = (("FLUX.1 (tiny, testing default)", tiny_flux_components), ("Wan (tiny, testing default)", tiny_wan_components))
    for name, factory in controls:
        transformer = factory(0)["transformer"].to(torch.bfloat16)
        head_dim = transformer.config.attention_head_dim
        row = {"pipeline": name, "config": "SAGE_ATTN default" + SIMULATED_LABEL, "head_dim": head_dim}
        clear_resolution_cache()
        with _counting_sage_kernel({}, fake=True):
            try:
                plan_attention(transformer, AttentionPlan.build("SAGE_ATTN", Platform(*SIMULATED_PLATFORM)))
                row["error"] = "unexpectedly accepted"
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc} (expected: the control)"
        clear_resolution_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def pipeline_rows(device: str = "cuda") -> list[dict]:
    """Part 3. On ``device="cpu"`` (dry run) the SAGE_ATTN rows run on a simulated Hopper with a FAKE exact kernel:
    they check the wiring (SAGE_ATTN accepted at head_dim 64, which calls reach the kernel), not SageAttention."""
    from diffusers_omni import omnify
    from diffusers_omni.attention.platform import Platform, use_platform
    from diffusers_omni.attention.selector import clear_resolution_cache

    simulate = device != "cuda"
    rows = []
    for name, (pipe, call) in tiny_head_dim_64_pipelines().items():
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.to(device=device, dtype=torch.bfloat16).eval()
        pipe = omnify(pipe, enable_attention=False)
        modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
        assert not any(m.training for c in modules for m in c.modules())
        head_dim = pipe.transformer.config.attention_head_dim

        def run():
            out = pipe(**call, generator=torch.Generator("cpu").manual_seed(0))
            return (out.images if hasattr(out, "images") else out.frames).float().cpu()

        try:
            pipe.enable_omni_attention("TORCH_SDPA")
            expected = run()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            rows.append({"pipeline": name, "config": "TORCH_SDPA", "head_dim": head_dim, "error": error})
            print(json.dumps(rows[-1]), flush=True)
            continue
        if simulate:
            rows.append({
                "pipeline": name, "config": f"TORCH_SDPA ({device} dry run)", "head_dim": head_dim,
                "latent_shape": list(expected.shape), "latent_finite": bool(expected.isfinite().all()),
            })
            print(json.dumps(rows[-1]), flush=True)
        for label, config in PIPELINE_CONFIGS:
            if simulate:
                label += SIMULATED_LABEL
            row = {"pipeline": name, "config": label, "head_dim": head_dim, "simulated": simulate}
            counts: dict[int, int] = {}
            try:
                clear_resolution_cache()
                where = use_platform(Platform(*SIMULATED_PLATFORM)) if simulate else contextlib.nullcontext()
                with where, _counting_sage_kernel(counts, fake=simulate):
                    report = pipe.enable_omni_attention(config)
                    out = run()
                row["roles"] = sorted({(e["role"], e["backend"], e["source"]) for e in report})
                row["short_kv_guarded_roles"] = sorted({
                    e["role"] for e in report
                    if e["backend"] == "SAGE_ATTN" and e["category"] == "cross" and configured_as_default(e["source"])
                })
                row["sage_kernel_calls_by_kv_len"] = dict(sorted(counts.items()))
                row["latent_rel_err_vs_sdpa"] = ((out - expected).norm() / expected.norm()).item()
                row["max_abs_diff"] = (out - expected).abs().max().item()
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                clear_resolution_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
        pipe.disable_omni_attention()
    return rows + (simulated_control_rows() if simulate else [])


def _cell(value) -> str:
    return str(value).replace("\n", " ").replace("|", "/")


def _pipeline_note(r: dict) -> str:
    if "error" in r:
        return _cell(r["error"])
    parts = []
    if "latent_shape" in r:
        parts.append(f"latent {r['latent_shape']}, finite: {r['latent_finite']}")
    if "sage_kernel_calls_by_kv_len" in r:
        calls = r["sage_kernel_calls_by_kv_len"]
        parts.append("sageattn calls by KV len: " + (", ".join(f"{kv}: {n}" for kv, n in calls.items()) or "none"))
        if r.get("short_kv_guarded_roles"):
            roles = ", ".join(r["short_kv_guarded_roles"])
            parts.append(f"short-KV guard (KV < 1024 or not a multiple of 64 → TORCH_SDPA) on {roles}")
    return "; ".join(parts)


def to_markdown(results: dict) -> str:
    lines = [f"# SAGE_ATTN on {results['device']} (sageattention {results['sageattention']}, torch {results['torch']})", ""]
    for section, source in results.get("reused", {}).items():
        lines += [f"Section `{section}` reused from `{source['path']}` ({source['device']}, torch {source['torch']}).", ""]
    lines += ["| Shape | SDPA TFLOP/s | sageattn TFLOP/s | sageattn rel err |", "|---|---|---|---|"]
    for r in results["kernels"]:
        lines.append(
            f"| {r['shape']} | {r.get('sdpa_tflops', float('nan')):.0f} | {r.get('sageattn_tflops', float('nan')):.0f} | "
            f"{_cell(r.get('sageattn_rel_err', r.get('sageattn_error', '')))} |"
        )
    lines += ["", "| KV len | padding rows | predicted rel err | measured rel err |", "|---|---|---|---|"]
    for r in results["kv_sweep"]:
        lines.append(
            f"| {r['kv_len']} | {r['padding_rows']} | {r['predicted_rel_err']:.3g} | "
            f"{_cell(r.get('sageattn_rel_err', r.get('sageattn_error')))} |"
        )
    lines += ["", "| Pipeline | Config | latent rel err vs TORCH_SDPA | note |", "|---|---|---|---|"]
    for r in results["pipelines"]:
        lines.append(f"| {r['pipeline']} | {r['config']} | {r.get('latent_rel_err_vs_sdpa', '')} | {_pipeline_note(r)} |")
    return "\n".join(lines) + "\n"


PARTS = ("kernels", "sweep", "pipelines")
SECTION = {"kernels": "kernels", "sweep": "kv_sweep", "pipelines": "pipelines"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output prefix; writes <out>.json and <out>.md")
    parser.add_argument(
        "--only", action="append", choices=PARTS, help="run only this part (repeatable); default: all three"
    )
    parser.add_argument(
        "--reuse", metavar="JSON", help="an earlier sage_bench .json whose sections fill the parts not run here"
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda",
        help="cpu: dry run of part 3 only (TORCH_SDPA runs; SAGE_ATTN wiring on a simulated sm_90, FAKE kernel)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--inner", type=int, default=3)
    args = parser.parse_args()
    parts = tuple(dict.fromkeys(args.only or PARTS))
    if args.device == "cpu" and parts != ("pipelines",):
        parser.error("--device cpu runs part 3 only: pass --only pipelines")
    from importlib import metadata

    results = {"device": "CPU (dry run, no SageAttention)", "torch": torch.__version__, "sageattention": "not used"}
    if args.device == "cuda":
        results["device"] = torch.cuda.get_device_name()
        results["sageattention"] = metadata.version("sageattention")
    reused = results_io.read(Path(args.reuse))["payload"] if args.reuse else {}  # a filed result: {"meta", "payload"}
    sageattn, reused_from = None, {}
    if {"kernels", "sweep"} & set(parts):
        from sageattention import sageattn
    for part in PARTS:
        key = SECTION[part]
        if part in parts:
            if part == "kernels":
                results[key] = kernel_rows(sageattn, args)
            elif part == "sweep":
                results[key] = sweep_rows(sageattn)
            else:
                results[key] = pipeline_rows(args.device)
        else:
            results[key] = reused.get(key, [])
            if key in reused:
                reused_from[key] = {"path": args.reuse, "device": reused.get("device"), "torch": reused.get("torch")}
    if reused_from:
        results["reused"] = reused_from
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=2))
    Path(f"{out}.md").write_text(to_markdown(results))
    print(to_markdown(results))


if __name__ == "__main__":
    main()
