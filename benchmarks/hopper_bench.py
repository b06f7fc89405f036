"""FP8 FlashAttention-3 and block-sparse RainFusion on Hopper: kernel-level numbers and whole-transformer steps.

One process, one GPU (run on the H200):

* **FP8** (``FLASH_ATTN`` + ``quant``): at every ``attention_bench.SHAPES`` shape, FA3 bf16 vs the FP8 kernel alone,
  the quantisation alone (``fp8_quant.quantize_qkv``) and the whole FP8 call; relative error against an fp32
  reference; the GPU quantisation against its PyTorch reference (byte mismatches) and the FP8 kernel against the
  fake-quantised SDPA reference and against ``fp8_quant.fa3_fp8_emulation`` (P rounded as FA3 does).
* **Block-sparse** (``RAINFUSION_ATTN`` on CUDA): the runner against its mask → SDPA reference, and its selection
  against the float32 PyTorch selection (top-k and cumulative mass); at the Wan 480p and FLUX self-attention shapes,
  dense FA3 vs the block-sparse call (selection, plan lookup and layout copies included) at 50% and 20% kept,
  geometry-free and with a Wan geometry, and at the Wan shape the cumulative-mass selection at two thresholds; each
  call's stages alone (the selection: block means + page writes, against the kernel; the Q and output copies; a
  cumulative-mass call's per-call plan step: the host read of its largest needed count, the cached plan of its
  bucketed count, the copy of the kept page ids; the paged kernel); the call with Q handed over heads-major; the
  first call (plan built); relative error against the dense fp32 reference.
* **Whole transformer** (random-weight FLUX.1 and Wan-14B size, bf16): Diffusers ``native`` and ``_flash_3``, omni
  auto, omni FP8, omni RainFusion (Wan, default sparsity), median seconds per step in the same process. The FP8
  routing used there is derived from this run's FP8 rows (``derive_routing.derive_fp8``), as the committed table is.

    python -m benchmarks run hopper        # benchmarks/results/hopper/ and (--e2e) hopper-e2e/
    TRITON_INTERPRET=1 python -m benchmarks run hopper --smoke   # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import platform as host_platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import random_parameters_on, reference, rel_err, sync, time_ms
from benchmarks.derive_routing import derive_fp8
from diffusers_omni.attention.backends.rainfusion import block_sparse as bs
from diffusers_omni.attention.backends.flash import fp8_quant as fq
from diffusers_omni.attention.platform import current_platform

SHAPES = [  # as attention_bench.SHAPES: name, batch, heads, q_len, kv_len, head_dim, masked
    ("FLUX 1024² self", 1, 24, 4608, 4608, 128, False),
    ("Wan 480p/81f self", 1, 40, 32760, 32760, 128, False),
    ("Wan 480p/81f cross (512 text)", 1, 40, 32760, 512, 128, False),
    ("SDXL 1024² self", 2, 10, 4096, 4096, 64, False),
    ("SDXL 1024² cross (77 text)", 2, 10, 4096, 77, 64, False),
    ("HunyuanVideo-1.5 720p self", 1, 16, 54000, 54000, 128, False),
    ("FLUX 1024² self, key-padding mask", 1, 24, 4608, 4608, 128, True),
    ("HunyuanVideo-1.5 480p self, key-padding mask", 1, 16, 21600, 21600, 128, True),
]
SMOKE_SHAPES = [("smoke self", 1, 2, 640, 640, 64, False), ("smoke cross", 1, 2, 640, 96, 64, False),
                ("smoke masked", 1, 2, 640, 640, 64, True)]
# Block-sparse timing shapes: name, heads, tokens, Wan-like grid for the geometry variant (None: geometry-free only)
SPARSE_SHAPES = [("Wan 480p/81f self", 40, 32760, (21, 30, 52)), ("FLUX 1024² self", 24, 4608, None)]
SPARSITIES = (0.5, 0.8)
# Cumulative-mass thresholds timed at the Wan shape. On Gaussian inputs the pooled scores are nearly flat, so a
# threshold keeps about that share of the blocks: 0.5 and 0.2 sit next to the 50% and 20% top-k rows.
MASS_THRESHOLDS = (0.5, 0.2)


def reference_fa3(q, k, v, softmax_scale=None, q_descale=None, k_descale=None, v_descale=None, **_):
    """FA3's ``flash_attn_func`` contract in PyTorch (smoke runs): FP8 inputs with descales → bf16 output."""
    if q.dtype == fq.fp8_dtype():
        quant = fq.QuantizedQKV(q, k, v, q_descale, k_descale, v_descale, None)
        return fq.fp8_attention_reference(quant, softmax_scale).to(torch.bfloat16)
    return reference(q, k, v).to(q.dtype)


