"""Render the measured-number tables of ``docs/`` from the committed results, so no number there is typed by hand.

It also writes ``PYPI.md``, the README as the package page shows it (``pypi_description``).

Each table sits between ``<!-- results: NAME -->`` and ``<!-- /results -->`` in a docs page; this script rewrites
what is between the markers. ``--check`` only reports stale tables (a test runs it).

Results are read through the suite registry (``benchmarks/registry.py``, ``benchmarks/results_io.py``): a reference
``"suite"`` is that suite's ``latest.json``; ``"suite@run-id"`` pins one run (a table of past runs), found in the
suite's ``archive/`` or, while it is still the latest, as the latest.

    python -m benchmarks.docs_tables            # rewrite
    python -m benchmarks.docs_tables --check    # exit 1 when a table differs from the results
"""

from __future__ import annotations

import argparse
import json
import re
from functools import cache
from pathlib import Path

from benchmarks import host_auto_cgroup, pipeline_offload_bench, registry, results_io
from benchmarks.derive_routing import distinct_exact, routed_choices
from benchmarks.quant_offload_check import PIPELINE_CHECKS

ROOT = results_io.ROOT
RESULTS = results_io.RESULTS

from diffusers_omni.attention.routing import load_table

GiB = 2**30
MARKER = re.compile(r"(<!-- results: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
DENSE = ("TORCH_SDPA", "CUDNN_ATTN", "FLASH_ATTN", "FLASHINFER_ATTN")


def _run(ref: str) -> tuple[str, str]:
    suite, _, run = ref.partition("@")
    registry.owner(suite)  # a KeyError naming every suite when ``suite`` is not one
    return suite, run or results_io.LATEST


def path_of(ref: str) -> Path:
    """The JSON of the run ``ref`` names (``"suite"`` or ``"suite@run-id"``)."""
    return results_io.find(*_run(ref), root=RESULTS)


@cache
def result(ref: str) -> dict:
    """The payload of the run ``ref`` names."""
    return results_io.read(path_of(ref))["payload"]


def cite(ref: str, suffix: str = ".md") -> str:
    """Where the run ``ref`` names is, for the docs: its path under ``benchmarks/results/`` with ``suffix``."""
    return path_of(ref).relative_to(RESULTS).with_suffix(suffix).as_posix()


def provenance(ref: str) -> str:
    """What a reader must know about the run ``ref`` names before trusting it, said beside it: its date when the run
    did not record it, and a tree with uncommitted changes when it ran from one (``""`` otherwise)."""
    meta = results_io.read(path_of(ref))["meta"]
    notes = []
    if meta.get("date") == results_io.UNKNOWN:
        notes.append("run date unknown")
    if meta.get("dirty") is True:
        notes.append(f"run from a tree with uncommitted changes on {meta['commit'][:7]}")
    return f" ({'; '.join(notes)})" if notes else ""


def source(ref: str, suffix: str = ".md") -> str:
    """``cite(ref, suffix)`` in a code span, with ``provenance(ref)`` beside it: how every rendered table names its
    run."""
    return f"`{cite(ref, suffix)}`{provenance(ref)}"


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
    results = result("attention")
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
    for shape in result("attention")["shapes"]:
        same = {n: r["tflops"] for n, r in shape["results"].items()
                if n == "FLASH_ATTN" or r.get("runs_as") or n.endswith("→ FLASH_ATTN)")}
        if len(same) > 1:
            low, high = min(same.values()), max(same.values())
            rows.append([shape["shape"], len(same), f"{low:.0f}–{high:.0f}", f"{(high - low) / low:.1%}"])
    return table(["Shape", "timings of the FA3 kernel", "TFLOP/s", "spread"], rows)


def attention_router() -> str:
    rows = []
    for shape in result("attention")["shapes"]:
        for name, row in shape["results"].items():
            if name.startswith("platform default end to end"):
                target = name.split("→ ")[1].rstrip(")")
                direct = shape["results"][target]["tflops"]
                rows.append([shape["shape"], target, f"{row['tflops']:.0f}", f"{direct:.0f}"])
    return table(["Shape", "routed to (in that run)", "through the router", "backend called directly"], rows)


# SageAttention ----------------------------------------------------------------------------------------------------

def sage_backend() -> str:
    rows = []
    for shape in result("attention")["shapes"]:
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
            for k in result("sage")["kernels"]]
    return table(["Shape", "SDPA TFLOP/s", "sageattn TFLOP/s", "ratio", "SDPA rel err", "sageattn rel err"], rows)


def sage_sweep() -> str:
    rows = [[s["kv_len"], s["padding_rows"], f"{s['predicted_rel_err']:.3g}", f"{s['sageattn_rel_err']:.3g}"]
            for s in result("sage")["kv_sweep"]]
    return table(["KV length", "padded rows", "predicted rel err (padding only)", "measured rel err"], rows)


def sage_pipelines() -> str:
    rows = []
    for p in result("sage")["pipelines"]:
        guarded = ", ".join(p["short_kv_guarded_roles"]) or "none"
        calls = ", ".join(f"{n} × KV {kv}" for kv, n in p["sage_kernel_calls_by_kv_len"].items())
        rows.append([p["pipeline"], p["config"], f"{p['latent_rel_err_vs_sdpa']:.1e}", calls, guarded])
    return table(["Pipeline", "Config", "latent rel err vs TORCH_SDPA", "sageattn calls", "kept on TORCH_SDPA"], rows)


# Offload ----------------------------------------------------------------------------------------------------------

def _variants(name: str) -> tuple[dict, dict[str, dict]]:
    entry = result(name)["models"][0]
    return entry, {v["variant"]: v for v in entry["variants"]}


OFFLOAD_SUMMARY_RUNS = (
    ("offload-flux", "FLUX.1-dev size", "omni layerwise"),
    ("offload-flux-budget", "FLUX.1-dev size", "omni layerwise 12GiB"),
    ("offload-wan", "Wan2.2-14B size", "omni layerwise"),
)


def offload_plot_data() -> list[dict]:
    """The bars of the offload plot: exactly the runs and variants of the offload-summary table."""
    bars = []
    for name, label, variant_name in OFFLOAD_SUMMARY_RUNS:
        entry, variants = _variants(name)
        group = f"{label}\n{variant_name.removeprefix('omni ')}"
        chosen = [(variant_name, variants[variant_name])]
        chosen += [(n, v) for n, v in variants.items() if n.startswith("diffusers")]
        chosen.append(("resident", variants["resident"]))
        for variant, v in chosen:
            bars.append({"group": group, "variant": variant, "step_s": round(v["step_s"], 3),
                         "peak_gib": round(v["peak_device_bytes"] / GiB, 2), "target_s": round(v["target_step_s"], 3)
                         if "target_step_s" in v else None, "run": name})
    return bars


def offload_summary() -> str:
    rows = []
    for name, label, variant_name in OFFLOAD_SUMMARY_RUNS:
        entry, variants = _variants(name)
        variant = variants[variant_name]
        diffusers = [v for n, v in variants.items() if n.startswith("diffusers")]
        rows.append([f"{label} ({gib(entry['param_bytes'])})", variant_name, f"{variant['step_s']:.3f}",
                     f"{variant['target_step_s']:.3f}", "yes" if variant["meets_step_target"] else "NO",
                     gib(variant["peak_device_bytes"]), " / ".join(f"{v['step_s']:.3f}" for v in diffusers) or "—",
                     f"{variants['resident']['step_s']:.3f}", f"{source(name)}"])
    return table(["Model", "Variant", "Step (s)", "Target (s)", "Meets", "Peak device",
                  "Diffusers (record_stream off / on)", "Resident", "Run"], rows)


# The runs of the 12 GiB budget, oldest first, each under the rule of its day (pinned: a new run adds a row).
OFFLOAD_BUDGET_HISTORY = (
    "offload-flux@undated-4ef43f8-offload_h200_flux",
    "offload-distributed-flux@undated-9f84c58-offload_h200_flux_budget_distributed",
    "offload-flux-budget@undated-a1b25b3-offload_h200_flux_budget",
    "offload-flux-budget@undated-670eae7-offload_h200_flux_budget_largest_first_uncapped",
    "offload-flux-budget@undated-bc75378-offload_h200_flux_budget_run_cap",
)


def offload_lossless() -> str:
    """compression="lossless" on the H200 (offload-side-by-side's current FLUX.1-dev-size run) and the code's ratio on
    trained and random weights (codec-ratio, CPU)."""
    run = result("offload-side-by-side")
    report = next(r for name, r in run["runs"].items() if name.startswith("current-flux"))
    variants = {v["variant"]: v for v in report["models"][0]["variants"]}
    plain, coded = variants["omni layerwise"], variants["omni layerwise lossless"]
    rows = [[label, f"{v['step_s']:.3f} s", f"{v['step_s'] / v['stream_floor_s']:.2f}", gib(v.get("moved_bytes",
             v["streamed_bytes"])), gib(v["peak_device_bytes"]), f"{v['setup_s']:.1f} s",
             "yes" if v.get("same_output_as_resident") else "NO"]
            for label, v in (("layerwise", plain), ('layerwise, compression="lossless"', coded))]
    text = (f"**FLUX.1-dev size**, one transformer forward, NVIDIA H200; {source('offload-side-by-side')}\n\n"
            + table(["Offload", "Step", "÷ bf16 floor", "Moved per step", "Device peak", "Enable", "Same output as "
                     "resident"], rows)
            + f"\nCoded to {coded['coded_ratio']:.3f} of the bf16 bytes, decoded by the {coded['decode_kernel']}; "
              f"the bf16 floor is the streamed bf16 bytes over the measured host→device bandwidth "
              f"({plain['stream_floor_s']:.3f} s).\n\n")
    codec_run = result("codec-ratio")
    ratio = codec_run["rows"]
    dfloat11 = all("dfloat11_ratio" in r for r in ratio)
    rows = [[r["source"], r["kind"], f"{r['weights']:,}", f"{r['exponent_entropy_bits']:.2f}",
             f"{r['ideal_ratio']:.3f}", f"{r['ratio']:.3f}"] + ([f"{r['dfloat11_ratio']:.3f}"] if dfloat11 else [])
            for r in ratio]
    text += (f"The code's size on trained weights (shipped in PyPI wheels) and random ones, CPU; "
             f"{source('codec-ratio')}\n\n"
             + table(["Weights of", "Kind", "Weights", "Exponent entropy (bits)", "Ideal", "Code"]
                     + ([f"DFloat11 {codec_run['dfloat11']}"] if dfloat11 else []), rows))
    if not dfloat11:
        return text
    rate = sum(r["dfloat11_seconds"] for r in ratio) / sum(r["weights"] for r in ratio) * 1e6
    flux = result("pipeline-offload-flux-auto")["components"]["transformer"]["params"]
    return text + (f"\nDFloat11's own encoder, on one core of this CPU: {rate:.2f} s per million weights, so about "
                   f"{rate * flux / 1e6 / 3600:.1f} hours for the FLUX.1-dev transformer's {flux / 1e9:.1f} billion "
                   f"weights ({source('pipeline-offload-flux-auto')}'s count).\n")


MODEL_NAMES = {"flux": "FLUX.1-dev", "qwen": "Qwen-Image", "wan": "Wan2.2-T2V-A14B"}


def offload_auto(scenario: str = "pipeline-offload-flux-auto") -> str:
    """``max_device_memory="auto"`` on a whole pipeline (pipeline-offload-flux-auto, -flux-auto-peers, -qwen-auto,
    -wan-auto; pipeline-offload-flux-lossless for the lossless runs): what each run chose, against resident where the
    run has one, and whether the image stayed the resident one."""
    report = result(scenario)
    by = {r["strategy"]: r for r in report["strategies"]}
    reference = by.get("resident")
    stand_in = reference is None and by.get("omni", {}).get("status") == "ok"
    if stand_in:  # no resident run: omni with no budget is the image every other run must keep
        reference = by["omni"]
    rows = []
    for name, row in by.items():
        if row.get("status") != "ok":
            continue
        plan = row.get("omni_plan") or {}
        chosen = gib(plan["planned_budget_bytes"]) if plan.get("planned_budget_bytes") else (
            "none (two-block window)" if name.startswith("omni") else "")
        same = ("reference (no budget; no resident run)" if row is reference and stand_in else "reference"
                if row is reference else "n/a (no resident run)" if reference is None
                else "yes" if row["sha256"] == reference["sha256"] else "**no**")
        rows.append([name, chosen, f"{row['end_to_end_s']:.2f} s", f"{row['phases']['decode_s']:.2f} s",
                     f"{gib(row['device_peak_allocated'])} / {gib(row['device_peak_reserved'])}", same])
    card = next(r["card_bytes"] for r in report["strategies"] if r.get("card_bytes"))
    verdict = pipeline_offload_bench.auto_against_sweep(pipeline_offload_bench.budget_sweep(report)["rows"])
    auto = by.get("omni-auto")
    if reference is not None and not stand_in and auto is not None and auto.get("status") == "ok" and not verdict:
        verdict = (f"omni-auto {auto['end_to_end_s']:.2f} s against resident {reference['end_to_end_s']:.2f} s: "
                   f"**{auto['end_to_end_s'] / reference['end_to_end_s']:.3f}×**.")
    return (f"**{MODEL_NAMES.get(report['model'], report['model'])}**, {report['steps']} steps, card emulated at "
            f"{gib(card)}, {report['environment']['device_name']}; {source(scenario)}\n\n"
            + table(["Run", "Budget (auto: its choice)", "End to end", "VAE decode", "Device peak (allocated / "
                     "reserved)", "Same image as resident"], rows)
            + (f"\n{verdict}\n" if verdict else ""))


def lossless_pool() -> str:
    """The lossless code's device buffers and the caching allocator (lossless-pool-probe): step, peaks, bitwise."""
    report = result("lossless-pool-probe")
    rows = [[r["run"], f"{r['step_s']:.3f} s", f"{r.get('of_resident', 1.0):.3f}", gib(r["allocated"]),
             gib(r["reserved"]), "yes" if r["bitwise"] else "**no**"] for r in report["runs"]]
    return (f"A FLUX.1-dev-width transformer of {report['double']} + {report['single']} blocks "
            f"({gib(report['weights_bytes'])} bf16), {report['tokens']} image tokens, no budget unless said, "
            f"{report['device']}; {source('lossless-pool-probe')}\n\n"
            + table(["Run", "Step", "÷ resident", "Max allocated", "Max reserved", "Same output as resident"], rows))


