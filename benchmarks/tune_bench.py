"""``tune`` on full-size random-weight transformers: the time it takes, what it picks, and whether the pick is within 3%
of the fastest whole-step configuration, proven with the whole-step time of every candidate in the same process.

Per model (FLUX.1-dev size at 1024², Wan-14B size at 480p/81 frames, Qwen-Image size at 1328²; bf16, one transformer
forward per step):

1. Diffusers' native processors: the reference output and the baseline step.
2. ``installer.tune_attention`` on one forward (recording the calls, timing every candidate backend, writing the
   table to a fresh cache directory): seconds taken, the table.
3. Whole-step time of every candidate configuration — each exact backend for every role (``{"default": X}``), omni
   ``auto`` under the tuned table and ``auto`` under the shipped table — in interleaved rounds (every configuration
   once per round, median over rounds). The check: tuned ``auto`` ≤ 1.03 × the fastest candidate.
4. With ``--lossy``: each lossy mode's step time and the relative error of the whole forward's output against
   Diffusers' native output (FP8 FLASH_ATTN, SAGE_ATTN, RAINFUSION_ATTN at sparsity 0.5/0.8 and cumulative mass 0.9
   on Wan's self-attention), with FLASH_ATTN bf16 as the exact kernel's own error for scale.

    python -m benchmarks run tune          # (tune-lossy: --lossy; tune-no-fa3: FA3 hidden, --label says so)
    python -m benchmarks run tune --smoke  # tiny configs on the CPU

Random weights: the timings are those of the real shapes; the lossy errors are of random-weight models (real
checkpoints have structured attention, where block-sparse selection loses less), labelled as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.common import random_parameters_on, rel_err, sync
from diffusers_omni.attention.platform import current_platform
from diffusers_omni.attention.routing import table_label
from diffusers_omni.attention.selector import clear_resolution_cache
from diffusers_omni.attention.tuning import ENV_CACHE_DIR, forget_tuned_table
from diffusers_omni.installer import apply_attention, attention_report, remove_attention, tune_attention
from diffusers_omni.utils.versions import installed_version

TOLERANCE = 0.03
LABELS = {"flux": "FLUX.1-dev size, 1024²", "wan": "Wan-14B size, 480p/81 frames", "qwen": "Qwen-Image size, 1328²"}
SMOKE = {
    "flux": dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)),
    "wan": dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32, freq_dim=32),
    "qwen": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 axes_dims_rope=(4, 6, 6)),
}


def build(name: str, device: str, smoke: bool):
    """A random-weight bf16 transformer on ``device`` (parameters drawn on the device, N(0, 0.02); buffers as the
    model builds them) and one forward's inputs."""
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, WanTransformer3DModel

    from benchmarks.offload_bench import parameters_on_meta

    overrides = SMOKE[name] if smoke else {}
    cls = {"flux": FluxTransformer2DModel, "wan": WanTransformer3DModel, "qwen": QwenImageTransformer2DModel}[name]
    kwargs = {"guidance_embeds": True} if name == "flux" else {}
    with parameters_on_meta():
        model = cls(**kwargs, **overrides)
    model = random_parameters_on(model, device).eval()
    return model, inputs_for(name, model.config, device, smoke)


def inputs_for(name: str, config, device: str, smoke: bool) -> dict:
    generator = torch.Generator().manual_seed(0)
    bf16 = lambda *shape: torch.randn(*shape, generator=generator).to(device, torch.bfloat16)  # noqa: E731
    if name == "flux":
        side, text = (8, 16) if smoke else (64, 512)
        ids = torch.zeros(side * side, 3)
        ids[:, 1] = torch.arange(side).repeat_interleave(side)
        ids[:, 2] = torch.arange(side).repeat(side)
        return {"hidden_states": bf16(1, side * side, config.in_channels),
                "encoder_hidden_states": bf16(1, text, config.joint_attention_dim),
                "pooled_projections": bf16(1, config.pooled_projection_dim),
                "timestep": torch.tensor([0.5], device=device), "guidance": torch.tensor([3.5], device=device),
                "img_ids": ids.to(device), "txt_ids": torch.zeros(text, 3, device=device)}
    if name == "wan":
        frames, height, width, text = (2, 8, 8, 16) if smoke else (21, 60, 104, 512)  # 81 frames, 480×832
        return {"hidden_states": bf16(1, config.in_channels, frames, height, width),
                "timestep": torch.tensor([500], device=device),
                "encoder_hidden_states": bf16(1, text, config.text_dim)}
    side, text = (8, 16) if smoke else (83, 256)  # 1328² → 166² latents → 83² packed tokens
    return {"hidden_states": bf16(1, side * side, config.in_channels),
            "encoder_hidden_states": bf16(1, text, config.joint_attention_dim),
            "encoder_hidden_states_mask": torch.ones(1, text, dtype=torch.long, device=device),
            "timestep": torch.tensor([0.5], device=device), "img_shapes": [(1, side, side)]}


