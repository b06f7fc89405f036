"""Render the measured-number tables of ``docs/`` from the committed results, so no number there is typed by hand.

Each table sits between ``<!-- results: NAME -->`` and ``<!-- /results -->`` in a docs page; this script rewrites
what is between the markers. ``--check`` only reports stale tables (a test runs it).

    python -m benchmarks.docs_tables            # rewrite
    python -m benchmarks.docs_tables --check    # exit 1 when a table differs from the results
"""

from __future__ import annotations

import argparse
import json
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

from benchmarks.derive_routing import distinct_exact, routed_choices

from diffusers_omni.attention.routing import load_table

GiB = 2**30
MARKER = re.compile(r"(<!-- results: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
DENSE = ("TORCH_SDPA", "CUDNN_ATTN", "FLASH_ATTN", "FLASHINFER_ATTN")


@cache
def result(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def dims(shape: dict) -> str:
    return f"{shape['B']}×{shape['H']}×{shape['Sq']}×{shape['Skv']}×{shape['D']}"


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# Attention --------------------------------------------------------------------------------------------------------

def attention_backends() -> str:
    results = result("attention_h200")
    rows = []
    for shape, chosen, fastest in routed_choices(results, load_table()):
        measured = shape["results"]
        cells = [f"**{measured[n]['tflops']:.0f}**" if n == fastest else
                 (f"{measured[n]['tflops']:.0f}" if n in measured else "—") for n in DENSE]
        sage = measured.get("SAGE_ATTN")
        ratio = measured[chosen]["tflops"] / measured[fastest]["tflops"]
        rows.append([f"{shape['shape']} {dims(shape)}", *cells, f"{sage['tflops']:.0f}" if sage else "—",
                     f"{chosen} ({ratio:.3f})"])
    errors = [r["rel_err"] for s in results["shapes"] for n, r in distinct_exact(s).items()]
    return table(["Shape (B×H×Sq×Skv×D)", *DENSE, "SAGE_ATTN (lossy)", "default (÷ fastest)"], rows) + (
        f"\nTFLOP/s, {results['platform']['device_name']}, torch {results['torch']}, {results['date']}; bold = fastest "
        f"distinct exact kernel. Dense relative error against fp32: {min(errors):.1e}–{max(errors):.1e}.\n")


def attention_same_kernel() -> str:
    """FLASH_ATTN measured through every wrapper that ran it (the Hub fallbacks, the router): the run's noise."""
    rows = []
    for shape in result("attention_h200")["shapes"]:
        same = {n: r["tflops"] for n, r in shape["results"].items()
                if n == "FLASH_ATTN" or r.get("runs_as") or n.endswith("→ FLASH_ATTN)")}
        if len(same) > 1:
            low, high = min(same.values()), max(same.values())
            rows.append([shape["shape"], len(same), f"{low:.0f}–{high:.0f}", f"{(high - low) / low:.1%}"])
    return table(["Shape", "timings of the FA3 kernel", "TFLOP/s", "spread"], rows)


def attention_router() -> str:
    rows = []
    for shape in result("attention_h200")["shapes"]:
        for name, row in shape["results"].items():
            if name.startswith("platform default end to end"):
                target = name.split("→ ")[1].rstrip(")")
                direct = shape["results"][target]["tflops"]
                rows.append([shape["shape"], target, f"{row['tflops']:.0f}", f"{direct:.0f}"])
    return table(["Shape", "routed to (in that run)", "through the router", "backend called directly"], rows)


# SageAttention ----------------------------------------------------------------------------------------------------

def sage_backend() -> str:
    rows = []
    for shape in result("attention_h200")["shapes"]:
        measured = shape["results"]
        if "SAGE_ATTN" not in measured:
            continue
        exact = distinct_exact(shape)
        fastest = max(exact, key=lambda n: exact[n]["tflops"])
        sdpa, sage = measured["TORCH_SDPA"], measured["SAGE_ATTN"]
        rows.append([f"{shape['shape']} {dims(shape)}", f"{sdpa['tflops']:.1f}", f"{sage['tflops']:.1f}",
                     f"{sage['tflops'] / sdpa['tflops']:.2f}", f"{fastest}, {exact[fastest]['tflops']:.1f}",
                     f"{sage['rel_err']:.2e}"])
    return table(["Shape (B×H×Sq×Skv×D)", "TORCH_SDPA TFLOP/s", "SAGE_ATTN TFLOP/s", "SAGE / SDPA",
                  "fastest exact backend", "SAGE_ATTN rel err"], rows)


def sage_kernels() -> str:
    rows = [[k["shape"], f"{k['sdpa_tflops']:.0f}", f"{k['sageattn_tflops']:.0f}",
             f"{k['sageattn_tflops'] / k['sdpa_tflops']:.2f}", f"{k['sdpa_rel_err']:.1e}", f"{k['sageattn_rel_err']:.1e}"]
            for k in result("sage_h200")["kernels"]]
    return table(["Shape", "SDPA TFLOP/s", "sageattn TFLOP/s", "ratio", "SDPA rel err", "sageattn rel err"], rows)


def sage_sweep() -> str:
    rows = [[s["kv_len"], s["padding_rows"], f"{s['predicted_rel_err']:.3g}", f"{s['sageattn_rel_err']:.3g}"]
            for s in result("sage_h200")["kv_sweep"]]
    return table(["KV length", "padded rows", "predicted rel err (padding only)", "measured rel err"], rows)


def sage_pipelines() -> str:
    rows = []
    for p in result("sage_h200")["pipelines"]:
        guarded = ", ".join(p["short_kv_guarded_roles"]) or "none"
        calls = ", ".join(f"{n} × KV {kv}" for kv, n in p["sage_kernel_calls_by_kv_len"].items())
        rows.append([p["pipeline"], p["config"], f"{p['latent_rel_err_vs_sdpa']:.1e}", calls, guarded])
    return table(["Pipeline", "Config", "latent rel err vs TORCH_SDPA", "sageattn calls", "kept on TORCH_SDPA"], rows)


# Offload ----------------------------------------------------------------------------------------------------------

def _variants(name: str) -> tuple[dict, dict[str, dict]]:
    entry = result(name)["models"][0]
    return entry, {v["variant"]: v for v in entry["variants"]}


def offload_summary() -> str:
    rows = []
    for name, label, variant_name in (
        ("offload_h200_flux", "FLUX.1-dev size", "omni layerwise"),
        ("offload_h200_flux_budget", "FLUX.1-dev size", "omni layerwise 12GiB"),
        ("offload_h200_wan", "Wan2.2-14B size", "omni layerwise"),
    ):
        entry, variants = _variants(name)
        variant = variants[variant_name]
        diffusers = [v for n, v in variants.items() if n.startswith("diffusers")]
        rows.append([f"{label} ({gib(entry['param_bytes'])})", variant_name, f"{variant['step_s']:.3f}",
                     f"{variant['target_step_s']:.3f}", "yes" if variant["meets_step_target"] else "NO",
                     gib(variant["peak_device_bytes"]), " / ".join(f"{v['step_s']:.3f}" for v in diffusers) or "—",
                     f"{variants['resident']['step_s']:.3f}", f"`{name}.md`"])
    return table(["Model", "Variant", "Step (s)", "Target (s)", "Meets", "Peak device",
                  "Diffusers (record_stream off / on)", "Resident", "Run"], rows)


def offload_budget_window() -> str:
    rows = []
    for name in ("offload_h200_flux", "offload_h200_flux_budget_distributed", "offload_h200_flux_budget"):
        _, variants = _variants(name)
        budget = next(v for n, v in variants.items() if n.startswith("omni layerwise ") and "GiB" in n)
        rows.append([f"`{name}.md`", f"{budget['step_s']:.3f}", f"{budget['target_step_s']:.3f}",
                     "yes" if budget["meets_step_target"] else "NO"])
    return table(["Run (oldest first)", "12 GiB budget step (s)", "target (s)", "meets"], rows) + (
        "\nRuns in order: fixed slots; plus free-room prefetch; plus the byte-counted window.\n")


def distributed_summary() -> str:
    names = (("offload_h200_flux_budget_distributed", "FLUX.1-dev size"),
             ("offload_h200_distributed_wan", "Wan 14B size"))
    columns = []
    for name, label in names:
        entry, variants = _variants(name)
        layerwise = variants["omni layerwise"]
        gather = variants["omni distributed-layerwise N=1 allgather=True"]
        plain = variants["omni distributed-layerwise N=1 allgather=False"]
        mmap = entry["mmap_loading"]
        columns.append((label, [
            f"{gib(entry['param_bytes'])} / {gib(layerwise['streamed_bytes'])} ({layerwise['streamed_blocks']} blocks)",
            f"{result(name)['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
            f"{variants['resident']['step_s']:.3f} s",
            f"{layerwise['step_s']:.3f} s",
            f"{gather['step_s']:.3f} s ({gather['ratio_to_layerwise']:.3f} ×)",
            f"{plain['step_s']:.3f} s ({plain['ratio_to_layerwise']:.3f} ×)",
            " / ".join(gib(v["peak_device_bytes"]) for v in (layerwise, gather, plain)),
            " / ".join(gib(gather[k]) for k in ("host_rss_before", "host_rss_peak_setup", "host_rss_after_setup")),
            f"{gather['teardown_s']:.1f} s",
            f"{mmap['load_s']:.1f} s / {mmap['pack_s']:.1f} s",
            f"+{gib(mmap['anon_growth_after_pack'])} (≤ {gib(mmap['target_anon_growth'])})",
            gib(mmap["after_pack"]["file"]),
        ]))
    labels = ["Model / streamed per step", "Pinned host→device bandwidth", "Step: resident",
              "Step: layerwise (single GPU)", "Step: distributed, AllGather, N = 1 (÷ layerwise)",
              "Step: distributed, no-AllGather, N = 1 (÷ layerwise)",
              "Peak device: layerwise / AllGather / no-AllGather",
              "Host RSS around enable, AllGather, normal load: before / peak / after", "Disable, AllGather",
              "mmap loading: load / enable", "mmap loading: anonymous RSS growth (target ≤ 1.05 × model ÷ N)",
              "mmap loading: file-backed RSS after packing"]
    rows = [[label, *(values[i] for _, values in columns)] for i, label in enumerate(labels)]
    return table(["", *(label for label, _ in columns)], rows)


def distributed_example(ranks: int = 4) -> str:
    """The memory math of the guide, worked for the measured FLUX.1-dev-size blocks at ``ranks`` ranks."""
    _, variants = _variants("offload_h200_flux_budget_distributed")
    layerwise = variants["omni layerwise"]
    streamed, largest = layerwise["streamed_bytes"], layerwise["slot_bytes"]
    return (
        f"FLUX.1-dev ({gib(streamed)} of bf16 blocks, {layerwise['streamed_blocks']} blocks; the largest is "
        f"S = {gib(largest)}) on {ranks} ranks: ≈{gib(streamed / ranks)} pinned per rank and "
        f"≈{gib(2 * largest + 2 * largest / ranks)} of block weights per GPU (2 × {gib(largest)} slots + 2 × "
        f"{gib(largest / ranks)} staging). Computed from the blocks measured in `offload_h200_flux_budget_distributed`; "
        "only N = 1 was run.\n"
    )


def _short_error(error: str) -> str:
    kind, _, message = error.partition(": ")
    for needle, short in (("is_pinned", "aten.is_pinned not implemented"),
                          ("set the storage", "cannot move the subclass's storage"),
                          ("quant_state", "quant_state not moved")):
        if needle in message:
            return f"{kind}: {short}"
    return kind


# The quantized offload run the docs show: the full-size run once it exists, else the full-width 1-block run.
QUANT_OFFLOAD_RUN = "quant_offload_h200" if (RESULTS / "quant_offload_h200.json").exists() else "quant_offload_h200_1block"


def quant_offload() -> str:
    report = result(QUANT_OFFLOAD_RUN)
    rows = []
    for entry in report["entries"]:
        variants = {v["variant"]: v for v in entry["variants"]}
        resident, omni, diffusers = (variants[n] for n in ("resident", "omni layerwise", "diffusers group_offload"))
        diffusers_step = f"{diffusers['step_s']:.3f}" if "step_s" in diffusers else _short_error(diffusers["error"])
        meets = [omni.get(k) for k in ("meets_step_target", "meets_peak_target", "meets_setup_target")]
        missed = [k for k, m in zip(("step", "peak", "setup"), meets) if m is False]
        rows.append([
            entry["model"], entry["format"], gib(entry["packed_bytes"]), f"{resident['step_s']:.3f}", diffusers_step,
            f"{omni['step_s']:.3f}", f"{omni['target_step_s']:.3f}", "NO: " + ", ".join(missed) if missed else "yes",
            f"{gib(omni['peak_device_bytes'])} / " + (gib(diffusers["peak_device_bytes"]) if "step_s" in diffusers
                                                      else "—"),
            f"{omni['setup_s']:.1f}", "yes" if omni["bitwise_equal_to_resident"] else "NO",
        ])
    env, versions = report["environment"], report["versions"]
    return table(["Model", "Format", "Packed", "Resident step (s)", "Diffusers group offload (s)",
                  "omni layerwise (s)", "Target (s)", "Meets", "Peak omni / Diffusers", "Setup (s)",
                  "Bitwise = resident"], rows) + (
        f"\n{env['device_name']}, torch {env['torch']}, torchao {versions['torchao']}, bitsandbytes "
        f"{versions['bitsandbytes']}, gguf {versions['gguf']}; pinned host→device "
        f"{report['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s in the same run; median of {report['args']['repeats']} "
        f"steps after {report['args']['warmup']} warm-up. Target = 1.05 × max(resident step, streamed bytes ÷ "
        "bandwidth); peak ≤ Diffusers' (where it runs); setup ≤ 10 s for FLUX size. Run: "
        f"`{QUANT_OFFLOAD_RUN}.md`" + (f" ({report['args']['layers']} block(s) per stack at full width, not the full "
                                      "model)" if report["args"].get("layers") else "") + ".\n")


RENDERERS = {
    "attention-backends": attention_backends,
    "attention-same-kernel": attention_same_kernel,
    "attention-router": attention_router,
    "sage-backend": sage_backend,
    "sage-kernels": sage_kernels,
    "sage-sweep": sage_sweep,
    "sage-pipelines": sage_pipelines,
    "offload-summary": offload_summary,
    "offload-budget-window": offload_budget_window,
    "distributed-summary": distributed_summary,
    "distributed-example": distributed_example,
    "quant-offload": quant_offload,
}


def render_page(text: str) -> str:
    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in RENDERERS:
            raise KeyError(f"docs table {name!r} has no renderer; known: {', '.join(RENDERERS)}")
        return match.group(1) + RENDERERS[name]() + match.group(4)

    return MARKER.sub(fill, text)


def pages() -> list[Path]:
    return [p for p in sorted((ROOT / "docs").rglob("*.md")) if MARKER.search(p.read_text())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale tables, change nothing")
    args = parser.parse_args()
    stale = []
    for page in pages():
        text = page.read_text()
        rendered = render_page(text)
        if rendered != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(rendered)
    verb = "stale" if args.check else "rewritten"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "docs tables match the results")
    if args.check and stale:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