def vae_workspace() -> str:
    """The FLUX.1 VAE (and a transformer slice) under less and less free device memory (vae-workspace-probe): time,
    peak and whether the bits stay those with everything free. Only the VAE rows, where the bits move."""
    report = result("vae-workspace-probe")
    rows = [[r["what"], "on" if r["cudnn_benchmark"] else "off", "all" if r["free_gib"] is None else
             f"{r['free_gib']:g} GiB", "out of memory" if r.get("seconds") is None else f"{r['seconds'] * 1e3:.1f} ms",
             "yes" if r.get("same") else "" if r.get("seconds") is None else "**no**"]
            for r in report["rows"] if r["what"].startswith("VAE")]
    return (f"{report['device']}, cuDNN {report['cudnn']}, one process capped at {report['card_gib']:g} GiB, ballast "
            f"leaving the free memory shown; {source('vae-workspace-probe')}\n\n"
            + table(["Decode", "cudnn.benchmark", "Free under the cap", "Time", "Same bits as with all free"], rows))


def offload_host_auto_cgroup() -> str:
    """``max_host_memory="auto"`` under a memory cgroup the kernel enforces (host-auto-cgroup)."""
    report = result("host-auto-cgroup")
    header, rows = host_auto_cgroup.table_rows(report)
    return (f"{host_auto_cgroup.describe(report)} {source('host-auto-cgroup')}\n\n" + table(header, rows)
            + f"\n{host_auto_cgroup.NOTE}\n\n**{report['verdict']}**\n")


def offload_budget_window() -> str:
    rows = []
    for name in OFFLOAD_BUDGET_HISTORY:
        _, variants = _variants(name)
        budget = next(v for n, v in variants.items() if n.startswith("omni layerwise ") and "GiB" in n)
        rows.append([f"{source(name)}", f"{budget['step_s']:.3f}", f"{budget['target_step_s']:.3f}",
                     "yes" if budget["meets_step_target"] else "NO"])
    return table(["Run (oldest first)", "12 GiB budget step (s)", "target (s)", "meets"], rows) + (
        "\nRuns in order: fixed slots; plus free-room prefetch; plus the byte-counted window; resident blocks "
        f"chosen largest first ({_resident_count(OFFLOAD_BUDGET_HISTORY[3])} of them, "
        "the double blocks in one run); largest first with no resident run larger than the window (the current "
        "rule).\n")


def _resident_count(name: str) -> int:
    _, variants = _variants(name)
    return next(v["resident_blocks"] for n, v in variants.items() if "GiB" in n)


def distributed_summary() -> str:
    names = (("offload-distributed-flux", "FLUX.1-dev size"),
             ("offload-distributed-wan", "Wan 14B size"))
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
    _, variants = _variants("offload-distributed-flux")
    layerwise = variants["omni layerwise"]
    streamed, largest = layerwise["streamed_bytes"], layerwise["slot_bytes"]
    return (
        f"FLUX.1-dev ({gib(streamed)} of bf16 blocks, {layerwise['streamed_blocks']} blocks; the largest is "
        f"S = {gib(largest)}) on {ranks} ranks: ≈{gib(streamed / ranks)} pinned per rank and "
        f"≈{gib(2 * largest + 2 * largest / ranks)} of block weights per GPU (2 × {gib(largest)} slots + 2 × "
        f"{gib(largest / ranks)} staging). Computed from the blocks measured in {source('offload-distributed-flux', '')}; "
        "only N = 1 was run.\n"
    )


# GPUs × backends (from the backends' declared capabilities, not measured) ---------------------------------------

GPUS = (
    ("Ampere: A100, A30", (8, 0)),
    ("Ampere: RTX 30xx, A10, A40", (8, 6)),
    ("Ada: RTX 40xx, L4, L40S", (8, 9)),
    ("Hopper: H100, H200, GH200", (9, 0)),
    ("Blackwell: B200, GB200", (10, 0)),
    ("Blackwell: B300, GB300", (10, 3)),
    ("Blackwell: RTX 50xx, RTX PRO 6000", (12, 0)),
)


def gpu_backends() -> str:
    """Which backend can run on which GPU, from each backend's declared device and compute-capability limits
    (package checks left out: the column says what to install)."""
    from diffusers_omni.attention.backends.flash import IMPLEMENTATIONS
    from diffusers_omni.attention.platform import Platform
    from diffusers_omni.attention.registry import get_backend_class, registered_backend_names

    names = [n for n in registered_backend_names() if "cuda" in get_backend_class(n).devices]
    rows = []
    for label, cc in GPUS:
        platform = Platform(device_type="cuda", device_name=label, compute_capability=cc, cudnn_version=91900)
        cells = []
        for name in names:
            if name == "FLASH_ATTN":
                usable = [impl.label for impl in IMPLEMENTATIONS if cc >= impl.min_compute_capability and (
                          impl.compute_capabilities is None or cc in impl.compute_capabilities)]
                cells.append(", ".join(usable) or "—")
                continue
            reasons = [r for r in get_backend_class(name).availability_reasons(platform) if "not importable" not in r]
            cells.append("—" if reasons else "✓")
        rows.append([f"{label} (sm_{cc[0]}{cc[1]})", *cells])
    return table(["GPU", *(f"`{n}`" for n in names)], rows)


def diffusers_names() -> str:
    """Diffusers' attention backend names and what each becomes here (the families' aliases, ``config/names.py``)."""
    from diffusers_omni.attention.registry import DIFFUSERS_BACKEND_NAMES

    rows = [[f"`{e.diffusers}`", f"`{e.omni}`" if e.omni else "refused", e.note] for e in DIFFUSERS_BACKEND_NAMES]
    return table(["Diffusers name", "diffusers-omni", "Note"], rows)


# README: why this -------------------------------------------------------------------------------------------------

def _speedup(ours: float, theirs: float) -> str:
    return f"{theirs / ours:.2f}× faster"


def _delta_bytes(ours: int, theirs: int) -> str:
    """``ours`` against ``theirs`` in words: "same" only when the bytes are equal."""
    diff = ours - theirs
    if diff == 0:
        return "same"
    size = f"{abs(diff) / 2**20:.0f} MiB" if abs(diff) < GiB else f"{abs(diff) / GiB:.2f} GiB"
    return f"{size} {'lower' if diff < 0 else 'higher'} ({abs(diff) / theirs:.1%})"


# The README's offload claims: the plot's runs (``OFFLOAD_SUMMARY_RUNS``) whose omni variant is the default window,
# so the README's table, its "What it costs" section and ``offload_summary.png`` show the same rows of the same runs.
README_SCALES = {"FLUX.1-dev size": "1024²", "Wan2.2-14B size": "480p × 33 frames"}
README_OFFLOAD_RUNS = tuple((name, label) for name, label, variant in OFFLOAD_SUMMARY_RUNS if variant == "omni layerwise")
README_BUDGET_RUN = next((name, label, variant) for name, label, variant in OFFLOAD_SUMMARY_RUNS
                         if variant != "omni layerwise")


def _readme_offload(name: str) -> tuple[dict, dict, list[dict], dict]:
    """(model entry, omni layerwise, Diffusers' group-offload variants in run order, resident) of one run."""
    entry, variants = _variants(name)
    theirs = [v for n, v in variants.items() if n.startswith("diffusers")]
    return entry, variants["omni layerwise"], theirs, variants["resident"]


def readme_wins() -> str:
    """The first-screen table of the README: omni layerwise against what Diffusers itself offers, from the runs the
    plot below it draws (same runs, same rows)."""
    rows = []
    for name, label in README_OFFLOAD_RUNS:
        entry, ours, theirs, _ = _readme_offload(name)
        scale = f"{label} ({gib(entry['param_bytes'])} bf16), {README_SCALES[label]}"
        best = min(theirs, key=lambda v: v["step_s"])
        rows.append([f"{scale}: one transformer forward, offloaded", f"**{ours['step_s']:.3f} s** "
                     "(`enable_layerwise_offload`)",
                     " / ".join(f"{v['step_s']:.3f} s" for v in theirs) + " (`enable_group_offload`, block level, "
                     "streams; `record_stream` off / on)",
                     f"{_speedup(ours['step_s'], best['step_s'])} (Diffusers' faster variant ÷ omni, per forward)"])
        rows.append([f"{scale}: peak GPU memory while offloaded", gib(ours["peak_device_bytes"]),
                     " / ".join(gib(v["peak_device_bytes"]) for v in theirs),
                     _delta_bytes(ours["peak_device_bytes"], min(v["peak_device_bytes"] for v in theirs))])
        first, again = theirs[0], theirs[-1]
        rows.append([f"{scale}: enable offloading, first time in the process", f"{ours['setup_s']:.1f} s",
                     f"{first['setup_s']:.1f} s", f"{_speedup(ours['setup_s'], first['setup_s'])} the first time only: "
                     f"Diffusers' next enable in the same process took {again['setup_s']:.2f} s"])
    check = result("gpu-pipeline-check")
    same = [k for k, v in check.items() if isinstance(v, dict) and v.get("bitwise_equal_to_stock")]
    rows.append(["FLUX.1 pipeline output, omni attention vs Diffusers' processors",
                 f"bitwise equal ({len(same)} configs, max abs diff "
                 f"{max(check[k]['max_abs_diff'] for k in same)})", "—", "no accuracy cost"])
    env = result(README_OFFLOAD_RUNS[0][0])["environment"]
    runs = ", ".join(f"{label.split(' ')[0]}: {source(name, '.json')}" for name, label in README_OFFLOAD_RUNS)
    return table(["Measured on one " + env["device_name"], "diffusers-omni", "Diffusers", ""], rows) + (
        f"\ntorch {env['torch']}, diffusers {env['diffusers']}; one transformer forward per step, median of repeats; "
        f"from `benchmarks/results/`: {runs} and {source('gpu-pipeline-check', '.json')}. The plot below draws the same "
        "rows "
        "of the same runs.\n")


def readme_costs() -> str:
    """The README's "What it costs": offloaded against resident, host memory, device peak, enable time first and
    again, from the same runs as ``readme_wins`` (one column per run) and the plot's budget run."""
    runs = [(name, label, *_readme_offload(name)) for name, label in README_OFFLOAD_RUNS]

    def each(cell) -> list[str]:
        return [cell(entry, ours, theirs, resident) for _, _, entry, ours, theirs, resident in runs]

    def ratio(v: dict, resident: dict) -> str:
        return f"{v['step_s']:.3f} s ({v['step_s'] / resident['step_s']:.2f}×)"

    rows = [
        ["Model (bf16 parameters)", *each(lambda e, o, t, r: gib(e["param_bytes"]))],
        ["One transformer forward, whole model resident on the GPU",
         *each(lambda e, o, t, r: f"{r['step_s']:.3f} s")],
        ["One forward offloaded, `enable_layerwise_offload` (÷ resident)", *each(lambda e, o, t, r: ratio(o, r))],
        ["One forward offloaded, Diffusers' `enable_group_offload`, `record_stream` off / on (÷ resident)",
         *each(lambda e, o, t, r: " / ".join(ratio(v, r) for v in t))],
        ["Peak GPU memory: resident / layerwise / group offload", *each(lambda e, o, t, r: " / ".join(
            gib(v["peak_device_bytes"]) for v in (r, o, t[0])))],
        ["Host memory (process RSS), peak during enable: layerwise / group offload",
         *each(lambda e, o, t, r: f"{gib(o['host_rss_peak_setup'])} / {gib(t[0]['host_rss_peak_setup'])}")],
        ["Host memory (process RSS) after enable, held while offloaded: layerwise / group offload",
         *each(lambda e, o, t, r: f"{gib(o['host_rss_after_setup'])} / {gib(t[0]['host_rss_after_setup'])}")],
        *([["Host memory (process RSS) while steps run: layerwise / group offload",
            *each(lambda e, o, t, r: f"{gib(o['host_rss_steady'])} / {gib(t[0]['host_rss_steady'])}")],
           ["Page-locked host memory holding the weights (pinned or registered): layerwise / group offload",
            *each(lambda e, o, t, r: " / ".join(gib(max(v["pinned_host_bytes"], v["registered_host_bytes"]))
                                                for v in (o, t[0])))]]
          # Runs of offload_bench before these were recorded lack them.
          if all("host_rss_steady" in v for *_, o, t, r in runs for v in (o, t[0])) else []),
        ["Enable, first time in the process: layerwise / group offload",
         *each(lambda e, o, t, r: f"{o['setup_s']:.1f} s / {t[0]['setup_s']:.1f} s")],
        ["Enable again on the same model in the same process: group offload",
         *each(lambda e, o, t, r: f"{t[-1]['setup_s']:.2f} s")],
    ]
    env = result(runs[0][0])["environment"]
    header = [f"Cost ({env['device_name']})", *(f"{label} ({source(name, '')})" for name, label, *_ in runs)]
    name, label, variant = README_BUDGET_RUN
    _, budget_variants = _variants(name)
    budget, default, resident = (budget_variants[n] for n in (variant, "omni layerwise", "resident"))
    limit = variant.removeprefix("omni layerwise ")
    return table(header, rows) + (
        "\nHost memory is the benchmark process's resident set, which holds the model's weights on the host before "
        "enable (they start there); layerwise registers those pages for DMA in place, group offload copies them into "
        "pinned buffers, and Diffusers keeps them after its hooks are removed, which is why its next enable is "
        f"quick. With a budget, `max_device_memory=\"{limit}\"` ({label}, {source(name, '')}): one forward "
        f"{budget['step_s']:.3f} s ({budget['step_s'] / resident['step_s']:.2f}× the resident {resident['step_s']:.3f} "
        f"s), peak {gib(budget['peak_device_bytes'])}, {budget['resident_blocks']} of "
        f"{budget['resident_blocks'] + budget['streamed_blocks']} blocks kept on the GPU. Layerwise pays its enable "
        f"every time: in that run the default window enabled in {default['setup_s']:.1f} s, then the budget on the same "
        f"model in {budget['setup_s']:.1f} s.\n")


E2E_ATTENTION = "hopper-e2e"
LOSSY_BACKENDS = ("RAINFUSION_ATTN", "SAGE_ATTN", "SAGE_ATTN_3")
LOSSY_NAMES = ("FP8", "RainFusion", "Sage", "sparse")


def e2e_attention() -> str:
    """End-to-end seconds per denoising step under Diffusers' own attention backends and ours, when measured.

    Reads the payload of ``benchmarks/results/hopper-e2e/latest.json`` ({"device", "torch", "script", "models":
    {label: {"tokens", "baseline", "steps": {variant: seconds}, "omni_backends": {variant: {role: {"backend",
    "fp8_routes"}}}, "rel_err": {variant: relative error of the output against the baseline}}}}); renders nothing
    while the suite has no result. An exact variant whose output this run did not compare takes its difference from
    native from the ``quality`` run, where that run measured the same kernels.
    """
    path = results_io.run_path(E2E_ATTENTION, root=RESULTS)
    if not path.exists():
        return ""
    quality_path = results_io.run_path("quality", root=RESULTS)
    quality = results_io.read(quality_path)["payload"] if quality_path.exists() else None
    return render_e2e_attention(results_io.read(path)["payload"], quality, source(E2E_ATTENTION, ".json"))


