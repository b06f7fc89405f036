"""Derive ``diffusers_omni/attention/routing_table.json`` from committed attention benchmark results.

For each platform family and shape class (q-length bucket, kv-length bucket, head_dim, masked) the ranking lists
the backends measured there, best first: among backends whose TFLOP/s is within ``--tolerance`` of the fastest at
every shape of the class, the one earliest in ``PREFERENCE`` comes first (TORCH_SDPA first: the reference, with a
backward everywhere); the others follow by speed. Only rows that are backends (``is_backend``) count, and of those
neither lossy kernels (``lossy``: INT8 SageAttention) nor Hub kernels (``*_HUB``: a download, chosen explicitly for
training/rollout parity) are ever a default.

    python -m benchmarks.derive_routing benchmarks/results/attention_h200.json \
        --check benchmarks/results/attention_h200_routing_check.md
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
    args = parser.parse_args()
    table = derive([json.loads(Path(p).read_text()) for p in args.results], args.tolerance)
    Path(args.out).write_text(json.dumps(table, indent=2) + "\n")
    if args.check:
        Path(args.check).write_text(check(json.loads(Path(args.results[0]).read_text()), table))
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