def kernels(smoke: bool):
    if smoke:
        return reference_fa3, lambda device: bs.ReferencePagedPrefill()
    import fa3_fwd_interface

    return fa3_fwd_interface.flash_attn_func, None


def fp8_section(args, func) -> list[dict]:
    rows = []
    device = args.device
    for label, b, h, sq, skv, d, masked in (SMOKE_SHAPES if args.smoke else SHAPES):
        torch.manual_seed(0)
        q = torch.randn(b, sq, h, d, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(b, skv, h, d, device=device, dtype=torch.bfloat16) for _ in range(2))
        row = {"shape": label, "B": b, "H": h, "Sq": sq, "Skv": skv, "D": d, "masked": masked}
        if masked:
            row.update(speedup=None, note="masked calls run bf16 (key-padding masks are not routed to FP8)")
            rows.append(row)
            continue
        big = 4 * b * h * sq * skv * d > 1e12
        repeats, inner = (5, 3) if big else (7, 20)
        if args.smoke:
            repeats, inner = 2, 1
        quant = fq.quantize_qkv(q, k, v)
        ref = reference(q, k, v)
        fp8_out = fq.fp8_attention(func, q, k, v)
        row["rel_err_fp8"] = rel_err(fp8_out, ref)
        row["rel_err_bf16"] = rel_err(func(q, k, v), ref)
        row["rel_err_fp8_vs_fake_quant_reference"] = rel_err(fp8_out, fq.fp8_attention_reference(quant))
        # The kernel against the emulation of FA3's FP8 forward (P rounded per key tile as the kernel does), on the
        # first query rows: what is left is accumulation order and the GPU's exp2.
        first = slice(0, min(sq, 1024))
        emulated = fq.fa3_fp8_emulation(quant, rows=first)
        row["rel_err_fp8_vs_fa3_emulation"] = rel_err(fp8_out[:, first], emulated)
        row["rel_err_fa3_emulation_vs_fp32"] = rel_err(emulated, ref[:, first])
        del emulated
        expected = fq.quantize_qkv_reference(q, k, v)
        row["quant_byte_mismatch"] = {
            n: (getattr(quant, n).view(torch.uint8) != getattr(expected, n).view(torch.uint8)).float().mean().item()
            for n in "qkv"
        }
        row["descales_equal"] = all(torch.allclose(getattr(quant, f"{n}_descale"), getattr(expected, f"{n}_descale"),
                                                   rtol=1e-6, atol=0) for n in "qkv")
        row["k_smoothed_heads"] = int((quant.k_mean.abs().sum(-1) > 0).sum())
        del expected, fp8_out, ref
        timed = {
            "bf16_ms": lambda: func(q, k, v),
            "fp8_kernel_ms": lambda: func(quant.q, quant.k, quant.v, q_descale=quant.q_descale,
                                          k_descale=quant.k_descale, v_descale=quant.v_descale),
            "quant_ms": lambda: fq.quantize_qkv(q, k, v),
            "fp8_whole_ms": lambda: fq.fp8_attention(func, q, k, v),
        }
        samples = {name: [] for name in timed}
        for _ in range(repeats):  # interleaved rounds
            for name, fn in timed.items():
                samples[name].append(time_ms(fn, 1, inner))
        row.update({name: statistics.median(vals) for name, vals in samples.items()})
        row["speedup"] = row["bf16_ms"] / row["fp8_whole_ms"]
        row["kernel_speedup"] = row["bf16_ms"] / row["fp8_kernel_ms"]
        print(f"fp8 {label}: bf16 {row['bf16_ms']:.3f} ms, fp8 whole {row['fp8_whole_ms']:.3f} (quant "
              f"{row['quant_ms']:.3f}) -> {row['speedup']:.3f}x; rel err {row['rel_err_fp8']:.2e}", flush=True)
        rows.append(row)
        del q, k, v, quant
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def wan_layout(tokens: int, grid) -> bs.SparseLayout:
    """The CUDA layout RAINFUSION_ATTN builds for a published Wan geometry (prefix 0, first frame kept)."""
    frame = grid[1] * grid[2]
    forced = tuple(range(min(-(-frame // bs.BLOCK), tokens // bs.BLOCK)))
    return bs.SparseLayout(tokens, None, 0, forced, source=f"geometry grid={grid}")


def kept_share(call) -> float:
    """Share of (query block, key page) pairs a planned call attends to."""
    layout = call.layout
    return int(call.plan.kv_indptr[-1]) / (call.qt.shape[0] * layout.query_blocks * layout.key_pages)


def stage_times(runner, q, k, v, layout, repeats: int, inner: int, **selection) -> dict:
    """Each stage of a block-sparse call alone (CUDA events), after one whole call: the selection itself (block
    means without the Q copy + the page writes), the Q copy it shares a pass with, the per-call plan step of a
    cumulative-mass call (``plan_call``: one host read of the largest needed count, the cached plan of the bucketed
    count, the kept page ids copied into it), the kernel, the output copy."""
    call = runner.select(runner.prepare(q, k, v, layout, **selection))
    runner.attend(call)
    times = {
        "pool_ms": time_ms(lambda: bs.pool_and_gather(q, k, layout, None, gather_q=False), repeats, inner),
        "prepare_ms": time_ms(lambda: runner.prepare(q, k, v, layout, **selection), repeats, inner),
        "write_pages_ms": time_ms(lambda: runner.write_pages(call), repeats, inner),
        "kernel_ms": time_ms(lambda: runner.attend(call), repeats, inner),
        "finish_ms": time_ms(lambda: runner.finish(call), repeats, inner),
    }
    if "mass_threshold" in selection:
        times["plan_ms"] = time_ms(lambda: runner.plan_call(runner.write_pages(call)), repeats, inner) - \
            times["write_pages_ms"]
    times["selection_ms"] = times["pool_ms"] + times["write_pages_ms"]
    times["selection_share_of_kernel"] = times["selection_ms"] / times["kernel_ms"]
    times["layout_copies_ms"] = max(times["prepare_ms"] - times["pool_ms"], 0.0) + times["finish_ms"]
    times["kept_share"] = kept_share(call)
    if "mass_threshold" in selection:
        times["mass_kept_blocks"] = call.kept  # the bucketed count every query block of the call keeps
    return times


def sparse_section(args, func, factory, out: dict, save=lambda: None) -> dict:
    device = args.device
    out.setdefault("checks", [])
    out.setdefault("timings", [])
    # 1. The runner against its mask -> SDPA reference (the same block mask as a token mask), and its selection (the
    #    Triton kernels on the GPU) against the float32 PyTorch selection.
    s_check, h_check = (640, 2) if args.smoke else (8192, 4)
    d = 64 if args.smoke else 128
    checks = [("geometry-free", bs.SparseLayout(s_check), {"sparsity": 0.5}),
              ("geometry", wan_layout(s_check, (5, 8, 16) if args.smoke else (8, 32, 32)), {"sparsity": 0.5}),
              ("geometry-free, cumulative mass", bs.SparseLayout(s_check), {"mass_threshold": 0.5})]
    for name, layout, selection in checks:
        torch.manual_seed(1)
        q, k, v = (torch.randn(1, s_check, h_check, d, device=device, dtype=torch.bfloat16) for _ in range(3))
        runner = bs.BlockSparseRunner(factory)
        result, mask = runner(q, k, v, layout, return_mask=True, **selection)
        expected = bs.reference_mask(q, k, layout, **selection)
        out["checks"].append({
            "layout": name, "B": 1, "H": h_check, "S": s_check, "D": d, **selection,
            "rel_err_vs_mask_sdpa_reference": rel_err(result, bs.block_sparse_reference(q, k, v, layout, mask)),
            "mask_rows_equal_to_float32_selection": (mask == expected).all(-1).float().mean().item(),
            "kept_fraction": mask.float().mean().item(),
        })
        print("sparse check", out["checks"][-1], flush=True)
        save()
    # 2. Timings at DiT shapes: dense FA3, the whole call, and its stages.
    for label, h, s, grid in (SPARSE_SHAPES if not args.smoke else [("smoke", 2, 4224, (3, 32, 44))]):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, s, h, 128 if not args.smoke else 64, device=device, dtype=torch.bfloat16)
                   for _ in range(3))
        big = s > 10000
        repeats, inner = (5, 3) if big else (7, 10)
        if args.smoke:
            repeats, inner = 1, 1
        dense_ms = time_ms(lambda: func(q, k, v), repeats, inner)
        ref = reference(q, k, v) if not args.smoke or s <= 5000 else None
        layouts = [("geometry-free", bs.SparseLayout(s))]
        if grid is not None:
            layouts.append((f"Wan geometry {grid}", wan_layout(s, grid)))
        selections = [(layout_name, layout, {"sparsity": x}) for layout_name, layout in layouts for x in SPARSITIES]
        if big:  # cumulative mass at the Wan shape, geometry-free
            selections += [("geometry-free", layouts[0][1], {"mass_threshold": x}) for x in MASS_THRESHOLDS]
        for layout_name, layout, selection in selections:
            runner = bs.BlockSparseRunner(factory)
            sync()
            t0 = time.perf_counter()
            result = runner(q, k, v, layout, **selection)
            sync()
            first_ms = (time.perf_counter() - t0) * 1e3
            whole = time_ms(lambda: runner(q, k, v, layout, **selection), repeats, inner)
            stages = stage_times(runner, q, k, v, layout, repeats, inner, **selection)
            _, mask = runner(q, k, v, layout, return_mask=True, **selection)
            rows_equal = (mask == bs.reference_mask(q, k, layout, **selection)).all(-1).float().mean().item()
            del mask
            kept = (bs.kept_blocks(layout, selection["sparsity"]) if "sparsity" in selection
                    else stages["mass_kept_blocks"])
            row = {
                "shape": label, "H": h, "S": s, "layout": layout_name, **selection,
                # Whole key blocks (the count each rule picks), and the key pages attended: the partial tail is one
                # more page under either rule (top-k's sparsity counts it among the kept pages).
                "kept_blocks": kept, "key_blocks": layout.full_key_blocks,
                "kept_pages": kept + layout.key_pages - layout.full_key_blocks, "key_pages": layout.key_pages,
                "kept_fraction": stages["kept_share"],
                "dense_fa3_ms": dense_ms, "sparse_ms": whole, "first_call_ms": first_ms, "speedup": dense_ms / whole,
                **stages, "selection_share": stages["selection_ms"] / whole,
                "rel_err_vs_dense_fp32": rel_err(result, ref) if ref is not None else None,
                "plans": runner.plan_count, "host_syncs": runner.host_syncs,
                "mask_rows_equal_to_float32_selection": rows_equal,
            }
            if big and selection == {"sparsity": SPARSITIES[-1]} and layout_name == "geometry-free":
                # Q as a processor that writes its RoPE output heads-major hands it over: no Q copy.
                heads_major = q.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
                row["sparse_ms_heads_major_q"] = time_ms(lambda: runner(heads_major, k, v, layout, **selection),
                                                         repeats, inner)
                del heads_major
            out["timings"].append(row)
            what = ", ".join(f"{key} {value}" for key, value in selection.items())
            print(f"sparse {label} {layout_name} {what}: {whole:.3f} ms vs dense {dense_ms:.3f} -> "
                  f"{row['speedup']:.3f}x (kept {stages['kept_share']:.3f}; selection {stages['selection_ms']:.3f} ms "
                  f"= {stages['selection_share_of_kernel']:.1%} of the kernel's {stages['kernel_ms']:.3f} ms; layout "
                  f"copies {stages['layout_copies_ms']:.3f} ms; plan {stages.get('plan_ms', 0.0):.3f} ms; first call "
                  f"{first_ms:.1f} ms; mask rows equal to the float32 selection {rows_equal:.4f})", flush=True)
            save()
        del q, k, v, ref
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


# Whole transformer ----------------------------------------------------------------------------------------------

def build_model(name: str, device: str, smoke: bool):
    from benchmarks.offload_bench import meta_transformer

    smoke_config = {
        "flux": dict(num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=2,
                     joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(16, 24, 24)),
        "wan": dict(num_layers=2, num_attention_heads=2, attention_head_dim=64, ffn_dim=64, text_dim=32, freq_dim=32),
    }
    model = meta_transformer(name, smoke_config.get(name, smoke_config["wan"]) if smoke else {})
    return random_parameters_on(model, device).eval()


def model_inputs(name: str, model, device: str, smoke: bool) -> tuple[dict, int]:
    from benchmarks.offload_bench import transformer_inputs

    text = 16 if smoke else 512
    if name == "flux":
        side = 32 if smoke else 64
        return transformer_inputs(name, model.config, device, text, side), side * side + text
    frames, height, width = (3, 32, 44) if smoke else (21, 60, 104)  # 81 frames, 480×832 → 32,760 tokens
    tokens = frames * (height // 2) * (width // 2)
    return transformer_inputs(name, model.config, device, text, (frames, height, width)), tokens


def step_seconds(model, inputs, warmup: int, repeats: int) -> float:
    times = []
    with torch.inference_mode():
        for index in range(warmup + repeats):
            sync()
            t0 = time.perf_counter()
            model(**inputs)
            sync()
            if index >= warmup:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flash3_shim() -> str | None:
    """Diffusers' ``_flash_3`` imports ``flash_attn_interface`` (a FlashAttention-3 source build) and checks for a
    ``flash_attn_3`` distribution. ``fa3-fwd`` ships the same FA3 forward as ``fa3_fwd_interface``: alias it under
    the module name Diffusers imports and answer its distribution lookup (a ``sys.meta_path`` finder), before
    Diffusers is imported. Returns why it is unavailable, or ``None``."""
    import importlib.machinery
    import importlib.metadata
    import importlib.util
    import types

    if importlib.util.find_spec("flash_attn_interface") is not None:
        return None
    if importlib.util.find_spec("fa3_fwd_interface") is None:
        return "neither flash_attn_interface nor fa3_fwd_interface is importable"
    import fa3_fwd_interface

    package = types.ModuleType("flash_attn_3")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn_3", None)
    sys.modules["flash_attn_3"] = package
    sys.modules["flash_attn_interface"] = fa3_fwd_interface

    class ShimDistribution(importlib.metadata.Distribution):
        def read_text(self, filename):
            return "Metadata-Version: 2.1\nName: flash_attn_3\nVersion: 3.0.0\n" if filename == "METADATA" else None

        def locate_file(self, path):
            return None

    class ShimFinder(importlib.metadata.DistributionFinder):
        def find_spec(self, *args, **kwargs):
            return None

        def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
            if context.name in (None, "flash_attn_3", "flash-attn-3"):
                return iter([ShimDistribution()])
            return iter(())

    sys.meta_path.append(ShimFinder())
    return None


def e2e_section(args, rows_fp8: list[dict], on_model=None) -> dict:
    from diffusers_omni.attention import routing
    from diffusers_omni.installer import apply_attention, remove_attention

    shim_problem = flash3_shim()  # before diffusers is imported
    import diffusers  # noqa: F401

    # The FP8 routing this run's numbers imply (the committed table is derived from the same rows).
    import tempfile

    table = json.loads(routing.TABLE_PATH.read_text())
    table["fp8"] = derive_fp8([{"platform": current_platform().to_dict(), "fp8": rows_fp8}])
    derived = Path(tempfile.mkdtemp(prefix="routing_")) / "routing_table.json"
    derived.write_text(json.dumps(table, indent=2) + "\n")
    routing.TABLE_PATH = derived  # load_table() reads the module's TABLE_PATH at call time
    routing.load_table.cache_clear()
    from diffusers_omni.attention.selector import clear_resolution_cache

    clear_resolution_cache()

    fp8 = {"default": {"backend": "FLASH_ATTN", "quant": {"dtype_qk": "fp8_e4m3", "dtype_vo": "fp8_e4m3"}}}
    rainfusion = {"per_role": {"wan.self": {"backend": "RAINFUSION_ATTN", "block_sparse": {"sparsity": 0.8}}}}
    report = {"models": {}, "unavailable": {}, "fp8_routing": table["fp8"]}
    warmup, repeats = (1, 1) if args.smoke else (1, 3)
    for name, label in (("flux", "FLUX.1 size, 1024²"), ("wan", "Wan-14B size, 480p/81 frames")):
        model = build_model(name, args.device, args.smoke)
        inputs, tokens = model_inputs(name, model, args.device, args.smoke)
        variants = {
            "Diffusers native": ("diffusers", "native"),
            "Diffusers _flash_3": ("diffusers", "_flash_3"),
            "omni auto": ("omni", None),
            "omni FP8": ("omni", fp8),
            # The FP8 spec's bf16 fallback alone (FLUX routes every call to bf16): isolates the explicit
            # FLASH_ATTN path from the auto route.
            "omni FLASH_ATTN bf16": ("omni", {"default": {"backend": "FLASH_ATTN"}}),
        }
        if name == "wan":
            variants["omni RainFusion (sparsity 0.8)"] = ("omni", rainfusion)
        steps, backends = {}, {}
        for variant, (kind, config) in variants.items():
            try:
                if kind == "diffusers":
                    if config == "_flash_3" and shim_problem:
                        raise RuntimeError(shim_problem)
                    model.set_attention_backend(config)
                else:
                    apply_attention(model, config)
                steps[variant] = step_seconds(model, inputs, warmup + (1 if name == "flux" else 0), repeats)
                if kind == "omni":
                    backends[variant] = omni_backends(model)
                print(f"e2e {label} {variant}: {steps[variant]:.4f} s/step", flush=True)
            except Exception as exc:  # a variant that cannot run is a result
                report["unavailable"][f"{label}: {variant}"] = f"{type(exc).__name__}: {exc}"[:400]
                print(f"e2e {label} {variant}: unavailable: {exc}", flush=True)
            finally:
                if kind == "diffusers":
                    try:
                        model.reset_attention_backend()
                    except Exception:
                        model.set_attention_backend("native")
                else:
                    remove_attention(model)
        report["models"][label] = {"tokens": tokens, "baseline": "Diffusers native", "steps": steps,
                                   "omni_backends": backends}
        if on_model is not None:
            on_model(report)
        del model, inputs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report["fp8_routing"] = table["fp8"]
    return report


def omni_backends(model) -> dict:
    """What the omni variant ran, per role: the backend (and its implementation), and for an FP8 spec the route
    each call shape took (``True``: FP8) — the diagnostic behind a whole-step difference between variants."""
    seen: dict[str, dict] = {}
    for module in model.modules():
        for role, attention in getattr(getattr(module, "processor", None), "attend", {}).items():
            if role in seen:
                continue
            backend = attention.backend
            describe = backend.describe() if hasattr(backend, "describe") else {}
            seen[role] = {"backend": attention.resolution.backend, "implementation": describe.get("implementation"),
                          "fp8_routes": {str(k): v for k, v in getattr(backend, "_fp8_routes", {}).items()}}
    return seen


def to_markdown(results: dict) -> str:
    lines = [f"# FP8 and block-sparse attention on {results['device']}", "",
             f"torch {results['torch']}, {results['date']}, bf16 inputs, script `{results['script']}`.", "",
             "## FP8 (FLASH_ATTN quant fp8_e4m3)", "",
             "| Shape | FA3 bf16 ms | FP8 kernel ms | quantisation ms | FP8 whole ms | whole / bf16 | rel err FP8 | "
             "rel err bf16 |", "|---|---|---|---|---|---|---|---|"]
    for row in results.get("fp8", []):
        if row.get("speedup") is None:
            lines.append(f"| {row['shape']} | — | — | — | — | {row.get('note', 'not run')} | — | — |")
            continue
        lines.append(f"| {row['shape']} | {row['bf16_ms']:.3f} | {row['fp8_kernel_ms']:.3f} | {row['quant_ms']:.3f} | "
                     f"{row['fp8_whole_ms']:.3f} | {row['speedup']:.3f}× | {row['rel_err_fp8']:.2e} | "
                     f"{row['rel_err_bf16']:.2e} |")
    sparse = results.get("sparse", {})
    lines += ["", "## Block-sparse (RAINFUSION_ATTN on CUDA)", "",
              "Whole call (selection, plan, layout copies included) against dense FA3; then its stages alone: the "
              "selection (block means + page writes), the Q/output layout copies, the plan (cumulative mass, per "
              "call: one host read of the largest needed count, the cached plan of the bucketed count, the kept "
              "page ids copied into it), the paged kernel.", "",
              "| Shape | Layout | selection | kept | dense FA3 ms | sparse ms | speed-up | selection ms (÷ kernel) | "
              "layout copies ms | plan ms | kernel ms | first call ms | rel err vs dense |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in sparse.get("timings", []):
        err = f"{row['rel_err_vs_dense_fp32']:.2e}" if row.get("rel_err_vs_dense_fp32") is not None else "—"
        rule = (f"mass ≥ {row['mass_threshold']}" if row.get("mass_threshold") is not None
                else f"top-k, sparsity {row['sparsity']}")
        kept = (f"{row['kept_pages']}/{row['key_pages']} pages" if row.get("kept_pages") is not None
                else f"{row['kept_fraction']:.1%}")
        plan = f"{row['plan_ms']:.3f}" if row.get("plan_ms") is not None else "—"
        lines.append(f"| {row['shape']} | {row['layout']} | {rule} | {kept} | {row['dense_fa3_ms']:.3f} | "
                     f"{row['sparse_ms']:.3f} | {row['speedup']:.3f}× | {row['selection_ms']:.3f} "
                     f"({row['selection_share_of_kernel']:.1%}) | {row['layout_copies_ms']:.3f} | {plan} | "
                     f"{row['kernel_ms']:.3f} | {row['first_call_ms']:.1f} | {err} |")
    for row in sparse.get("timings", []):
        if row.get("sparse_ms_heads_major_q") is not None:
            lines.append(f"\n{row['shape']}, sparsity {row['sparsity']}, Q handed over heads-major (no Q copy): "
                         f"{row['sparse_ms_heads_major_q']:.3f} ms ({row['dense_fa3_ms'] / row['sparse_ms_heads_major_q']:.3f}×)")
    lines += ["", "Kernel path against its references:", ""]
    for check in sparse.get("checks", []):
        rule = (f"mass threshold {check['mass_threshold']}" if check.get("mass_threshold") is not None
                else f"sparsity {check['sparsity']}")
        lines.append(f"- block-sparse {check['layout']} (1×{check['H']}×{check['S']}×{check['D']}, {rule}): rel err vs "
                     f"mask → SDPA {check['rel_err_vs_mask_sdpa_reference']:.2e}; block-mask rows equal to the float32 "
                     f"selection {check['mask_rows_equal_to_float32_selection']:.3f}")
    for row in sparse.get("timings", []):
        if row.get("mask_rows_equal_to_float32_selection") is not None:
            rule = (f"mass threshold {row['mass_threshold']}" if row.get("mass_threshold") is not None
                    else f"sparsity {row['sparsity']}")
            lines.append(f"- block-sparse selection at {row['shape']}, {row['layout']}, {rule}: block-mask rows equal to "
                         f"the float32 selection {row['mask_rows_equal_to_float32_selection']:.4f}")
    for row in results.get("fp8", []):
        if row.get("speedup") is not None:
            emulation = row.get("rel_err_fp8_vs_fa3_emulation")
            lines.append(f"- FP8 {row['shape']}: kernel vs fake-quantised SDPA {row['rel_err_fp8_vs_fake_quant_reference']:.2e}"
                         + (f", vs the FA3-FP8 emulation {emulation:.2e} (emulation vs fp32 "
                            f"{row['rel_err_fa3_emulation_vs_fp32']:.2e})" if emulation is not None else "")
                         + f"; quantisation bytes differing from the PyTorch reference "
                         f"{max(row['quant_byte_mismatch'].values()):.2e}")
    if results.get("elapsed_s"):
        lines.append("- elapsed: " + ", ".join(f"{k} {v:.0f} s" for k, v in results["elapsed_s"].items()))
    for key in ("errors",):
        for where, message in results.get(key, {}).items():
            lines.append(f"- ERROR in {where}: {message}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json and PREFIX.md")
    parser.add_argument("--e2e", help="also run the whole-transformer steps and write this JSON")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run with the reference kernels")
    parser.add_argument("--sections", default="fp8,sparse", help="comma-separated: fp8, sparse")
    args = parser.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("hopper_bench.py needs a CUDA GPU (or --smoke)")
    func, factory = kernels(args.smoke)
    plat = current_platform()
    results = {"device": plat.device_name, "platform": plat.to_dict(), "torch": torch.__version__,
               "python": host_platform.python_version(), "date": time.strftime("%Y-%m-%d"),
               "script": "benchmarks/hopper_bench.py", "errors": {}}
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)

    def save():
        prefix.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
        prefix.with_suffix(".md").write_text(to_markdown(results))

    sections = args.sections.split(",")
    results["elapsed_s"] = {}
    started = time.perf_counter()
    if "fp8" in sections:
        try:
            results["fp8"] = fp8_section(args, func)
        except Exception:
            results["errors"]["fp8"] = traceback.format_exc()[-2000:]
            print(results["errors"]["fp8"], flush=True)
        results["elapsed_s"]["fp8"] = time.perf_counter() - started
        save()
    if "sparse" in sections:
        section_start = time.perf_counter()
        try:
            results["sparse"] = {}
            sparse_section(args, func, factory, results["sparse"], save)
        except Exception:
            results["errors"]["sparse"] = traceback.format_exc()[-2000:]
            print(results["errors"]["sparse"], flush=True)
        results["elapsed_s"]["sparse"] = time.perf_counter() - section_start
        save()
    if args.e2e:
        def write_e2e(e2e):
            Path(args.e2e).write_text(json.dumps(
                {"device": plat.device_name, "torch": torch.__version__, "script": "benchmarks/hopper_bench.py",
                 "models": e2e["models"]}, indent=2) + "\n")
            results["e2e_unavailable"] = e2e["unavailable"]
            results["e2e_fp8_routing"] = e2e.get("fp8_routing")
            save()

        section_start = time.perf_counter()
        try:
            e2e = e2e_section(args, results.get("fp8", []), on_model=write_e2e)
            write_e2e(e2e)
        except Exception:
            results["errors"]["e2e"] = traceback.format_exc()[-2000:]
            print(results["errors"]["e2e"], flush=True)
        results["elapsed_s"]["e2e"] = time.perf_counter() - section_start
        save()
    results["elapsed_s"]["total"] = time.perf_counter() - started
    save()
    print(to_markdown(results))


if __name__ == "__main__":
    main()