def e2e_lossy(entry: dict, variant: str) -> bool | None:
    """Whether ``variant`` ran a lossy kernel: from the backends the run recorded (an FP8 spec whose every call was
    routed to bf16 ran none; ``None``), else from its name."""
    backends = entry.get("omni_backends", {}).get(variant)
    if backends is not None:
        if any(role["backend"] in LOSSY_BACKENDS or any(role.get("fp8_routes", {}).values())
               for role in backends.values()):
            return True
        if any(role.get("fp8_routes") for role in backends.values()):
            return None
        return False
    return any(word in variant for word in LOSSY_NAMES)


# Diffusers' backend names (the last word of an e2e variant "Diffusers <name>") and the kernel of ours each runs.
DIFFUSERS_KERNELS = {"native": "TORCH_SDPA", "_flash_3": "FLASH_ATTN", "_native_cudnn": "CUDNN_ATTN"}


def e2e_kernels(entry: dict, variant: str) -> frozenset[str] | None:
    """The attention backends ``variant`` ran, from what the run recorded, else from Diffusers' backend name
    (``None`` when neither says)."""
    backends = entry.get("omni_backends", {}).get(variant)
    if backends is not None:
        return frozenset(role["backend"] for role in backends.values())
    name = variant.split()[-1]
    if variant.startswith("Diffusers") and name in DIFFUSERS_KERNELS:
        return frozenset({DIFFUSERS_KERNELS[name]})
    return None


def _native_difference(quality: dict | None, tokens: int, kernels: frozenset[str] | None) -> tuple[str, float] | None:
    """``(candidate, output rel. error vs native)`` of the ``quality`` run's exact candidate that ran ``kernels``
    at ``tokens`` tokens, if that run measured one."""
    if quality is None or not kernels:
        return None
    for entry in quality.get("full_size", {}).values():
        if entry.get("tokens") != tokens:
            continue
        for name, cand in entry.get("candidates", {}).items():
            ran = cand.get("candidate", {}).get("backends", [])
            if (ran and "output_rel_err" in cand and not any(b["lossy"] for b in ran)
                    and frozenset(b["backend"] for b in ran) == kernels):
                return name, cand["output_rel_err"]
    return None


def render_e2e_attention(data: dict, quality: dict | None = None, run: str = "") -> str:
    """No lossy speed-up without its error beside it: a lossy variant with no measured error shows its step time
    only, unbolded, and points at the quality page. No exact variant is called error-free unless its output was
    compared: an exact kernel other than the baseline's says how far from native its output was (this run's error,
    else the ``quality`` run's for the same kernels), or that it was not compared."""
    rows = []
    for model, entry in data["models"].items():
        base = entry["steps"][entry["baseline"]]
        errors = entry.get("rel_err", {})
        lossy = {v: e2e_lossy(entry, v) for v in entry["steps"]}
        shown = {v: s for v, s in entry["steps"].items() if not lossy[v] or v in errors}
        fastest = min(shown.values())
        baseline_kernels = e2e_kernels(entry, entry["baseline"])
        for variant, seconds in entry["steps"].items():
            label = variant + (" (baseline)" if variant == entry["baseline"] else "")
            if variant not in shown:
                rows.append([model, f"{entry['tokens']:,}", label, f"{seconds:.3f}", "—",
                             "lossy; error: see quality page"])
                continue
            kernels = e2e_kernels(entry, variant)
            other = _native_difference(quality, entry["tokens"], kernels)
            routed = " (no call routed to FP8 at this size)" if lossy[variant] is None else ""
            if variant == entry["baseline"]:
                error = "— (the baseline)"
            elif variant in errors:
                error = f"rel err {errors[variant]:.1e}"
            elif kernels is not None and kernels == baseline_kernels:
                error = (f"same kernel as the baseline ({', '.join(sorted(kernels))}){routed}; output not compared "
                         "in this run")
            elif other is not None:
                error = (f"exact kernel{routed}, {other[1]:.2%} from native (quality run, "
                         f"{other[0].removesuffix(' (exact)')})")
            else:
                error = f"exact kernel{routed}; output not compared with the baseline's"
            rows.append([model, f"{entry['tokens']:,}", label,
                         f"**{seconds:.3f}**" if seconds == fastest else f"{seconds:.3f}", f"{base / seconds:.2f}×",
                         error])
    where = f"; {run}" if run else ""
    return table(["Model", "Tokens", "Attention", "Step (s)", "Speed-up (baseline step ÷ this step)",
                  "Error vs baseline"], rows) + (
        f"\nEnd to end, one denoising step (one transformer forward, random weights), {data['device']}, torch "
        f"{data['torch']}; `{data['script']}`{where}; bold = fastest with its error known. A lossy mode's speed-up is "
        "shown only beside its measured error; \"quality run\": the output's relative error against Diffusers' native "
        "attention in the run of the next table.\n")


# Hopper lossy paths (FP8, block-sparse) -----------------------------------------------------------------------

def _fp8_routed(row: dict) -> str:
    from diffusers_omni.attention.routing import fp8_choice

    hopper = result("hopper")
    chosen = fp8_choice(load_table(), hopper["platform"]["family"], row["Sq"], row["Skv"], row["D"], row["masked"])
    return "FP8" if chosen else "bf16"


def fp8_kernels() -> str:
    hopper = result("hopper")
    rows = []
    for row in hopper["fp8"]:
        dims_ = f"{row['B']}×{row['H']}×{row['Sq']}×{row['Skv']}×{row['D']}"
        if row.get("speedup") is None:
            rows.append([f"{row['shape']} {dims_}", "—", "—", "—", "—", "bf16 (masked)", "—", "—"])
            continue
        routed = _fp8_routed(row)
        routed_ms = row["fp8_whole_ms"] if routed == "FP8" else row["bf16_ms"]
        rows.append([f"{row['shape']} {dims_}", f"{row['bf16_ms']:.3f}", f"{row['quant_ms']:.3f}",
                     f"{row['fp8_whole_ms']:.3f}", f"{row['speedup']:.2f}×",
                     f"{routed} ({row['bf16_ms'] / routed_ms:.2f}×)", f"{row['rel_err_fp8']:.1e}",
                     f"{row['rel_err_bf16']:.1e}"])
    return table(["Shape (B×H×Sq×Skv×D)", "FA3 bf16 ms", "quantisation ms", "FP8 whole call ms", "FP8 / bf16",
                  "routed (÷ bf16 time)", "rel err FP8", "rel err bf16"], rows) + (
        f"\n{hopper['device']}, torch {hopper['torch']}, {hopper['date']}; Gaussian inputs, relative error against an "
        "fp32 reference. \"FP8 whole call\" includes the quantisation; \"routed\" is what `FLASH_ATTN` with `quant` runs "
        "at that shape under the committed routing table.\n")


def fp8_checks() -> str:
    rows = []
    fp8 = [row for row in result("hopper")["fp8"] if row.get("speedup") is not None]
    emulated = any(row.get("rel_err_fp8_vs_fa3_emulation") is not None for row in fp8)
    for row in fp8:
        cells = [row["shape"], f"{row['kernel_speedup']:.2f}×", f"{row['rel_err_fp8_vs_fake_quant_reference']:.1e}"]
        if emulated:
            cells.append(f"{row['rel_err_fp8_vs_fa3_emulation']:.1e}" if row.get("rel_err_fp8_vs_fa3_emulation")
                         is not None else "—")
        rows.append(cells + [f"{max(row['quant_byte_mismatch'].values()):.1e}", "yes" if row["descales_equal"] else "NO"])
    return table(["Shape", "FP8 kernel alone / bf16", "kernel vs fake-quantised SDPA"]
                 + (["kernel vs FA3-FP8 emulation (1,024 rows)"] if emulated else [])
                 + ["quantised bytes ≠ PyTorch reference", "descales equal"], rows)


def _selection_rule(row: dict) -> str:
    if row.get("mass_threshold") is not None:
        return f"mass ≥ {row['mass_threshold']}"
    return f"top-k ({row['sparsity']})"


def sparse_kernels() -> str:
    hopper = result("hopper")
    rows = []
    staged = any("kernel_ms" in row for row in hopper["sparse"]["timings"])
    for row in hopper["sparse"]["timings"]:
        err = f"{row['rel_err_vs_dense_fp32']:.2f}" if row.get("rel_err_vs_dense_fp32") is not None else "—"
        cells = [f"{row['shape']} 1×{row['H']}×{row['S']}×128", row["layout"], _selection_rule(row),
                 f"{row['kept_fraction']:.0%}", f"{row['dense_fa3_ms']:.3f}", f"{row['sparse_ms']:.3f}",
                 f"**{row['speedup']:.2f}×**"]
        if staged:
            plan = f"{row['plan_ms']:.3f}" if row.get("plan_ms") is not None else "—"
            cells += [f"{row['selection_ms']:.3f} ({row['selection_share_of_kernel']:.1%})",
                      f"{row['layout_copies_ms']:.3f}", plan, f"{row['kernel_ms']:.3f}"]
        else:
            cells.append(f"{row['selection_ms']:.3f} ({row['selection_share']:.0%})")
        rows.append(cells + [f"{row['first_call_ms']:.0f}", err])
    checks = "; ".join(
        f"{c['layout']}: rel err {c['rel_err_vs_mask_sdpa_reference']:.1e}, block masks equal to the float32 "
        f"selection in {c['mask_rows_equal_to_float32_selection']:.0%} of rows" for c in hopper["sparse"]["checks"])
    header = ["Shape", "layout", "selection", "kept", "dense FA3 ms", "block-sparse ms (all included)", "speed-up"]
    header += (["selection ms (÷ kernel)", "Q + output copies ms", "plan ms (per call)", "kernel ms"] if staged
               else ["selection ms (÷ call)"])
    equal = [r["mask_rows_equal_to_float32_selection"] for r in hopper["sparse"]["timings"]
             if r.get("mask_rows_equal_to_float32_selection") is not None]
    if equal:
        checks += (f"; at the timed shapes the kernels' block masks equal the float32 selection in {min(equal):.2%} of "
                   "rows or more")
    heads_major = [r for r in hopper["sparse"]["timings"] if r.get("sparse_ms_heads_major_q") is not None]
    note = "".join(
        f" With Q handed over heads-major (no Q copy), {r['shape']} at sparsity {r['sparsity']}: "
        f"{r['sparse_ms_heads_major_q']:.3f} ms ({r['dense_fa3_ms'] / r['sparse_ms_heads_major_q']:.2f}×)."
        for r in heads_major)
    return table(header + ["first call ms (plan)", "rel err vs dense"], rows) + (
        f"\n{hopper['device']}, torch {hopper['torch']}, {hopper['date']}; Gaussian inputs (the relative error against "
        "dense attention measures how much attention mass the skipped blocks held, not kernel accuracy; on Gaussian "
        "inputs pooled scores are nearly flat, so a mass threshold keeps about that share of the blocks). The kernel "
        f"path against the same block mask applied through SDPA (1×4×8192×128): {checks}.{note}\n")


def hopper_e2e() -> str:
    e2e = result(E2E_ATTENTION)
    rows = []
    for model, entry in e2e["models"].items():
        steps = entry["steps"]
        base = steps[entry["baseline"]]
        dense = steps.get("omni auto")
        for variant, seconds in steps.items():
            lossy = e2e_lossy(entry, variant)
            error = ("lossy: not measured in this run; speed and error of one run in the quality guide's table"
                     if lossy else "none (no call routed to FP8 at this size)" if lossy is None else "none (exact)")
            rows.append([f"{model} ({entry['tokens']:,} tokens)", variant, f"{seconds:.3f}",
                         f"{base / seconds:.2f}×", f"{dense / seconds:.2f}×" if dense else "—", error])
    return table(["Model (random weights, bf16)", "Variant", "s / step", f"÷ Diffusers native", "÷ omni auto (FA3 bf16)",
                  "error"], rows) + f"\n{e2e['device']}, torch {e2e['torch']}, one process (`{e2e['script']}`).\n"


def _step(model_prefix: str, variant: str) -> float:
    models = result(E2E_ATTENTION)["models"]
    entry = next(v for k, v in models.items() if k.startswith(model_prefix))
    return entry["steps"][variant]


def fp8_targets() -> str:
    rows_fp8 = [r for r in result("hopper")["fp8"] if r.get("speedup") is not None]
    long_rows = [r for r in rows_fp8 if min(r["Sq"], r["Skv"]) >= 32000]
    routed_worst = min(r["bf16_ms"] / (r["fp8_whole_ms"] if _fp8_routed(r) == "FP8" else r["bf16_ms"])
                       for r in rows_fp8)
    worst_long = min(r["speedup"] for r in long_rows)
    errs = [r["rel_err_fp8"] for r in rows_fp8]
    wan = _step("Wan", "omni auto") / _step("Wan", "omni FP8")
    rows = [
        ["whole FP8 call ÷ FA3 bf16 at ≥ 32k tokens", "≥ 1.25×", f"{worst_long:.3f}× (worst)", _verdict(worst_long >= 1.25)],
        ["routed FP8 spec ÷ bf16 at every benchmark shape", "≥ 1.00×", f"{routed_worst:.3f}× (worst)",
         _verdict(routed_worst >= 1.0)],
        ["rel err vs fp32, Gaussian inputs", "≤ 5e-2 (goal)", f"{min(errs):.1e}–{max(errs):.1e}", _verdict(max(errs) <= 5e-2)],
        ["Wan-14B-size step, FP8 vs FA3 bf16 (omni auto); lossy: its output error is in the quality guide's table",
         "reported", f"{wan:.3f}×", "—"],
    ]
    return table(["Target (issue 15)", "wanted", "measured", "met"], rows)