def forward(model, inputs) -> torch.Tensor:
    with torch.inference_mode():
        out = model(**inputs, return_dict=False)[0]
    return out


def step(model, inputs) -> float:
    sync()
    start = time.perf_counter()
    forward(model, inputs)
    sync()
    return time.perf_counter() - start


def interleaved(model, inputs, configs: dict, rounds: int, warmup: int = 1) -> tuple[dict, dict, dict]:
    """Median step seconds of each configuration (``None`` → Diffusers' processors), every configuration once per
    round; configurations that cannot be applied or run are returned with their error."""
    times: dict[str, list[float]] = {name: [] for name in configs}
    errors, backends = {}, {}
    names = list(configs)
    for index in range(warmup + rounds):
        shift = index % len(names)  # every configuration takes every place in the round in turn
        for name in names[shift:] + names[:shift]:
            config = configs[name]
            if name in errors:
                continue
            try:
                with config["scope"]():
                    remove_attention(model)
                    if config["attention"] is not None:
                        apply_attention(model, config["attention"])
                        backends.setdefault(name, sorted({(r["role"], r["backend"], tuple(r["shape_routed"]))
                                                          for r in attention_report(model)}))
                seconds = step(model, inputs)
            except Exception as exc:  # a configuration that cannot run is a result
                errors[name] = f"{type(exc).__name__}: {exc}"[:400]
                continue
            if index >= warmup:
                times[name].append(seconds)
    remove_attention(model)
    interleaved.samples = {name: [round(t, 6) for t in v] for name, v in times.items()}
    return ({name: statistics.median(v) for name, v in times.items() if v and name not in errors}, errors,
            {name: [list(b) for b in v] for name, v in backends.items()})


