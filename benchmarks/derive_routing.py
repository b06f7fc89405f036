"""Derive ``diffusers_omni/attention/routing_table.json`` from committed attention benchmark results.

For each platform family and shape class (q-length bucket, kv-length bucket, head_dim, masked) the ranking lists
the backends measured there, best first: among backends whose TFLOP/s is within ``--tolerance`` of the fastest at
every shape of the class, the one earliest in ``PREFERENCE`` comes first (TORCH_SDPA first: the reference, with a
backward everywhere); the others follow by speed. Only rows that are backends (``is_backend``) count, and of those
neither lossy kernels (``lossy``: INT8 SageAttention) nor Hub kernels (``*_HUB``: a download, chosen explicitly for
training/rollout parity) are ever a default.

    python -m benchmarks.derive_routing benchmarks/results/attention/latest.json \
        --check benchmarks/results/attention/routing_check.md --fp8 benchmarks/results/hopper/latest.json \
        --lossy benchmarks/results/tune-lossy/latest.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


from diffusers_omni.attention.routing import BUCKET_EDGES, TABLE_PATH, rule_key

PREFERENCE = ("TORCH_SDPA", "CUDNN_ATTN", "FLASH_ATTN", "FLASHINFER_ATTN")


def routable(name: str, row: dict) -> bool:
    return bool(row.get("is_backend")) and not row.get("lossy") and not name.endswith("_HUB")


def derive(results: list[dict], tolerance: float = 0.03) -> dict:
    # ratios[family][key][backend] = list of (tflops / fastest tflops) over the shapes of the class
    ratios: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    sources = []
    for result in results:
        family = result["platform"]["family"]
        sources.append(f"{result['platform']['device_name']} torch {result['torch']} {result['date']}")
        for shape in result["shapes"]:
            rows = {n: r for n, r in shape["results"].items() if routable(n, r)}
            if not rows:
                continue
            fastest = max(r["tflops"] for r in rows.values())
            key = rule_key(shape["Sq"], shape["Skv"], shape["D"], shape["masked"])
            for name, row in rows.items():
                ratios[family][key][name].append(row["tflops"] / fastest)
    families = {}
    for family, classes in ratios.items():
        families[family] = {}
        for key, per_backend in sorted(classes.items()):
            worst = {name: min(values) for name, values in per_backend.items()}
            within = [n for n in worst if worst[n] >= 1 - tolerance]
            rank = lambda n: (PREFERENCE.index(n) if n in PREFERENCE else len(PREFERENCE), -worst[n])  # noqa: E731
            ranking = sorted(within, key=rank) + sorted(set(worst) - set(within), key=lambda n: -worst[n])
            families[family][key] = {"ranking": ranking, "worst_ratio": {n: round(worst[n], 4) for n in ranking}}
    return {"tolerance": tolerance, "bucket_edges": list(BUCKET_EDGES), "sources": sources, "families": families}


FP8_MARGIN = 0.02


def derive_fp8(results: list[dict], margin: float = FP8_MARGIN) -> dict:
    """FP8 rules per platform family and shape class from ``hopper_bench.py`` results: a class runs FP8 only when the
    whole FP8 call (quantisation included) beat FA3 bf16 by at least ``margin`` at every measured shape of the class."""
    speedups: dict = defaultdict(lambda: defaultdict(list))
    for result in results:
        family = result["platform"]["family"]
        for row in result.get("fp8", []):
            if row.get("speedup") is None:
                continue
            key = rule_key(row["Sq"], row["Skv"], row["D"], row["masked"])
            speedups[family][key].append(row["speedup"])
    return {
        family: {key: {"fp8": min(values) >= 1 + margin, "worst_speedup": round(min(values), 4)}
                 for key, values in sorted(classes.items())}
        for family, classes in speedups.items()
    }


def derive_sparse(results: list[dict]) -> dict:
    """Block-sparse break-even per platform family and shape class from ``hopper_bench.py`` results: the kept share
    of key blocks above which the block-sparse call is slower than the dense FA3 call of the same shape, from a
    least-squares line of sparse time against kept share (cumulative-mass rows where measured: their selection
    costs more; top-k rows otherwise). RAINFUSION_ATTN runs such calls dense."""
    rules: dict = {}
    for result in results:
        family = result["platform"]["family"]
        rows = result.get("sparse", {}).get("timings", [])
        by_shape: dict = defaultdict(list)
        for row in rows:
            by_shape[row["shape"]].append(row)
        for name, shape_rows in by_shape.items():
            mass = [r for r in shape_rows if r.get("mass_threshold") is not None]
            use = mass if len(mass) >= 2 else [r for r in shape_rows if r.get("mass_threshold") is None]
            if len(use) < 2:
                continue
            xs = [r["kept_share"] for r in use]
            ys = [r["sparse_ms"] for r in use]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            dense = use[0]["dense_fa3_ms"]
            share = (dense - (my - slope * mx)) / slope if slope > 0 else 1.0
            seq = use[0]["S"]
            key = rule_key(seq, seq, use[0].get("D", 128), False)
            rules.setdefault(family, {})[key] = {
                "dense_above_kept_share": round(min(max(share, 0.0), 1.0), 3),
                "from": f"{name}: {'cumulative-mass' if use is mass else 'top-k'} rows, dense FA3 {dense:.2f} ms",
            }
    return rules


# tune_bench.py's lossy labels → the setting's key (``routing.lossy_key``).
LOSSY_LABELS = {
    "FP8 FLASH_ATTN": "FLASH_ATTN fp8_e4m3",
    "SAGE_ATTN (INT8)": "SAGE_ATTN",
    "RainFusion sparsity 0.5": "RAINFUSION_ATTN sparsity=0.5",
    "RainFusion sparsity 0.8": "RAINFUSION_ATTN sparsity=0.8",
    "RainFusion cumulative mass 0.9": "RAINFUSION_ATTN mass_threshold=0.9",
}
EXACT_LABEL = "FLASH_ATTN bf16 (exact)"


def derive_lossy(results: list[dict], sources: list[str]) -> dict:
    """Per lossy setting, what ``tune_bench.py --lossy`` measured on each model: the relative error of the whole
    transformer output against Diffusers' native attention (and the exact FLASH_ATTN bf16 kernel's own, for scale),
    and its step time against the fastest exact configuration. Read by the warning logged when a lossy backend is
    enabled (``routing.measured_error``)."""
    out: dict = defaultdict(list)
    for result, source in zip(results, sources):
        for model in result["models"].values():
            lossy = model.get("lossy", {})
            exact = lossy.get(EXACT_LABEL, {}).get("rel_err_vs_native")
            for label, row in lossy.items():
                key = row.get("lossy_key") or LOSSY_LABELS.get(label)
                if key is None or "rel_err_vs_native" not in row:
                    continue
                out[key].append({
                    "model": f"{model['label']}, random weights, {result['device']}",
                    "rel_err": round(row["rel_err_vs_native"], 5),
                    "exact_rel_err": round(exact, 5) if exact is not None else None,
                    "step_s": round(row["step_s"], 4),
                    "exact_step_s": round(row["exact_fastest_step_s"], 4),
                    "source": source,
                })
    return dict(out)


def distinct_exact(shape: dict) -> dict:
    """A shape's rows for distinct exact kernels: no lossy kernel, no Hub backend that fell back to FLASH_ATTN."""
    return {n: r for n, r in shape["results"].items()
            if r.get("is_backend") and not r.get("lossy") and not r.get("runs_as")}