def sparse_targets() -> str:
    timings = [r for r in result("hopper")["sparse"]["timings"] if r["shape"].startswith("Wan")]
    top_k = [r for r in timings if r.get("mass_threshold") is None]
    mass = [r for r in timings if r.get("mass_threshold") is not None]

    def worst(sparsity):
        return min(r["speedup"] for r in top_k if r["sparsity"] == sparsity)

    def share(rows):  # the selection against the sparse kernel (older results: against the whole call)
        return max(r.get("selection_share_of_kernel", r["selection_share"]) for r in rows)

    step = _step("Wan", "omni auto") / _step("Wan", "omni RainFusion (sparsity 0.8)")
    rows = [
        ["Wan 480p self, 50% kept, ÷ dense FA3", "≥ 1.5×", f"{worst(0.5):.3f}× (worst layout)", _verdict(worst(0.5) >= 1.5)],
        ["Wan 480p self, 20% kept, ÷ dense FA3", "≥ 3.5×", f"{worst(0.8):.3f}× (worst layout)", _verdict(worst(0.8) >= 3.5)],
        [f"top-k selection time ÷ sparse {'kernel' if any('kernel_ms' in r for r in top_k) else 'call'}", "≤ 10%",
         f"{share(top_k):.1%} (worst)", _verdict(share(top_k) <= 0.10)],
    ]
    if mass:
        # Its per-call plan step is part of what the selection costs.
        cost = max((r["selection_ms"] + (r.get("plan_ms") or 0.0)) / r["kernel_ms"] for r in mass)
        rows.append(["cumulative-mass selection + per-call plan ÷ sparse kernel", "≤ 10%", f"{cost:.1%} (worst)",
                     _verdict(cost <= 0.10)])
    rows.append(["Wan-14B-size step at sparsity 0.8 ÷ dense FA3 step (lossy: its output error is in the quality "
                 "guide's table)", "≥ 1.4×", f"{step:.3f}×", _verdict(step >= 1.4)])
    return table(["Target (issue 15)", "wanted", "measured", "met"], rows)


def fp8_numerics() -> str:
    """What lowers the FP8 error (CPU emulation of FA3's FP8 forward): the error budget and each variant's change."""
    study = result("fp8-numerics")
    variants = list(study["shapes"][0]["gaussian"]["variants"])
    budget_rows, variant_rows = [], []
    for row in study["shapes"]:
        for model, label in (("gaussian", "Gaussian"), ("offsets", "with offsets")):
            cell = row[model]
            base = cell["variants"][variants[0]]
            if model == "gaussian":
                budget_rows.append([row["shape"], *(f"{cell['budget'][s]:.1e}" for s in "QKVP"), f"{base:.2e}",
                                    f"{cell['current_seed1']:.2e}"])
            variant_rows.append([row["shape"], label, f"{base:.2e}",
                                 *(f"{cell['variants'][name] / base - 1:+.1%}" for name in variants[1:])])
    budget = table(["Shape", "Q rounded", "K rounded", "V rounded", "P rounded (in FA3)", "all (emulated)",
                    "all, another seed"], budget_rows)
    changes = table(["Shape", "inputs", "current"] + variants[1:], variant_rows)
    return (budget + "\nChange of the emulated error with each variant of the quantisation (negative: lower):\n\n"
            + changes + f"\nCPU, torch {study['torch']}, {study['date']} (`{study['script']}`): two heads and the "
            "first 256 query rows of each shape, all keys; \"with offsets\": K + N(0, 3²) and V + N(0, 1) per channel.\n")


def _verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


def hopper_latents() -> str:
    latents = result("tiny-latents")
    rows = [[name, mode, f"{m['rel_err']:.1e}", f"{m['psnr_db']:.1f}"]
            for name, entry in latents["pipelines"].items() for mode, m in entry["modes"].items()]
    return table(["Tiny pipeline", "Mode", "latent rel err vs TORCH_SDPA", "PSNR dB"], rows)


def _short_error(error: str) -> str:
    if "CUDA out of memory" in error:  # PyTorch's message: the allocator's whole state; keep the card's limit
        allowed = re.search(r"(\d+(?:\.\d+)? GiB) allowed", error)
        return "CUDA out of memory" + (f" ({allowed.group(1)} allowed)" if allowed else "")
    kind, _, message = error.partition(": ")
    for needle, short in (("is_pinned", "aten.is_pinned not implemented"),
                          ("set the storage", "cannot move the subclass's storage"),
                          ("quant_state", "quant_state not moved")):
        if needle in message:
            return f"{kind}: {short}"
    return kind


# The runs of the current code (each suite's latest): FLUX size with the per-block timings, Wan-14B size in two
# calls (a call's time limit: 8-bit and 4-bit formats), and FLUX size again with the copy-traffic variant.
QUANT_OFFLOAD_FINAL_RUNS = ("quant-offload-flux", "quant-offload-wan", "quant-offload-wan-4bit", "quant-offload-traffic")


# Every quantized offload run the docs show, oldest first (pinned: a new run adds a row): the first full-size FLUX
# run, the Wan-14B-size run, the FLUX re-runs after the device cache is emptied on enable, after each block's views
# are made once, Wan's 4-bit formats, the pass-boundary ("tail") runs, the runs of the current code and the deeper
# window.
QUANT_OFFLOAD_RUNS = (
    "quant-offload-flux@undated-236cdee-quant_offload_h200",
    "quant-offload-wan@undated-e681419-quant_offload_h200_wan",
    "quant-offload-flux@undated-1674e12-quant_offload_h200_after_empty_cache",
    "quant-offload-flux@undated-1aee56d-quant_offload_h200_views_once",
    "quant-offload-wan-4bit@undated-7524368-quant_offload_h200_wan_q4k_nf4",
    "quant-offload-flux@undated-01c220f-quant_offload_h200_tail",
    "quant-offload-flux@undated-e519bc0-quant_offload_h200_tail_overlap",
    "quant-offload-flux@undated-4439600-quant_offload_h200_final",
    "quant-offload-wan@undated-4439600-quant_offload_h200_wan_final",
    "quant-offload-wan-4bit@undated-4439600-quant_offload_h200_wan_final2",
    "quant-offload-traffic@undated-1413dd5-quant_offload_h200_traffic",
    "quant-offload-deeper@undated-aff8ce7-quant_offload_h200_deeper",
)


def quant_offload_current() -> str:
    """Where every format stands with the current code: the last runs, one row per model and format."""
    reports = [(run, result(run)) for run in QUANT_OFFLOAD_FINAL_RUNS]
    rows = _quant_offload_rows(reports)
    met = sum(1 for row in rows if row[7] == "yes")
    return table(_QUANT_OFFLOAD_HEADER, rows) + (
        f"\n{met} of {len(rows)} rows meet every target; the others are explained below. "
        + _quant_offload_note(reports[0][1]))


_QUANT_OFFLOAD_HEADER = ["Model", "Format", "Packed", "Resident step (s)", "Diffusers group offload (s)",
                         "omni layerwise (s)", "Target (s)", "Meets", "Peak omni / Diffusers",
                         "Setup from device / host (s)", "Bitwise = resident", "Run"]


def _quant_offload_note(report: dict) -> str:
    env, versions = report["environment"], report["versions"]
    return (
        f"{env['device_name']}, torch {env['torch']}, torchao {versions['torchao']}, bitsandbytes "
        f"{versions['bitsandbytes']}, gguf {versions['gguf']}; pinned host→device "
        f"{report['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s in the same run; median of {report['args']['repeats']} "
        f"steps after {report['args']['warmup']} warm-up. Target = 1.05 × max(resident step, streamed bytes ÷ "
        "bandwidth); peak ≤ Diffusers' (where it runs); setup ≤ 10 s for FLUX size, enabled from the device (the "
        "model quantized there) and again from the host (after `disable()`), where the run has it"
        + (f" ({report['args']['layers']} block(s) per stack at full width, not the full model)"
           if report["args"].get("layers") else "") + ".\n")


def quant_offload() -> str:
    reports = [(run, result(run)) for run in QUANT_OFFLOAD_RUNS]
    return table(_QUANT_OFFLOAD_HEADER, _quant_offload_rows(reports)) + "\n" + _quant_offload_note(reports[0][1])


def _quant_offload_rows(reports: list[tuple[str, dict]]) -> list[list]:
    rows = []
    for run, report in reports:
        for entry in report["entries"]:
            variants = {v["variant"]: v for v in entry["variants"]}
            resident, omni, diffusers = (variants[n] for n in ("resident", "omni layerwise", "diffusers group_offload"))
            from_host = variants.get("omni layerwise from host", {})
            diffusers_step = f"{diffusers['step_s']:.3f}" if "step_s" in diffusers else _short_error(diffusers["error"])
            meets = [omni.get(k) for k in ("meets_step_target", "meets_peak_target", "meets_setup_target")]
            missed = [k for k, m in zip(("step", "peak", "setup"), meets) if m is False]
            rows.append([
                entry["model"], entry["format"], gib(entry["packed_bytes"]), f"{resident['step_s']:.3f}",
                diffusers_step, f"{omni['step_s']:.3f}", f"{omni['target_step_s']:.3f}",
                "NO: " + ", ".join(missed) if missed else "yes",
                f"{gib(omni['peak_device_bytes'])} / " + (gib(diffusers["peak_device_bytes"]) if "step_s" in diffusers
                                                          else "—"),
                f"{omni['setup_s']:.1f}" + (f" / {from_host['setup_s']:.1f}" if "setup_s" in from_host else ""),
                "yes" if omni["bitwise_equal_to_resident"] else "NO", f"{source(run)}",
            ])
    return rows


QUANT_OFFLOAD_TRAFFIC_RUN = "quant-offload-traffic"


def _copy_traffic_factors() -> dict[tuple[str, str], float]:
    """(model, format) → the resident step with copy traffic ÷ the resident step, from the copy-traffic run."""
    factors = {}
    for entry in result(QUANT_OFFLOAD_TRAFFIC_RUN)["entries"]:
        traffic = next((v for v in entry["variants"] if v["variant"] == "resident, copy traffic"), {})
        if "over_resident" in traffic:
            factors[(entry["model"], entry["format"])] = traffic["over_resident"]
    return factors


def quant_offload_traffic() -> str:
    """What the copies alone cost compute: the resident model with its packed bytes copied alongside."""
    rows = []
    for entry in result(QUANT_OFFLOAD_TRAFFIC_RUN)["entries"]:
        variants = {v["variant"]: v for v in entry["variants"]}
        resident, traffic, omni = (variants[n] for n in ("resident", "resident, copy traffic", "omni layerwise"))
        rows.append([entry["model"], entry["format"], f"{resident['step_s']:.3f}",
                     f"{traffic['step_s']:.3f} ({traffic['over_resident'] - 1:+.1%})", gib(traffic["traffic_bytes"]),
                     f"{omni['step_s']:.3f} ({omni['step_s'] / resident['step_s'] - 1:+.1%})",
                     f"{omni['target_step_s']:.3f}", _verdict(omni["meets_step_target"])])
    return table(["Model", "Format", "Resident step (s)", "Resident, packed bytes copied alongside (s)", "Copied",
                  "omni layerwise (s)", "Target (s)", "Meets"], rows) + (
        f"\nOne run ({source(QUANT_OFFLOAD_TRAFFIC_RUN)}, `--copy-traffic`): the resident quantized model timed while "
        "a side stream copies the model's packed bytes host→device (pinned, 256 MiB pieces) once per step, with no "
        "dependency between the two. Percentages are over the resident step of the same run.\n")


QUANT_OFFLOAD_DEEPER_RUN = "quant-offload-deeper"


def quant_offload_deeper() -> str:
    """A deeper window (``prefetch_depth``) against the default one, in the same run."""
    report = result(QUANT_OFFLOAD_DEEPER_RUN)
    rows = []
    for entry in report["entries"]:
        variants = {v["variant"]: v for v in entry["variants"]}
        omni = variants["omni layerwise"]
        diffusers_peak = variants.get("diffusers group_offload", {}).get("peak_device_bytes")
        for label, v in variants.items():
            if label.startswith("omni layerwise prefetch_depth=") and "step_s" in v:
                rows.append([entry["model"], entry["format"], label.split("=", 1)[1],
                             f"{omni['step_s']:.3f} ({gib(omni['peak_device_bytes'])})",
                             f"{v['step_s']:.3f}", gib(v["peak_device_bytes"]), f"{omni['target_step_s']:.3f}",
                             _verdict(v["step_s"] <= omni["target_step_s"]),
                             "—" if diffusers_peak is None else gib(diffusers_peak),
                             "yes" if v["bitwise_equal_to_resident"] else "NO"])
    return table(["Model", "Format", "prefetch_depth", "Default window step (peak)", "Deeper step (s)", "Peak",
                  "Target (s)", "Meets", "Diffusers' peak", "Bitwise = resident"], rows) + (
        f"\nOne run, {source(QUANT_OFFLOAD_DEEPER_RUN)}: the default window and the deeper one side by side, median of "
        f"{report['args']['repeats']} steps.\n")


def schedule_bound(blocks: list[dict], window_bytes: int, bandwidth: float,
                   compute_factor: float = 1.0) -> tuple[float, list[str]]:
    """A lower bound on the step of *any* schedule that holds at most ``window_bytes`` of streamed weights on the
    device, and the run of blocks that sets it. For every run R of consecutive blocks (cyclic: the next step follows):
    when R starts at most ``window_bytes`` of its weights are on the device, so the rest copies while R runs, and
    the step is at least Σ compute outside R + max(Σ compute in R, (Σ copy in R) − window_bytes ÷ bandwidth). Copies
    are counted at their measured speed and memory as freed byte by byte, so a real schedule does no better.
    ``compute_factor`` scales every block's compute (compute slowed by the copies, ``quant_offload_traffic``)."""
    compute = [b["compute_s"] * compute_factor for b in blocks]
    copy = [b["copy_s"] for b in blocks]
    total, head = sum(compute), window_bytes / bandwidth
    best, run = total, []
    for start in range(len(blocks)):
        in_compute = in_copy = 0.0
        for length in range(1, len(blocks) + 1):
            i = (start + length - 1) % len(blocks)
            in_compute += compute[i]
            in_copy += copy[i]
            step = total - in_compute + max(in_compute, in_copy - head)
            if step > best:
                best, run = step, [blocks[(start + k) % len(blocks)]["block"] for k in range(length)]
    return best, run


def quant_offload_bound() -> str:
    """Why FLUX-size int8 and Q8_0 miss with Diffusers' window: the bounds from each block's measured compute and
    copy times in the current run."""
    report = result(QUANT_OFFLOAD_FINAL_RUNS[0])
    factors = _copy_traffic_factors()
    rows = []
    for entry in report["entries"]:
        pb = entry.get("per_block")
        if not pb:
            continue
        omni = next(v for v in entry["variants"] if v["variant"] == "omni layerwise")
        window = 2 * max(b["packed_bytes"] for b in pb["blocks"])
        bound, run = schedule_bound(pb["blocks"], window, report["bandwidth_bytes_per_s"])
        factor = factors.get((entry["model"], entry["format"]))
        slowed = None if factor is None else schedule_bound(pb["blocks"], window, report["bandwidth_bytes_per_s"],
                                                            max(factor, 1.0))[0]
        target = pb["target_step_s"]
        where = f"{run[0]} … {run[-1]} ({len(run)} blocks)" if run else "— (compute-bound)"
        rows.append([entry["model"], entry["format"], f"{pb['sum_compute_s']:.4f}", f"{pb['sum_copy_s']:.4f}",
                     f"{pb['bound_after_last_s']:.4f}", f"{bound:.4f}", where,
                     "—" if slowed is None else f"{slowed:.4f} (×{factor:.3f})", f"{target:.4f}",
                     f"{omni['step_s']:.4f}", _against(bound, target), _against(slowed, target)])
    return table(["Model", "Format", "Σ compute (s)", "Σ copy (s)", "Diffusers' window, whole blocks (s)",
                  "Any schedule within that window's bytes (s)", "Run that sets it",
                  "Same, compute slowed as under copy traffic (s)", "Target (s)", "omni layerwise (s)",
                  "Any-schedule bound", "Slowed bound"], rows) + (
        f"\nFrom {source(QUANT_OFFLOAD_FINAL_RUNS[0], '.json')} (`--per-block`): each block's forward timed alone in the "
        "resident quantized model, and its packed bytes copied alone host→device. Diffusers' window, whole blocks: "
        "block i+1 copies only while block i runs, the next step's first block after the last one ends (the rule "
        "layerwise follows without a budget). Any schedule: at most two largest blocks' bytes of streamed weights on "
        "the device at any time (Diffusers' window), freed byte by byte as compute passes, copies at full speed and "
        "compute at its resident speed; see `schedule_bound` in `benchmarks/docs_tables.py`. Slowed: the same "
        "computation with every block's compute slowed by the factor the copies alone cost the resident model in "
        f"{source(QUANT_OFFLOAD_TRAFFIC_RUN)} (none below 1), an estimate rather than a bound: copies run through most "
        "but not all of such a step.\n")