class _cache_scope:
    """Routing under a given cache directory (the tuned table) or an empty one (the shipped table)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self):
        return self

    def __enter__(self):
        self.saved = os.environ.get(ENV_CACHE_DIR)
        os.environ[ENV_CACHE_DIR] = self.directory
        forget_tuned_table()
        clear_resolution_cache()

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop(ENV_CACHE_DIR, None)
        else:
            os.environ[ENV_CACHE_DIR] = self.saved
        forget_tuned_table()
        clear_resolution_cache()


LOSSY_KEYS = {"FP8 FLASH_ATTN": "FLASH_ATTN fp8_e4m3", "SAGE_ATTN (INT8)": "SAGE_ATTN",
              "RainFusion sparsity 0.5": "RAINFUSION_ATTN sparsity=0.5",
              "RainFusion sparsity 0.8": "RAINFUSION_ATTN sparsity=0.8",
              "RainFusion cumulative mass 0.9": "RAINFUSION_ATTN mass_threshold=0.9"}


def lossy_configs(name: str) -> dict:
    fp8 = {"default": {"backend": "FLASH_ATTN", "quant": {"dtype_qk": "fp8_e4m3", "dtype_vo": "fp8_e4m3"}}}
    configs = {"FLASH_ATTN bf16 (exact)": {"default": {"backend": "FLASH_ATTN"}}, "FP8 FLASH_ATTN": fp8,
               "SAGE_ATTN (INT8)": {"default": {"backend": "SAGE_ATTN"}}}
    if name == "wan":
        for label, sparse in (("RainFusion sparsity 0.5", {"sparsity": 0.5}),
                              ("RainFusion sparsity 0.8", {"sparsity": 0.8}),
                              ("RainFusion cumulative mass 0.9", {"mass_threshold": 0.9})):
            configs[label] = {"per_role": {"wan.self": {"backend": "RAINFUSION_ATTN", "block_sparse": sparse}}}
    return configs


def run_model(name: str, args, tuned_dir: str, shipped_dir: str) -> dict:
    device = args.device
    model, inputs = build(name, device, args.smoke)
    result: dict = {"label": LABELS[name]}
    nothing = _cache_scope(shipped_dir)
    reference = forward(model, inputs).float()
    with _cache_scope(tuned_dir):
        tuned = tune_attention([model], lambda: forward(model, inputs), warmup=args.tune_warmup,
                               repeats=args.tune_repeats)
        result["tune"] = {"seconds": round(tuned.seconds, 2), "shapes": tuned.shapes,
                          "table": table_label(tuned.table), "families": tuned.table["families"],
                          "measured": tuned.table["measured"]}
        exact = [n for n in tuned.table["measured"][0]["seconds"] if "[" not in n]
    print(f"{name}: tuned in {tuned.seconds:.1f} s: {tuned.table['families']}", flush=True)
    candidates = {"Diffusers native": {"attention": None, "scope": nothing},
                  "omni auto (tuned table)": {"attention": "auto", "scope": _cache_scope(tuned_dir)},
                  "omni auto (shipped table)": {"attention": "auto", "scope": nothing}}
    for backend in exact:
        candidates[f"omni {backend} (every role)"] = {"attention": {"default": {"backend": backend}},
                                                      "scope": nothing}
    steps, errors, backends = interleaved(model, inputs, candidates, args.rounds)
    fastest = min(steps, key=steps.get)
    tuned_step = steps.get("omni auto (tuned table)")
    result["whole_step"] = {"seconds": steps, "samples": interleaved.samples, "unavailable": errors,
                            "backends": backends, "fastest": fastest,
                            "tuned_over_fastest": tuned_step / steps[fastest] if tuned_step else None,
                            "within_tolerance": bool(tuned_step and tuned_step <= (1 + TOLERANCE) * steps[fastest])}
    print(f"{name}: whole step {json.dumps({k: round(v, 4) for k, v in steps.items()})}; fastest {fastest}; "
          f"tuned/fastest {result['whole_step']['tuned_over_fastest']}", flush=True)
    if args.lossy:
        lossy = {}
        for label, config in lossy_configs(name).items():
            try:
                with nothing:
                    apply_attention(model, config)
                out = forward(model, inputs).float()
                seconds = statistics.median(step(model, inputs) for _ in range(args.rounds))
                lossy[label] = {"lossy_key": LOSSY_KEYS.get(label), "rel_err_vs_native": rel_err(out, reference),
                                "step_s": seconds,
                                "native_step_s": steps.get("Diffusers native"),
                                "exact_fastest_step_s": steps[fastest]}
                print(f"{name}: {label}: rel err {lossy[label]['rel_err_vs_native']:.4f}, {seconds:.4f} s", flush=True)
            except Exception as exc:
                lossy[label] = {"unavailable": f"{type(exc).__name__}: {exc}"[:400]}
                print(f"{name}: {label}: unavailable: {exc}", flush=True)
            finally:
                remove_attention(model)
        result["lossy"] = lossy
    del model, inputs, reference
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="flux,wan,qwen")
    parser.add_argument("--out", required=True, help="path without suffix; writes OUT.json")
    parser.add_argument("--label", default="all kernels installed")
    parser.add_argument("--lossy", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tune-warmup", type=int, default=3)
    parser.add_argument("--tune-repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny configs (CPU check of the script)")
    args = parser.parse_args()
    platform = current_platform()
    report = {"device": platform.device_name, "platform": platform.to_dict(), "torch": torch.__version__,
              "label": args.label, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "script": "benchmarks/tune_bench.py", "tolerance": TOLERANCE,
              "packages": {p: installed_version(p) for p in ("diffusers", "fa3-fwd", "flashinfer-python",
                                                              "sageattention", "triton")},
              "commit": os.environ.get("OMNI_COMMIT"), "random_weights": True, "models": {}}
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tuned_dir, shipped_dir = tempfile.mkdtemp(prefix="tuned_"), tempfile.mkdtemp(prefix="shipped_")
    for name in args.models.split(","):
        started = time.perf_counter()
        try:
            report["models"][name] = run_model(name, args, tuned_dir, shipped_dir)
        except Exception as exc:  # keep the other models' results
            report["models"][name] = {"label": LABELS[name], "error": f"{type(exc).__name__}: {exc}"[:800]}
            print(f"{name}: failed: {exc}", flush=True)
        report["models"][name]["elapsed_s"] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