def routed_choices(results: dict, table: dict) -> list[tuple[dict, str, str]]:
    """Per benchmark shape: (shape, what a platform-default role is routed to under ``table`` among the backends
    measured there, the fastest distinct exact backend of the same run)."""
    from diffusers_omni.attention.routing import ShapeRouter

    choices = []
    for shape in results["shapes"]:
        rows = distinct_exact(shape)
        candidates = {"TORCH_SDPA": None, **{n: None for n in rows if routable(n, rows[n])}}
        chosen = ShapeRouter(results["platform"]["family"], candidates, table).choose(
            shape["Sq"], shape["Skv"], shape["D"], shape["masked"])
        choices.append((shape, chosen, max(rows, key=lambda n: rows[n]["tflops"])))
    return choices


def check(results: dict, table: dict) -> str:
    """Markdown: per benchmark shape, what the table routes a platform-default role to (among the backends measured
    there) against the fastest distinct exact backend of the same run."""
    lines = [
        f"# Routing check: {Path(TABLE_PATH).name} against {results['platform']['device_name']} results "
        f"({results['date']})",
        "",
        "Routed = the choice of a platform-default role under the committed table (TORCH_SDPA first, then the "
        "backends the table ranks). Fastest = fastest distinct exact backend measured in the same run (lossy kernels "
        "and Hub backends that fell back to FLASH_ATTN excluded).",
        "",
        "| Shape | Routed | Fastest | routed / fastest | within 3% |",
        "|---|---|---|---|---|",
    ]
    for shape, chosen, fastest in routed_choices(results, table):
        ratio = shape["results"][chosen]["tflops"] / shape["results"][fastest]["tflops"]
        lines.append(f"| {shape['shape']} | {chosen} | {fastest} | {ratio:.3f} | "
                     f"{'yes' if ratio >= 1 - table['tolerance'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="attention_bench.py JSON results")
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--out", default=str(TABLE_PATH))
    parser.add_argument("--check", default=None, help="also write a markdown routing check of the first results file")
    parser.add_argument("--lossy", nargs="*", default=[], help="tune_bench.py --lossy JSON results (lossy errors)")
    parser.add_argument("--fp8", nargs="*", default=[],
                        help="hopper_bench.py JSON results (FP8 rules and block-sparse break-evens)")
    args = parser.parse_args()
    from benchmarks.results_io import read

    def payload(path: str) -> dict:  # results are {"meta", "payload"} files of the suite (benchmarks/results_io.py)
        return read(Path(path))["payload"]

    table = derive([payload(p) for p in args.results], args.tolerance)
    if args.fp8:
        table["fp8_margin"] = FP8_MARGIN
        table["fp8"] = derive_fp8([payload(p) for p in args.fp8])
        table["sparse"] = derive_sparse([payload(p) for p in args.fp8])
    if args.lossy:
        table["lossy"] = derive_lossy([payload(p) for p in args.lossy], args.lossy)
    Path(args.out).write_text(json.dumps(table, indent=2) + "\n")
    if args.check:
        Path(args.check).write_text(check(payload(args.results[0]), table))
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