def _against(bound: float | None, target: float) -> str:
    if bound is None:
        return "—"
    return "above target" if bound > target else f"{(target - bound) / target:.1%} below target"


def _final_entry(model: str, fmt: str) -> dict:
    return next(e for e in result(QUANT_OFFLOAD_FINAL_RUNS[0])["entries"] if e["model"] == model and e["format"] == fmt)


def quant_offload_why() -> str:
    """Why FLUX-size GGUF Q8_0 is copy-bound: its double- against its single-stream blocks, from the per-block
    timings of the current run."""
    entry = _final_entry("flux", "gguf-q8_0")
    blocks = entry["per_block"]["blocks"]
    double = [b for b in blocks if b["block"].startswith("transformer_blocks.")]
    single = [b for b in blocks if b["block"].startswith("single_transformer_blocks.")]

    def mean(rows: list[dict], key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    def copy_bound(rows: list[dict]) -> int:
        return sum(r["copy_s"] > r["compute_s"] for r in rows)

    return (
        "Where a format misses, the copy engine sets the step, not the hooks. FLUX's double-stream blocks carry "
        f"{mean(double, 'packed_bytes') / mean(single, 'packed_bytes'):.2f}× the bytes of its single-stream ones for "
        f"{mean(double, 'compute_s') / mean(single, 'compute_s'):.2f}× the compute (GGUF Q8_0, each block timed alone "
        f"in {source(QUANT_OFFLOAD_FINAL_RUNS[0], '')}): {copy_bound(double)} of the {len(double)} double-stream blocks take "
        "longer to copy than to compute, one after another, so they fall behind, and the single-stream blocks after "
        f"them ({copy_bound(single)} of {len(single)} copy-bound) cannot give the time back without holding more "
        "blocks on the device. The run's per-block timings bound what any schedule can do within Diffusers' window "
        "(two blocks' bytes of streamed weights):\n")


def quant_offload_misses() -> str:
    """The numbers of the per-format explanations: GGUF Q8_0's bounds and peaks, and what the copies alone cost the
    compute-bound formats."""
    entry = _final_entry("flux", "gguf-q8_0")
    pb, report = entry["per_block"], result(QUANT_OFFLOAD_FINAL_RUNS[0])
    window = 2 * max(b["packed_bytes"] for b in pb["blocks"])
    bandwidth = report["bandwidth_bytes_per_s"]
    factors = _copy_traffic_factors()
    factor = factors[("flux", "gguf-q8_0")]
    target = pb["target_step_s"]
    bound = schedule_bound(pb["blocks"], window, bandwidth)[0]
    slowed = schedule_bound(pb["blocks"], window, bandwidth, max(factor, 1.0))[0]
    variants = {v["variant"]: v for v in entry["variants"]}
    omni, diffusers = variants["omni layerwise"], variants["diffusers group_offload"]

    def side(value: float) -> str:
        return f"{abs(target - value) / target:.1%} {'under' if value <= target else 'over'} the target"

    costs = [f"{factors[('flux', fmt)] - 1:.1%}" for fmt in ("torchao-float8", "bnb-nf4")]
    return (
        f"- **GGUF Q8_0**: the any-schedule bound is {side(bound)} while compute runs at its resident speed; with "
        f"compute slowed as the copies alone slow it ({factor - 1:+.1%}) it is {side(slowed)}, and with whole blocks in "
        f"Diffusers' window it is {side(pb['bound_after_last_s'])}. Within Diffusers' peak (omni's is "
        f"{gib(omni['peak_device_bytes'])} against its {gib(diffusers['peak_device_bytes'])}) no schedule found meets "
        "it; a budget does (`max_device_memory=\"3.5GiB\"`, below), at a higher peak.\n"
        "- **torchao float8, bitsandbytes NF4**: compute-bound, so their bounds are the resident step. The copies alone "
        f"cost them {costs[0]} and {costs[1]} ({source(QUANT_OFFLOAD_TRAFFIC_RUN, '')}) of the 5% the target allows; the rest of "
        "what omni adds is the pass boundary (the next step's first block copies after the last block ends: loading it "
        "while the last block runs raised their peak) and the hooks. They land on the target, a fraction of a percent "
        "on either side from run to run (all runs below).\n")


def quant_offload_check() -> str:
    """The H200 correctness check: every format and strategy on tiny models, and the bitsandbytes pipeline."""
    report = result("quant-offload-check")
    scenarios: list[str] = []
    for checks in report["models"].values():
        scenarios += [k for k, v in checks.items() if isinstance(v, dict) and k not in scenarios]

    def cell(value: dict | None) -> str:
        if value is None:
            return "—"
        if "error" in value:
            return "error"
        return "yes" if value.get("equal") and value.get("equal_after_disable") else "NO"

    rows = [[name, *(cell(checks.get(s)) for s in scenarios)] for name, checks in report["models"].items()]
    pipeline = report.get("pipeline", {})
    lines = table(["Model / format", *scenarios], rows)
    pipe_rows = [[label, *("error" if "error" in v else ("yes" if v.get(k) else "NO") for k in
                           PIPELINE_CHECKS)]
                 for label, v in pipeline.items() if isinstance(v, dict)]
    return lines + "\n" + table(["Pipeline (bitsandbytes 4-bit transformer and T5)", "= resident",
                                  "LoRA changes the output", "LoRA loaded with offload on = resident + LoRA",
                                  "LoRA unloaded with offload on = resident"], pipe_rows) + (
        f"\n{report['device']}, torch {report['torch']}, torchao {report['versions']['torchao']}, bitsandbytes "
        f"{report['versions']['bitsandbytes']}, gguf {report['versions']['gguf']}. \"yes\": bitwise equal to the "
        "resident quantized model, and again after `disable()`. Failures: "
        f"{', '.join(report['failures']) or 'none'}. Run: {source('quant-offload-check', '.json')} "
        "(`benchmarks/quant_offload_check.py`).\n")


# Pinned runs, oldest first: the residency rule changed between the first and the second.
QUANT_OFFLOAD_BUDGET_RUNS = (
    ("quant-offload-budget@undated-7524368-quant_offload_h200_budget", "evenly spread"),
    ("quant-offload-budget@undated-79acd91-quant_offload_h200_budget_largest_first", "largest first"),
    ("quant-offload-budget-more@undated-c21a8e1-quant_offload_h200_budget_more", "largest first"),
)


def quant_offload_budget() -> str:
    """The budget variants: what ``max_device_memory`` buys where the default window is copy-bound, with the
    residency rule each run used (the rule changed between runs)."""
    rows = []
    for name, rule in QUANT_OFFLOAD_BUDGET_RUNS:
        for entry in result(name)["entries"]:
            variants = {v["variant"]: v for v in entry["variants"]}
            omni, resident = variants["omni layerwise"], variants["resident"]
            diffusers_peak = variants.get("diffusers group_offload", {}).get("peak_device_bytes")
            for variant, v in variants.items():
                if not variant.startswith("omni layerwise, max_device_memory=") or "step_s" not in v:
                    continue
                kept = v.get("resident_blocks")
                rows.append([entry["model"], entry["format"], variant.split("=", 1)[1].replace(".0 GiB", " GiB"),
                             rule + ("" if kept is None else f" ({kept} blocks)"), f"{resident['step_s']:.3f}",
                             f"{omni['step_s']:.3f} ({gib(omni['peak_device_bytes'])})",
                             f"{v['step_s']:.3f}", f"{v['target_step_s']:.3f}", _verdict(v["meets_step_target"]),
                             gib(v["streamed_bytes"]), gib(v["peak_device_bytes"]),
                             "—" if diffusers_peak is None else gib(diffusers_peak),
                             "yes" if v["bitwise_equal_to_resident"] else "NO", f"{source(name)}"])
    return table(["Model", "Format", "max_device_memory", "Resident blocks", "Resident step (s)",
                  "Default window step (peak)", "Budget step (s)", "Target (s)", "Meets", "Streamed", "Peak",
                  "Diffusers' peak", "Bitwise = resident", "Run"], rows) + (
        "\nTarget = 1.05 × max(resident step, the budget run's streamed bytes ÷ bandwidth). Diffusers' peak: its "
        "group offload in the same run (— where it fails on the format).\n")


def peak_diff() -> str:
    """What is live at the peak of FLUX-size GGUF Q4_K under omni layerwise and Diffusers' group offload."""
    report = result("peak-diff")
    rows = []
    for variant in ("omni layerwise", "omni layerwise, private pool", "diffusers group_offload"):
        r = report.get(variant)
        if r is None:
            continue
        weights = sum(g["bytes"] for where, g in r["live_at_peak"].items()
                      if "offload" in where or "group_offloading" in where or "allocate" in where
                      or where == "before the forward")
        rows.append([variant, f"{r['stat_peak']:,}", f"{r['replayed_peak']:,}",
                     f"{r['stat_peak'] - r['replayed_peak']:,}", f"{weights:,}"])
    return table(["Variant", "Peak allocated (bytes, `max_memory_allocated`)", "Live tensor bytes at that peak",
                  "Allocator rounding", "of which weights and inputs"], rows) + (
        "\nLive tensor bytes: the caching allocator's recorded history of one forward, replayed to its peak "
        "(requested sizes); `max_memory_allocated` counts whole allocator blocks, which may be up to 1 MiB larger "
        f"than requested. Run: {source('peak-diff', '.json')} (`benchmarks/peak_probe.py --diff`).\n")


def _mib(n: float) -> str:
    return f"{n / 2**20:+.1f} MiB"


def offload_lifecycle() -> str:
    report = result("offload-lifecycle")
    rows = []
    for entry in report["cycles"]:
        cycles, checks = entry["rows"], entry["checks"]
        rows.append([
            entry["strategy"], f"{checks['cycles_run']}/{report['args']['cycles']}",
            gib(max(r["registered_while_on"] for r in cycles)), f"{max(r['registered_after'] for r in cycles)} B",
            _mib(max(r["rss_growth"] for r in cycles)), _mib(max(r["device_growth"] for r in cycles)),
            f"{sum(r['cycle_s'] for r in cycles) / len(cycles):.1f}",
            "yes" if checks["no_error"] and not entry["errors"] else "NO",
            _verdict(all(checks[k] for k in ("registered_back_to_baseline", "rss_back_to_baseline",
                                             "device_back_to_baseline", "models_freed"))),
        ])
    steps = []
    for name in ("layerwise", "model_level"):
        run = report["denoise"][name]
        steps.append([name, f"{run['bitwise_equal_steps']}/{run['steps']}", f"{run['device_growth']} B",
                      _verdict(run["checks"]["device_growth_le_1MiB"])])
    env, args = report["environment"], report["args"]
    return (table(["Strategy", "Cycles", "Registered while on", "Registered after", "Max host RSS growth",
                   "Max device growth", "Mean cycle (s)", "No CUDA error", "Back to baseline"], rows)
            + "\n" + table(["Strategy", "Steps bitwise equal to resident", "Device growth, first → last step",
                            "≤ 1 MiB"], steps)
            + f"\n{env['device_name']}, torch {env['torch']}, diffusers {env['diffusers']}; FLUX.1-size bf16 "
              f"transformer ({gib(report['model_bytes'])}), dropped without `disable()` then `gc.collect()` each "
              f"cycle; {args['steps']} denoising steps at {args['image_tokens']} image + {args['text_tokens']} text "
              f"tokens; RSS allowance {args['rss_tolerance'] // 2**20} MiB (allocator slack). All checks pass: "
              f"{_verdict(report['all_checks_pass'])}. Run: {source('offload-lifecycle')}.\n")


def offload_concurrency() -> str:
    """``benchmarks/offload_concurrency_check.py`` on the H200: concurrent callers of one offloaded transformer."""
    report = result("offload-concurrency")
    args = report["args"]
    rows = []
    for entry in report["results"]:
        runs = entry["rows"]
        rows.append([entry["name"], f"{sum(1 for r in runs if not r['error_count'] and r['bitwise_equal'] == r['outputs'])}"
                     f"/{len(runs)}", f"{sum(r['bitwise_equal'] for r in runs)}/{sum(r['outputs'] for r in runs)}",
                     str(sum(r["error_count"] for r in runs)),
                     f"{sum(r['seconds'] for r in runs) / len(runs):.2f}", _verdict(entry["pass"])])
    env = report["environment"]
    return (table(["Configuration", "Rounds passed", "Outputs bitwise equal to the resident run alone", "Errors",
                   "Mean round (s)", "Pass"], rows)
            + f"\n{env['device_name']}, torch {env['torch']}, diffusers {env['diffusers']}; FLUX.1-size bf16 transformer "
              f"({gib(report['model_bytes'])}), {args['threads']} threads × {args['calls']} calls per round, "
              f"{args['image_tokens']} image + {args['text_tokens']} text tokens, a different input per thread. "
              f"Run: {source('offload-concurrency')}.\n")


# Whole pipelines on a small card (#29) ----------------------------------------------------------------------------

PIPELINE_RUNS = (("pipeline-offload-flux", "FLUX.1-dev"), ("pipeline-offload-qwen", "Qwen-Image"),
                 ("pipeline-offload-wan", "Wan2.2-T2V-A14B"))
# Where a pipeline's strategies do not fit one 10-minute device call, a second run holds the rest (with its own
# resident reference): its rows join the first run's table, each compared with the resident of its own run.
PIPELINE_COMPANIONS = {"pipeline-offload-wan": "pipeline-offload-wan-mmgp",
                       "pipeline-offload-qwen": "pipeline-offload-qwen-diffusers"}
# Diffusers' strategies and mmgp's, as the run names them (what the targets compare with).
_DIFFUSERS = ("diffusers-group", "diffusers-model", "diffusers-sequential")


def _pipeline_name(row: dict, report: dict) -> str:
    if row["strategy"] == "omni-budget":
        return f"omni layerwise, `max_device_memory=\"{report['args']['omni_budget']}\"`"
    return {"omni": "omni layerwise", "resident": "resident (no card limit)",
            "diffusers-group": "Diffusers `enable_group_offload` (pipeline, block level, streams)",
            "diffusers-model": "Diffusers `enable_model_cpu_offload`",
            "diffusers-sequential": "Diffusers `enable_sequential_cpu_offload`",
            "mmgp2": "mmgp `profile` 2", "mmgp4": "mmgp `profile` 4 (its default quantizes the text encoder to int8)"}.get(
                row["strategy"], row["strategy"])


def _pipeline_skip(row: dict) -> str:
    reason = row.get("skip_reason") or ""
    return f"not run: {reason}" if reason else f"not run ({row.get('status')})"


def _pipeline_ok(row: dict) -> bool:
    return row.get("status") == "ok" and row.get("end_to_end_s") is not None


def _pipeline_rows(name: str) -> list[tuple[dict, dict, str]]:
    """``(row, its run's report, run name)`` for every strategy of the run ``name`` and of its companion run (whose
    resident row shows too, marked, since the companion's rows are compared with it)."""
    rows = [(row, result(name), name) for row in result(name)["strategies"]]
    companion = PIPELINE_COMPANIONS.get(name)
    if companion:
        rows += [(row, result(companion), companion) for row in result(companion)["strategies"]]
    return rows


def _resident(report: dict) -> dict | None:
    return next((r for r in report["strategies"] if r["strategy"] == "resident"), None)


def _end_to_end(row: dict, steps: int) -> float:
    """``row``'s end to end at ``steps`` denoising steps: as measured when it ran that many, else its encode and
    decode plus its denoise phase scaled by the steps (a strategy too slow to run them all: every step does the
    same work). The one value a strategy's time has wherever it is shown: the guide's table, the README, the plot
    and the targets (a second run's rows as measured, not rescaled by its resident)."""
    if row.get("steps", steps) == steps:
        return row["end_to_end_s"]
    phases = row["phases"]
    return phases["encode_s"] + phases["denoise_s"] * steps / row["steps"] + phases["decode_s"]


def _scaled_how(row: dict, steps: int) -> str:
    """How ``_end_to_end`` got ``row``'s time when it ran fewer steps than ``steps`` (else ``""``): said beside the
    number wherever it is shown."""
    if row.get("steps", steps) == steps:
        return ""
    return f"ran {row['steps']} steps in {row['end_to_end_s']:.1f} s, denoise scaled to {steps}"


def _same_output(row: dict, run: dict) -> bool | None:
    """Whether ``row``'s output is bitwise its run's resident output (``None``: not comparable, because it ran
    fewer steps or its run has no resident row)."""
    reference = _resident(run)
    if reference is None or row.get("steps", run["steps"]) != run["steps"]:
        return None
    return row.get("sha256") is not None and row.get("sha256") == reference.get("sha256")


def _pipeline_checks(name: str) -> dict:
    """The issue's targets for one pipeline: omni's peak within the card, omni within 1.1× its lower bound, and how
    much faster than the fastest Diffusers strategy that ran and than mmgp profile 2, each compared at the time
    ``_end_to_end`` gives it (a companion run's strategy as that run measured it)."""
    report = result(name)
    bounds = {b["strategy"]: b for b in report["lower_bounds"]}
    rows = _pipeline_rows(name)
    steps = report["steps"]
    diffusers = [(r, run) for r, run, _ in rows if r["strategy"] in _DIFFUSERS and _pipeline_ok(r)]
    mmgp = next(((r, run) for r, run, _ in rows if r["strategy"] == "mmgp2" and _pipeline_ok(r)), None)
    checks = {}
    for strategy in ("omni", "omni-budget"):
        row = next((r for r in report["strategies"] if r["strategy"] == strategy), None)
        if row is None or not _pipeline_ok(row):
            continue
        fastest = min(diffusers, key=lambda pair: _end_to_end(pair[0], steps)) if diffusers else None
        checks[strategy] = {
            "peak_ok": row["device_peak_allocated"] <= row["card_bytes"],
            "bound_ratio": bounds[strategy]["ratio"] if strategy in bounds else None,
            "vs_diffusers": ((_end_to_end(fastest[0], steps) / row["end_to_end_s"], fastest[0]["strategy"])
                             if fastest else None),
            "diffusers_row": fastest,
            "vs_mmgp2": _end_to_end(mmgp[0], steps) / row["end_to_end_s"] if mmgp else None,
            "mmgp2_row": mmgp,
            "mmgp2_other_run": mmgp is not None and mmgp[1] is not report,
            "vs_resident": row["end_to_end_s"] / _resident(report)["end_to_end_s"] if _resident(report) else None,
        }
    return checks


def pipeline_offload() -> str:
    """``benchmarks/pipeline_offload_bench.py``'s runs: whole pipelines, prompt to image, on an emulated card."""
    out = []
    for name, label in PIPELINE_RUNS:
        report = result(name)
        companion = PIPELINE_COMPANIONS.get(name)
        rows = []
        for row, run, run_name in _pipeline_rows(name):
            title = _pipeline_name(row, run) + (" ²" if run_name != name else "")
            if not _pipeline_ok(row):
                error = row.get("error")
                why = (f"failed in {error['stage']}: {error['type']}: {_short_error(error['message'])}"
                       if isinstance(error, dict) else _pipeline_skip(row))
                rows.append([title, why, "", "", "", "", "", "", ""])
                continue
            phases = row["phases"]
            reference = _resident(run)
            scaled = row.get("steps", report["steps"]) != report["steps"]
            same = ("reference" if row["strategy"] == "resident" else "n/a (no resident run)" if reference is None
                    else f"n/a ({row['steps']} steps)" if scaled
                    else "yes" if row.get("sha256") == reference.get("sha256") else "**no**")
            relative = (f"{_end_to_end(row, report['steps']) / reference['end_to_end_s']:.2f}×"
                        if reference is not None and _pipeline_ok(reference) else "")
            end_to_end = f"{_end_to_end(row, report['steps']):.1f} s"
            if scaled:
                end_to_end += f" ({_scaled_how(row, report['steps'])})"
            rows.append([title, end_to_end, relative,
                         f"{phases['encode_s']:.2f} / {phases['denoise_s']:.1f} / {phases['decode_s']:.2f} s",
                         gib(row["device_peak_allocated"]), gib(row["rss"]["peak"]),
                         gib(row["pinned"]["pinned_total_bytes"]), f"{row['enable_s']:.1f} s", same])
        lines = []
        for strategy, check in _pipeline_checks(name).items():
            parts = [f"peak within the card: {_verdict(check['peak_ok'])}"]
            if check["bound_ratio"] is not None:
                parts.append(f"end to end ÷ lower bound {check['bound_ratio']:.2f} (≤ 1.1: "
                             f"{_verdict(check['bound_ratio'] <= 1.1)})")
            if check["vs_diffusers"] is not None:
                speed, against = check["vs_diffusers"]
                parts.append(f"{speed:.2f}× faster than the fastest Diffusers strategy that ran ({against}; ≥ 1.3: "
                             f"{_verdict(speed >= 1.3)})")
            else:
                parts.append("no Diffusers strategy completed on this card")
            if check["vs_mmgp2"] is not None:
                via = " (², as its run measured it)" if check["mmgp2_other_run"] else ""
                parts.append(f"{check['vs_mmgp2']:.2f}× faster than mmgp profile 2{via} (≥ 1.8: "
                             f"{_verdict(check['vs_mmgp2'] >= 1.8)})")
            if check["vs_resident"] is not None:
                parts.append(f"{check['vs_resident']:.2f}× the resident pipeline's time")
            lines.append(f"- {strategy}: " + "; ".join(parts))
        env, args = report["environment"], report["args"]
        card = args["card_gib"]
        runs = f"{source(name)}" + (f"; ² {source(companion)}, a second run on the same kind of machine with its own "
                                    f"resident reference ({_companion_drift(name)}; its rows are compared as measured)"
                                    if companion else "")
        out.append(
            f"**{label}**, {report['steps']} steps, card emulated at {card:g} GiB "
            f"(`torch.cuda.set_per_process_memory_fraction`), {env['device_name']}, torch {env['torch']}, diffusers "
            f"{env['diffusers']}; {runs}\n\n"
            + table(["Strategy", "End to end", "÷ resident of its run", "Encode / denoise / decode", "Device peak",
                     "Host RSS peak", "Pinned", "Enable", "Same image as resident"], rows)
            + "\n" + "\n".join(lines) + "\n")
    return "\n".join(out)


def _companion_drift(name: str) -> str:
    """How the resident pipeline of ``name``'s second run compares with the first run's (the two machines' drift)."""
    first, second = _resident(result(name)), _resident(result(PIPELINE_COMPANIONS[name]))
    return (f"its resident pipeline took {second['end_to_end_s']:.1f} s against the first run's "
            f"{first['end_to_end_s']:.1f} s")


def _pipeline_cell(row: dict, run: dict, steps: int, second_run: bool, name: str = "") -> str:
    """A README cell for one strategy: the time ``_end_to_end`` gives it (the guide's and the plot's value), what
    it ran as, how the time was got when it ran fewer steps, and whether its output is the resident's."""
    notes = [name] if name else []
    how = _scaled_how(row, steps)
    if how:
        notes.append(how)
    same = _same_output(row, run)
    if same is False:
        notes.append("output not the resident pipeline's")
    elif same is None:
        notes.append("output not compared with the resident pipeline's")
    text = f"{_end_to_end(row, steps):.1f} s" + (" ²" if second_run else "")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def readme_pipelines() -> str:
    """The README's row for whole pipelines: omni against the fastest Diffusers strategy and mmgp, same runs, same
    values (``_end_to_end``) as the offload guide's tables and the plot."""
    rows, drifts = [], []
    for name, label in PIPELINE_RUNS:
        report = result(name)
        steps = report["steps"]
        by = {r["strategy"]: r for r in report["strategies"]}
        omni, card = by["omni"], report["args"]["card_gib"]
        checks = _pipeline_checks(name)["omni"]
        used_companion = False
        diffusers = "none completed on this card"
        if checks["diffusers_row"]:
            row, run = checks["diffusers_row"]
            used_companion |= run is not report
            diffusers = _pipeline_cell(row, run, steps, run is not report, row["strategy"])
        mmgp = "—"
        if checks["mmgp2_row"]:
            row, run = checks["mmgp2_row"]
            used_companion |= run is not report
            mmgp = _pipeline_cell(row, run, steps, run is not report)
        if used_companion:
            drifts.append(f"{label}: {source(PIPELINE_COMPANIONS[name], '.json')}, {_companion_drift(name)}")
        output = "video" if "wan" in name else "image"
        omni_cell = f"**{omni['end_to_end_s']:.1f} s**, peak {gib(omni['device_peak_allocated'])}"
        if _same_output(omni, report) is not True:
            omni_cell += " (output not the resident pipeline's)"
        rows.append([f"{label}, prompt → {steps}-step {output} on a {card:g} GiB card", omni_cell, diffusers, mmgp])
    env = result(PIPELINE_RUNS[0][0])["environment"]
    runs = ", ".join(source(name, ".json") for name, _ in PIPELINE_RUNS)
    second = ("; ² from a second run of the same pipeline with its own resident reference, shown as measured ("
              + "; ".join(drifts) + ")") if drifts else ""
    return table(["Whole pipeline, every component offloaded (" + env["device_name"] + ")",
                  "diffusers-omni `enable_layerwise_offload`, no budget (`\"none\"`)", "Diffusers, fastest that ran",
                  "mmgp profile 2"],
                 rows) + (f"\nbf16 random weights at the real sizes, card emulated with "
                          f"`set_per_process_memory_fraction`; every time is end to end at the steps of its row (a "
                          f"strategy that ran fewer steps: its denoise scaled, said in its cell), the same value as "
                          f"the offload guide and the plot; output bitwise the resident pipeline's unless its cell "
                          f"says otherwise; from {runs}{second}. "
                          "[Offload guide](docs/user_guide/offload.md#whole-pipelines-on-a-small-card) for the "
                          "phases, budgets and every strategy.\n")


def pipeline_host_lossless() -> str:
    """``pipeline-offload-wan-host-lossless``: under the same host budget, blocks read from the bf16 checkpoint
    (omni-host) against blocks read coded from ``compression_cache_dir`` (omni-host-lossless), one run."""
    report = result("pipeline-offload-wan-host-lossless")
    plain, coded = report["host_budget"], report["host_budget_lossless"]
    by = {r["strategy"]: r for r in report["strategies"]}
    weights = sum(component["by_dtype"].get("bfloat16", 0) for component in report["components"].values())
    rows = []
    for label, summary in (("bf16 checkpoint (`omni-host`)", plain), ("lossless code in compression_cache_dir "
                                                                      "(`omni-host-lossless`)", coded)):
        run = by[summary["strategy"]]
        rows.append([label, f"{summary['switch_forward_s']:.2f} s / {summary['other_forward_s']:.2f} s",
                     f"{summary['forward_s']:.2f} s", f"{summary['denoise_s'] / summary['steps']:.2f} s",
                     f"{run['end_to_end_s']:.1f} s",
                     f"{summary['disk_blocks']}, {gib(summary['disk_bytes_per_pass'])}",
                     f"{summary['shared_buffers']}, {gib(summary['shared_bytes'])}",
                     f"{summary['disk_bandwidth'] / GiB:.2f} GiB/s", gib(summary["pinned_bytes"]),
                     gib(run["rss"]["after_enable"]), f"{summary['enable_s']:.1f} s"])
    ratio = coded["switch_forward_s"] / plain["switch_forward_s"]
    cache, seconds = coded["lossless_cache"], coded["lossless_cache_seconds"] or {}
    spent = ", ".join(f"{what} {value:.1f} s" for what, value in seconds.items() if value)
    lossless = by["omni-host-lossless"]
    return (table(["Blocks beyond the budget read from", "First forward of each expert / the others (median)",
                   "Denoise forward (median)", "Denoise step (mean)", "End to end", "Blocks read at every load, "
                   "bytes per pass", "Shared buffers", "Reader bandwidth (cold)", "Pinned", "Host RSS after enabling",
                   "Enable"], rows)
            + f"\nWan2.2-T2V-A14B, 24 GiB card, `max_host_memory={report['args']['omni_host_budget']}`, "
              f"{report['steps']} steps after a 2-step warm-up (timesteps 999 and 750: each expert runs its first "
              f"forward), page cache dropped before every transformer forward, {report['environment']['device_name']}; "
              f"{source('pipeline-offload-wan-host-lossless')}. The first forward of an expert with the code on disk: "
              f"{ratio:.2f}× the checkpoint's (target ≤ 0.75×: {_verdict(ratio <= 0.75)}). Its enable coded "
              f"{gib(weights)} of bfloat16 weights ({seconds and f'{spent}; ' or ''}hashing and writing run beside the coding) "
              f"and wrote the {cache['cache blocks written']} blocks the plan reads from disk "
              f"({gib(cache['cache bytes written'])}: {coded['disk_blocks']} at every load, the others into the "
              f"buffers the experts share); the host RSS peak while enabling, "
              f"{gib(lossless['rss']['enable_peak'])}, is this run's DiTs as built in memory (no checkpoint on disk: "
              f"the disk holds the experts' checkpoint or the cache, not both) until their blocks are coded.\n")


def dfloat11_decode() -> str:
    """``dfloat11-decode-probe``: DFloat11's code decoded by our Triton kernel against the copies."""
    report = result("dfloat11-decode-probe")
    rows = [[run["run"], f"{run['median_s'] * 1e3:.2f} ms", f"{run['GBps_of_bf16']:.0f} GB/s",
             "-" if run["bitwise"] is None else _verdict(run["bitwise"])] for run in report["runs"]]
    return (table(["What", "Median", "bf16 bytes per second", "Bitwise"], rows)
            + f"\nOne unit of {report['numel'] / 1e6:.0f} M random bf16 weights (a FLUX.1-dev double block's size): "
              f"DFloat11's code {gib(report['dfloat11_bytes'])}, ours {gib(report['lossless_bytes'])}, bf16 "
              f"{gib(report['bf16_bytes'])}; {report['device']}; {source('dfloat11-decode-probe')}.\n")


def pipeline_host_budget() -> str:
    """``pipeline-offload-wan-host``: ``max_host_memory`` against every host copy pinned, with the disk's own read
    bandwidth (``disk-read-probe``, the same machine's) beside it."""
    report = result("pipeline-offload-wan-host")
    summary = report["host_budget"]
    by = {r["strategy"]: r for r in report["strategies"]}
    host, pinned_all = by["omni-host"], by["omni"]
    probe = result("disk-read-probe")
    best = max(probe["rows"], key=lambda r: r["gib_per_s"])
    single = max((r for r in probe["rows"] if r["readers"] == 1), key=lambda r: r["gib_per_s"])
    # A pass is a forward of every DiT; the plan spreads the blocks read at every load over the experts by their
    # sizes, and one forward runs one expert.
    experts = [c for c in report["components"] if c.startswith("transformer")]
    per_forward = summary["disk_bytes_per_pass"] / len(experts)
    floor = per_forward / (best["gib_per_s"] * GiB)
    found = re.fullmatch(r"(\d+(?:\.\d+)?)GiB", report["args"]["omni_host_budget"])
    budget = float(found.group(1)) * GiB if found else None
    first, other, pinned_forward = summary["switch_forward_s"], summary["other_forward_s"], summary["omni_forward_s"]
    # Per step: omni-host may run more steps than omni (--host-steps); a run without the per-step fields ran both
    # with the report's steps and recorded whole denoise phases.
    host_steps, omni_steps = summary.get("steps") or report["steps"], summary.get("omni_steps") or report["steps"]
    scale = (1, 1) if "steps" in summary else (host_steps, omni_steps)
    host_step, omni_step = summary["denoise_s"] / scale[0], summary["omni_denoise_s"] / scale[1]
    # A 40-step call runs 80 forwards (two per step), two of them the first of an expert: computed from this run.
    forty = (2 * first + 78 * other) / (80 * pinned_forward)
    rows = [[f"`{report['args']['omni_host_budget']}`",
             f"{gib(summary['pinned_bytes'])} (≤ budget: {_verdict(budget is None or summary['pinned_bytes'] <= budget)})",
             f"{gib(host['rss']['call_peak'])} (≤ 40 GiB: {_verdict(host['rss']['call_peak'] <= 40 * GiB)})",
             gib(host["rss"]["enable_peak"]) + (
                 f" (sampled: own {gib(host['rss']['enable_anon_peak'])}, file pages "
                 f"{gib(host['rss']['enable_file_peak'])})" if host["rss"].get("enable_anon_peak") else ""),
             f"{summary['forward_s']:.2f} s / {pinned_forward:.2f} s = {summary['forward_ratio']:.2f}× "
             f"(≤ 1.2: {_verdict(summary['forward_ratio'] <= 1.2)})",
             f"{first:.1f} s / {other:.2f} s",
             f"{host_step:.2f} s ({host_steps} steps) / {omni_step:.2f} s ({omni_steps} steps) = "
             f"{host_step / omni_step:.2f}× (≤ 1.2: {_verdict(host_step / omni_step <= 1.2)})",
             f"{forty:.2f}×",
             f"{summary['shared_buffers']}, {gib(summary['shared_bytes'])}",
             f"{summary['disk_blocks']}, {gib(summary['disk_bytes_per_pass'])}",
             f"{summary['disk_bandwidth'] / GiB:.2f} GiB/s",
             f"{floor:.2f} s"]]
    probe_rows = [[r["readers"], f"{r['chunk_bytes'] >> 20} MiB", f"{r['gib_per_s']:.2f} GiB/s"]
                  for r in probe["rows"]]
    return (table(["max_host_memory", "Pinned", "Host RSS during the call", "Host RSS peak while enabling",
                   "Denoise forward (median): host budget / all pinned",
                   "First forward of each expert / the others (median)",
                   "Denoise step (mean over the call): host budget / all pinned",
                   "Denoise phase, 40 steps (computed from these forwards)",
                   "Shared buffers", "Blocks read at every load, bytes per pass", "Reader bandwidth (cold)",
                   "Floor of a forward at the disk's best bandwidth"], rows)
            + f"\nWan2.2-T2V-A14B, 24 GiB card, {report['environment']['device_name']}; "
              f"both experts saved to the machine's disk and loaded with `load_transformer_mmap` (the text encoder "
              f"is built in memory: the disk has no room for its checkpoint beside the experts', so its blocks keep "
              f"their host copies), the files' page cache dropped before every transformer forward; the all-pinned "
              f"run is the same process tree's `omni` strategy (end to end {pinned_all['end_to_end_s']:.1f} s "
              f"against {host['end_to_end_s']:.1f} s). {source('pipeline-offload-wan-host')}. The floor: one "
              f"expert's blocks read at every load ({gib(per_forward)}) at the disk's best measured cold read "
              f"bandwidth below. The 40-step column: (2 × first + 78 × others) ÷ (80 × all pinned).\n\n"
            + table(["Readers", "Chunk", "Cold read bandwidth"], probe_rows)
            + f"\nThe same machine's disk, {probe['size_bytes'] / GiB:.0f} GiB file, page cache dropped before each "
              f"read ({source('disk-read-probe')}): one reader reaches {single['gib_per_s']:.2f} GiB/s, the best "
              f"setting {best['gib_per_s']:.2f} GiB/s.\n")


def budget_never_slower() -> str:
    """``quant-offload-budget-float8``: each format's step with no budget against each ``max_device_memory``, in one
    process (the rule: a budget never makes a step slower)."""
    report = result("quant-offload-budget-float8")
    rows = []
    for entry in report["entries"]:
        by = {v["variant"]: v for v in entry["variants"]}
        free = by.get("omni layerwise")
        if free is None or free.get("step_s") is None:
            continue
        for variant in entry["variants"]:
            if "max_device_memory" not in variant["variant"] or variant.get("step_s") is None:
                continue
            budget = variant["variant"].split("max_device_memory=")[1]
            rows.append([entry["model"], entry["format"], f"{free['step_s']:.4f} s",
                         f"{min(free['step_all_s']):.4f}–{max(free['step_all_s']):.4f}", budget,
                         f"{variant['step_s']:.4f} s",
                         f"{min(variant['step_all_s']):.4f}–{max(variant['step_all_s']):.4f}",
                         gib(variant["peak_device_bytes"]),
                         _verdict(variant["step_s"] <= free["step_s"])])
    env = report["environment"]
    return (table(["Model", "Format", "No budget: step (median)", "samples", "max_device_memory", "Step (median)",
                   "samples", "Peak", "Not slower"], rows)
            + f"\n{env['device_name']}, torch {env['torch']}, torchao {report['versions']['torchao']}; median of "
              f"{report['args']['repeats']} steps after {report['args']['warmup']} warm-up, one process; "
              f"{source('quant-offload-budget-float8')}.\n")


def quality_h200() -> str:
    """``benchmarks/quality_bench.py``'s tables (``docs/user_guide/quality.md``); a pointer until it has run."""
    from benchmarks.quality_bench import to_markdown  # imports torch and the package: only when rendering this table

    path = results_io.run_path("quality", root=RESULTS)
    if not path.is_file():
        return ("Not measured yet: `bash benchmarks/h200/run_all.sh quality` on an H200 writes the results this table "
                "is rendered from.\n")
    # The images lie in the run's folder beside its JSON (latest/ or archive/<id>/).
    base = f"https://github.com/diffusers-omni/diffusers-omni/blob/main/benchmarks/results/{cite('quality', '')}/"
    return to_markdown(result("quality"), image_base=base)


def _tune_runs() -> list[tuple[str, dict]]:
    return [(name, result(name)) for name in ("tune", "tune-no-fa3", "tune-no-fa3-flux")
            if results_io.run_path(name, root=RESULTS).is_file()]


def tune_h200() -> str:
    """``benchmarks/tune_bench.py``: tune's time and picks per model, and the whole step of every candidate
    configuration in the same process (``docs/user_guide/tuning.md``)."""
    runs = _tune_runs()
    if not runs:
        return ("Not measured yet: `bash benchmarks/h200/run_all.sh tune tune-no-fa3` on an H200 writes the results "
                "this table is rendered from.\n")
    out = []
    for name, report in runs:
        rows = []
        for model in report["models"].values():
            if "error" in model:
                rows.append([model["label"], "failed", _short_error(model["error"]), "", "", ""])
                continue
            steps = model["whole_step"]["seconds"]
            fastest = model["whole_step"]["fastest"]
            ran = model["whole_step"]["backends"].get("omni auto (tuned table)", [])
            picks = "; ".join(f"{role}: {routed[0] if routed else backend}" for role, backend, routed in ran)
            candidates = ", ".join(f"{'**' if n == fastest else ''}{n.replace('omni ', '')} {t:.3f}"
                                   f"{'**' if n == fastest else ''}" for n, t in sorted(steps.items(), key=lambda i: i[1]))
            ratio = model["whole_step"]["tuned_over_fastest"]
            rows.append([model["label"], f"{model['tune']['seconds']:.1f} s", picks, candidates,
                         f"{ratio:.3f}" if ratio else "—", _verdict(model["whole_step"]["within_tolerance"])])
        out.append(f"**{report['label']}** ({report['device']}, torch {report['torch']}, {report['date'][:10]}; "
                   f"{source(name, '.json')})\n\n" + table(
                       ["Model", "tune took", "auto ran, per role (tuned table)", "whole step of every candidate (s, "
                        "fastest bold)", "tuned auto / fastest", "within 3%"], rows))
    return "\n".join(out)


def tune_lossy() -> str:
    """The lossy modes measured beside the exact ones (the errors the enable-time warning quotes)."""
    report = result("tune-lossy")
    rows = []
    for model in report["models"].values():
        lossy = model.get("lossy", {})
        for label, row in lossy.items():
            if "unavailable" in row:
                rows.append([model["label"], label, "—", "—", _short_error(row["unavailable"])])
                continue
            speed = row["exact_fastest_step_s"] / row["step_s"]
            rows.append([model["label"], label, f"{row['rel_err_vs_native']:.2%}",
                         f"{row['step_s']:.3f} s", f"{speed:.2f}× the fastest exact ({row['exact_fastest_step_s']:.3f} s)"
                         if label != "FLASH_ATTN bf16 (exact)" else "exact kernel, for scale"])
    return (f"{report['device']}, torch {report['torch']}, {report['date'][:10]}, random weights (`"
            f"{cite('tune-lossy', '.json')}`{provenance('tune-lossy')}): relative error of the whole transformer output against Diffusers' native attention.\n\n"
            + table(["Model", "Mode", "rel. error vs native", "step", "speed"], rows))


def readme_lossy() -> str:
    """The lossy modes' speed beside their error, both from one run (the ``quality`` suite): seconds per
    transformer forward, speed-up over Diffusers' native attention, the output's and the attention modules' relative
    error against it."""
    if not results_io.run_path("quality", root=RESULTS).is_file():
        return "Not measured yet (`python -m benchmarks run quality`).\n"
    data = result("quality")
    rows = []
    for model, entry in data["full_size"].items():
        steps = entry["step_s"]
        native = steps[entry["reference"]]
        for name, seconds in steps.items():
            if name == entry["reference"]:
                rows.append([model, "Diffusers native (reference)", f"{seconds:.3f}", "1.00×", "—", "—"])
                continue
            cand = entry["candidates"].get(name, {})
            attention = cand.get("attention", {})
            rows.append([model, name, f"{seconds:.3f}", f"{native / seconds:.2f}×",
                         f"{cand['output_rel_err']:.2%}" if "output_rel_err" in cand else "—",
                         f"{attention['local_rel_err_mean']:.2%} (worst {attention['local_rel_err_max']:.2%})"
                         if "local_rel_err_mean" in attention else "—"])
    return table(["Model", "Attention", "Forward (s)", "Speed-up (native ÷ this, per forward)",
                  "Output rel. error vs native", "Attention rel. error, per module (mean)"], rows) + (
        f"\nOne run, {data['device']}, {data['date'][:10]}, commit {data.get('commit') or '?'} "
        f"(`benchmarks/quality_bench.py`, `benchmarks/results/{cite('quality', '.json')}`{provenance('quality')}). Random weights: the errors "
        "show what each mode does to these activations, not image quality on a trained checkpoint; measure yours with "
        "`diffusers-omni compare`. \"FP8 (routed)\" is FP8 as shipped: at FLUX's size every call stays bf16.\n")


_DPT_LABELS = {"stock": "Diffusers' classes (stock)", "omni": "Omni classes, no offload",
               "layerwise": "Omni classes, layerwise offload in setup",
               "model_level": "Omni classes, model-level offload in setup"}


def diffusers_pipeline_tests() -> str:
    """Diffusers' own fast pipeline tests per mode, and the tests failing beyond stock (by test name)."""
    data = result("diffusers-pipeline-tests")
    runs = data["runs"]
    rows = []
    for mode, run in runs.items():
        counts = run["counts"]
        rows.append([_DPT_LABELS[mode], f"`{run.get('commit', data['commit'])[:10]}`, "
                     f"{run.get('date', data['date'])[:10]}", counts.get("passed", 0),
                     counts.get("failed", 0) + counts.get("error", 0), counts.get("skipped", 0),
                     "–" if mode == "stock" else len(run["beyond_stock"])])
    families = ", ".join(dict.fromkeys(f for run in runs.values() for f in run["families"]))
    text = (f"Diffusers' tests from `{data['diffusers_tests_ref']}`, run against the installed diffusers "
            f"{data['diffusers']} (torch {data['torch']}, {data['device']}) for the families {families} "
            f"(`python -m benchmarks.diffusers_pipeline_tests`, "
            f"`benchmarks/results/{cite('diffusers-pipeline-tests', '.json')}`{provenance('diffusers-pipeline-tests')}; each run at the commit it names"
            + (f"; {data['note']}" if data.get("note") else "") + ").\n\n")
    text += table(["Run", "Commit, date", "Passed", "Failed", "Skipped", "Failed beyond stock"], rows)
    folders = sorted({nodeid.split("::")[0].split("/")[2] for run in runs.values() for nodeid in run["outcomes"]})
    per_folder = []
    for folder in folders:
        row = [f"`{folder}`"]
        for run in runs.values():
            outcomes = [v for k, v in run["outcomes"].items() if k.split("::")[0].split("/")[2] == folder]
            ran = sum(v != "skipped" for v in outcomes)
            row.append(f"{sum(v == 'passed' for v in outcomes)} / {ran}")
        per_folder.append(row)
    text += "\nPassed / ran (not skipped) per Diffusers test folder:\n\n"
    text += table(["Folder", *(_DPT_LABELS[mode] for mode in runs)], per_folder)
    offloaded = [mode for mode in runs if mode != "stock"]
    beyond: dict[str, dict[str, int]] = {}
    for mode in offloaded:
        for nodeid in runs[mode]["beyond_stock"]:
            name = nodeid.rsplit("::", 1)[-1].split("[")[0]
            beyond.setdefault(name, {}).setdefault(mode, 0)
            beyond[name][mode] += 1
    if beyond:
        text += "\nFailing beyond stock, by Diffusers test name (number of test classes):\n\n"
        text += table(["Test", *(_DPT_LABELS[mode] for mode in offloaded)],
                      [[f"`{name}`", *(counts.get(mode, 0) for mode in offloaded)]
                       for name, counts in sorted(beyond.items())])
    return text


RENDERERS = {
    "readme-lossy": readme_lossy,
    "tune-h200": tune_h200,
    "tune-lossy": tune_lossy,
    "gpu-backends": gpu_backends,
    "diffusers-names": diffusers_names,
    "readme-wins": readme_wins,
    "readme-costs": readme_costs,
    "e2e-attention": e2e_attention,
    "attention-backends": attention_backends,
    "attention-same-kernel": attention_same_kernel,
    "attention-router": attention_router,
    "sage-backend": sage_backend,
    "sage-kernels": sage_kernels,
    "sage-sweep": sage_sweep,
    "sage-pipelines": sage_pipelines,
    "offload-summary": offload_summary,
    "offload-budget-window": offload_budget_window,
    "offload-lossless": offload_lossless,
    "offload-auto": offload_auto,
    "offload-auto-peers": lambda: offload_auto("pipeline-offload-flux-auto-peers"),
    "offload-auto-qwen": lambda: offload_auto("pipeline-offload-qwen-auto"),
    "offload-qwen-vae-room": lambda: offload_auto("pipeline-offload-qwen-vae-room"),
    "offload-auto-wan": lambda: offload_auto("pipeline-offload-wan-auto"),
    "lossless-pool": lossless_pool,
    "vae-workspace": vae_workspace,
    "offload-lossless-pipeline": lambda: offload_auto("pipeline-offload-flux-lossless"),
    "offload-host-auto-cgroup": offload_host_auto_cgroup,
    "distributed-summary": distributed_summary,
    "distributed-example": distributed_example,
    "fp8-kernels": fp8_kernels,
    "fp8-checks": fp8_checks,
    "fp8-numerics": fp8_numerics,
    "sparse-kernels": sparse_kernels,
    "hopper-e2e": hopper_e2e,
    "hopper-latents": hopper_latents,
    "fp8-targets": fp8_targets,
    "sparse-targets": sparse_targets,
    "quant-offload-current": quant_offload_current,
    "quant-offload-why": quant_offload_why,
    "quant-offload-bound": quant_offload_bound,
    "quant-offload-misses": quant_offload_misses,
    "quant-offload-check": quant_offload_check,
    "quant-offload-traffic": quant_offload_traffic,
    "quant-offload-deeper": quant_offload_deeper,
    "quant-offload": quant_offload,
    "quant-offload-budget": quant_offload_budget,
    "peak-diff": peak_diff,
    "offload-lifecycle": offload_lifecycle,
    "offload-concurrency": offload_concurrency,
    "pipeline-offload": pipeline_offload,
    "pipeline-host-budget": pipeline_host_budget,
    "pipeline-host-lossless": pipeline_host_lossless,
    "dfloat11-decode": dfloat11_decode,
    "budget-never-slower": budget_never_slower,
    "readme-pipelines": readme_pipelines,
    "quality-h200": quality_h200,
    "diffusers-pipeline-tests": diffusers_pipeline_tests,
}


def render_page(text: str) -> str:
    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in RENDERERS:
            raise KeyError(f"docs table {name!r} has no renderer; known: {', '.join(RENDERERS)}")
        return match.group(1) + RENDERERS[name]() + match.group(4)

    return MARKER.sub(fill, text)


def pages() -> list[Path]:
    candidates = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in candidates if MARKER.search(p.read_text())]


# Plots: drawn from the same functions as the tables; each PNG carries a digest of the numbers it shows, so a test
# can tell when a plot no longer matches the results (a plot can never contradict its table).

def _digest(data) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _bar_panels(bars: list[dict], key: str, width: float, height: float):
    """One panel per ``group`` of ``bars`` (in first-seen order): ``(figure, [(axes, its bars, their colours)])``,
    omni's bars green, resident blue, the rest grey (``key`` names the bar's strategy field)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(b["group"] for b in bars))
    fig, axes = plt.subplots(1, len(groups), figsize=(width * len(groups), height), squeeze=False)
    panels = []
    for ax, group in zip(axes[0], groups):
        mine = [b for b in bars if b["group"] == group]
        colors = ["tab:green" if b[key].startswith("omni") else "tab:blue" if b[key] == "resident" else "tab:gray"
                  for b in mine]
        panels.append((ax, mine, colors))
    return fig, panels


def _save_plot(fig, path: Path, bars: list[dict]) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Description": f"data-sha256:{_digest(bars)}", "Software": None})
    plt.close(fig)


def plot_offload_summary(path: Path) -> None:
    bars = offload_plot_data()
    fig, panels = _bar_panels(bars, "variant", 4.2, 4.2)
    for ax, mine, colors in panels:
        group = mine[0]["group"]
        ax.bar(range(len(mine)), [b["step_s"] for b in mine], color=colors)
        for i, b in enumerate(mine):
            top = max(b["step_s"], b["target_s"] or 0)
            ax.text(i, top, f"{b['step_s']:.3f} s\n{b['peak_gib']:.2f} GiB", ha="center", va="bottom", fontsize=7)
            if b["target_s"] is not None:
                ax.hlines(b["target_s"], i - 0.4, i + 0.4, colors="tab:red", linestyles="--")
        labels = [b["variant"].replace("diffusers group_offload record_stream=", "Diffusers group\noffload, record_\n"
                                       "stream=").replace("omni ", "omni\n") for b in mine]
        ax.set_xticks(range(len(mine)), labels, fontsize=7)
        ax.set_title(group, fontsize=9)
        ax.set_ylabel("seconds per transformer forward")
        ax.margins(y=0.2)
    fig.suptitle("Offloaded step time and peak GPU memory (H200; red dashes: target)", fontsize=10)
    _save_plot(fig, path, bars)


def pipeline_plot_data() -> list[dict]:
    """The bars of ``pipeline_offload.png``: end to end and device peak of every strategy that completed, per
    pipeline (a companion run's strategies beside the first run's, its own resident left out)."""
    bars = []
    for name, label in PIPELINE_RUNS:
        report = result(name)
        for row, run, run_name in _pipeline_rows(name):
            if _pipeline_ok(row) and not (run_name != name and row["strategy"] == "resident"):
                bars.append({"group": f"{label}, {report['args']['card_gib']:g} GiB card, {report['steps']} steps",
                             "strategy": row["strategy"], "seconds": round(_end_to_end(row, report["steps"]), 3),
                             "measured_steps": row.get("steps", report["steps"]), "steps": report["steps"],
                             "peak_gib": round(row["device_peak_allocated"] / GiB, 2),
                             "card_gib": report["args"]["card_gib"], "budget": report["args"]["omni_budget"],
                             "second_run": run_name != name})
    return bars


def plot_pipeline_offload(path: Path) -> None:
    bars = pipeline_plot_data()
    fig, panels = _bar_panels(bars, "strategy", 5.2, 4.4)
    names = {"resident": "resident\n(no limit)", "omni": "omni\nlayerwise", "diffusers-group": "Diffusers\ngroup offload",
             "diffusers-model": "Diffusers\nmodel offload", "diffusers-sequential": "Diffusers\nsequential",
             "mmgp2": "mmgp\nprofile 2", "mmgp4": "mmgp\nprofile 4"}
    for ax, mine, colors in panels:
        group = mine[0]["group"]
        ax.bar(range(len(mine)), [b["seconds"] for b in mine], color=colors)
        for i, b in enumerate(mine):
            scaled = f"\n(ran {b['measured_steps']} steps,\ndenoise scaled)" if b["measured_steps"] != b["steps"] else ""
            ax.text(i, b["seconds"], f"{b['seconds']:.1f} s{scaled}\n{b['peak_gib']:.1f} GiB", ha="center",
                    va="bottom", fontsize=7)
        labels = [names.get(b["strategy"], f"omni\n{b['budget']} budget") + (" ²" if b["second_run"] else "")
                  for b in mine]
        ax.set_xticks(range(len(mine)), labels, fontsize=7)
        ax.set_title(group, fontsize=9)
        ax.set_ylabel("seconds, prompt to image or video")
        ax.margins(y=0.2)
    title = "Whole pipelines on an emulated card: end to end and device peak (H200)"
    drift = [abs(_resident(result(c))["end_to_end_s"] / _resident(result(n))["end_to_end_s"] - 1)
             for n, c in PIPELINE_COMPANIONS.items()]
    if any(b["second_run"] for b in bars):
        title += (f"\n²: a second run, times as measured; its resident pipeline ran within {max(drift):.0%} of the "
                  "first run's")
    fig.suptitle(title, fontsize=10)
    _save_plot(fig, path, bars)


PLOTS = {"offload_summary.png": (plot_offload_summary, offload_plot_data),
         "pipeline_offload.png": (plot_pipeline_offload, pipeline_plot_data)}


# Plots the docs site serves itself (a page under docs/ cannot show a file outside it): the same drawing, beside the
# page that shows it (docs/index.md's measured picture).
SITE_PLOTS = {"offload_summary.png": ROOT / "docs" / "assets"}


def plot_is_current(name: str, directory: Path | None = None) -> bool:
    from PIL import Image

    path = (directory or RESULTS) / name
    if not path.exists():
        return False
    with Image.open(path) as image:
        return image.text.get("Description") == f"data-sha256:{_digest(PLOTS[name][1]())}"


# The package page: PyPI shows the README as the long description, where a relative link or image is broken and the
# install line is the released wheel's. PYPI_DESCRIPTION (pyproject's ``readme``) is the README rendered for it:
# ``<!-- pypi: omit -->`` … ``<!-- /pypi -->`` left out, ``<!-- pypi: only`` … ``-->`` shown, every relative link made
# the repository's URL and every relative image its raw file's, other HTML comments dropped.

REPO_URL = "https://github.com/diffusers-omni/diffusers-omni"
RAW_URL = "https://raw.githubusercontent.com/diffusers-omni/diffusers-omni/main"
PYPI_DESCRIPTION = ROOT / "PYPI.md"
_PYPI_OMIT = re.compile(r"<!-- pypi: omit -->\n.*?<!-- /pypi -->\n?", re.S)
_PYPI_ONLY = re.compile(r"<!-- pypi: only\n(.*?)-->\n?", re.S)
_COMMENT = re.compile(r"<!--.*?-->\n?", re.S)
_MD_LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"(```.*?```)", re.S)


def absolute_url(target: str, image: bool, root: Path = ROOT) -> str:
    """``target`` of a link or image on a page at the repository root, as an absolute URL."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return target
    if target.startswith("#"):
        return REPO_URL + target
    path, _, anchor = target.partition("#")
    if image:
        return f"{RAW_URL}/{path}"
    kind = "tree" if path.endswith("/") or (root / path).is_dir() else "blob"
    return f"{REPO_URL}/{kind}/main/{path.rstrip('/')}" + (f"#{anchor}" if anchor else "")


def pypi_description(readme: str) -> str:
    """The README as the package page shows it (see ``PYPI_DESCRIPTION``)."""
    text = _PYPI_ONLY.sub(lambda m: m[1], _PYPI_OMIT.sub("", readme))
    text = _COMMENT.sub("", text)
    parts = _FENCE.split(text)
    for i in range(0, len(parts), 2):  # links outside code blocks
        parts[i] = _MD_LINK.sub(lambda m: f"{m[1]}[{m[2]}]({absolute_url(m[3], bool(m[1]))})", parts[i])
    return re.sub(r"\n{3,}", "\n\n", "".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale tables, change nothing")
    args = parser.parse_args()
    stale = []
    for name, (draw, _) in PLOTS.items():
        if not plot_is_current(name):
            stale.append(Path("benchmarks/results") / name)
            if not args.check:
                draw(RESULTS / name)
    for name, directory in SITE_PLOTS.items():
        if not plot_is_current(name, directory):
            stale.append((directory / name).relative_to(ROOT))
            if not args.check:
                directory.mkdir(parents=True, exist_ok=True)
                PLOTS[name][0](directory / name)
    for page in pages():
        text = page.read_text()
        rendered = render_page(text)
        if rendered != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(rendered)
    description = pypi_description((ROOT / "README.md").read_text())
    if not PYPI_DESCRIPTION.exists() or PYPI_DESCRIPTION.read_text() != description:
        stale.append(PYPI_DESCRIPTION.relative_to(ROOT))
        if not args.check:
            PYPI_DESCRIPTION.write_text(description)
    verb = "stale" if args.check else "rewritten"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "docs tables match the results")
    if args.check and stale:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
