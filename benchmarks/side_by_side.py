"""The offload benchmark of this tree beside a baseline commit's, as one result: ``benchmarks/h200/side_by_side.sh``
runs ``benchmarks/offload_bench.py`` for both trees on the device and brings back one archive
(``side_by_side.tgz``: ``baseline-<model>-<budget>.json``, ``current-<model>-<budget>.json``, their .md/.png and
``commits.txt``); this script reads that archive and writes one payload comparing the step times.

    # on the device (the runner files it under benchmarks/results/offload-side-by-side/):
    BASELINE_COMMIT=BASE OMNI_COMMIT=$(git rev-parse HEAD) python -m benchmarks run offload-side-by-side
    # an archive brought back from a device call that ran side_by_side.sh directly:
    python -m benchmarks.side_by_side --collect side_by_side.tgz --out X             # X.json (payload), X.md
    python -m benchmarks.side_by_side --collect side_by_side.tgz --file-result       # + results_io's latest.json

Each spec is side_by_side.sh's argument, ``MODEL:BASELINE_VARIANTS:CURRENT_VARIANTS[:BUDGET]`` (an empty
BASELINE_VARIANTS runs only the current tree). The payload: ``baseline_commit``, ``current_commit``, ``runs`` (every
offload_bench report in the archive, by file name) and ``comparison``: for each model and each variant both trees
ran, the two median step times, current / baseline and ``within_2_percent`` (ratio ≤ 1.02); a row for each variant
only one tree ran (the current tree's new variants, e.g. ``omni layerwise lossless``, with its code's figures).
Without ``--collect`` it runs side_by_side.sh (the device: .baseline/ and .whl/ carried; see the script's header) with
``OUT`` set to a temporary folder, then collects that archive; a failed run still writes what finished and exits with
the script's status.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from benchmarks import results_io

SCENARIO = "offload-side-by-side"
SCRIPT = "benchmarks/h200/side_by_side.sh"
ARCHIVE = "side_by_side.tgz"
WITHIN = 1.02
# What a variant only one tree ran is reported with (those its report holds).
SINGLE_FIELDS = ("step_s", "setup_s", "peak_device_bytes", "same_output_as_resident", "coded_ratio",
                 "ratio_to_bf16_floor", "stream_floor_s", "moved_bytes", "streamed_bytes", "decode_kernel")
SIDES = ("baseline", "current")


def read_archive(archive: Path) -> tuple[dict[str, str], dict[str, dict], str | None]:
    """(commits, reports by run name, the run's date): ``commits.txt`` as ``{"baseline": hash, "current": hash}``,
    every ``baseline-*.json`` / ``current-*.json`` by file stem, and when commits.txt was written (UTC, ISO 8601;
    the script writes it before the first run), ``None`` when the archive has none."""
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(archive) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
        tar.extractall(tmp, filter="data")
        files = {name: next(Path(tmp).rglob(name)) for name in members}
        commits: dict[str, str] = {}
        date = None
        if "commits.txt" in files:
            for line in files["commits.txt"].read_text().splitlines():
                side, _, commit = line.strip().partition(" ")
                if side in SIDES:
                    commits[side] = commit.strip() or results_io.UNKNOWN
            date = datetime.datetime.fromtimestamp(members["commits.txt"].mtime, datetime.timezone.utc)
            date = date.isoformat(timespec="seconds")
        reports = {}
        for name in sorted(files):
            if name.endswith(".json") and name.startswith(tuple(f"{side}-" for side in SIDES)):
                try:
                    reports[name[:-len(".json")]] = json.loads(files[name].read_text())
                except json.JSONDecodeError as error:  # a run cut short mid-write
                    print(f"[side_by_side] {name}: not JSON ({error}); left out", file=sys.stderr)
    return {side: commits.get(side, results_io.UNKNOWN) for side in SIDES}, reports, date


def _variants(reports: dict[str, dict], side: str) -> dict[tuple[str, str], dict[str, dict]]:
    """(tag, model) → variant label → the variant's record, for one side's runs (tag: ``<model>-<budget>``)."""
    found: dict[tuple[str, str], dict[str, dict]] = {}
    for name, report in reports.items():
        if not name.startswith(f"{side}-"):
            continue
        tag = name[len(side) + 1:]
        for entry in report.get("models", []):
            found.setdefault((tag, entry["model"]), {}).update({v["variant"]: v for v in entry["variants"]})
    return found


def compare(reports: dict[str, dict]) -> list[dict]:
    """The comparison rows: per run tag and model, each variant both trees ran (step times, ratio, within 2 %),
    then each variant only one tree ran."""
    baseline, current = _variants(reports, "baseline"), _variants(reports, "current")
    rows = []
    for tag, model in sorted(set(baseline) | set(current)):
        old, new = baseline.get((tag, model), {}), current.get((tag, model), {})
        budget = tag[len(model) + 1:] if tag.startswith(f"{model}-") else None
        for label in [v for v in new if v in old]:
            ratio = new[label]["step_s"] / old[label]["step_s"]
            row = {"model": model, "budget": budget, "variant": label, "baseline_step_s": old[label]["step_s"],
                   "current_step_s": new[label]["step_s"], "ratio": ratio, "within_2_percent": ratio <= WITHIN}
            for side, record in (("baseline", old[label]), ("current", new[label])):
                for key in ("same_output_as_resident", "peak_device_bytes"):
                    row[f"{side}_{key}"] = record.get(key)
            rows.append(row)
        for side, only, other in (("current", new, old), ("baseline", old, new)):
            for label in [v for v in only if v not in other]:
                row = {"model": model, "budget": budget, "variant": label, "only": side,
                       f"{side}_step_s": only[label]["step_s"]}
                row.update({k: only[label][k] for k in SINGLE_FIELDS if k in only[label] and k != "step_s"})
                rows.append(row)
    return rows


def collect(archive: Path) -> tuple[dict, str | None]:
    """(payload, the run's date) of a side_by_side.tgz."""
    commits, reports, date = read_archive(archive)
    return {"baseline_commit": commits["baseline"], "current_commit": commits["current"], "runs": reports,
            "comparison": compare(reports)}, date


def _step(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def _same(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "NO")


def _gib(value: float | None) -> str:
    return "—" if value is None else f"{value / 2**30:.2f} GiB"


def markdown(payload: dict) -> str:
    base, cur = payload["baseline_commit"], payload["current_commit"]
    device = next((r.get("environment", {}).get("device_name") for r in payload["runs"].values()), None)
    lines = ["# Offload benchmark: this tree beside a baseline commit", "",
             f"baseline `{base[:12]}`, current `{cur[:12]}`{f', {device}' if device else ''} "
             f"({SCRIPT}: offload_bench of both trees in one device call). Median step of one transformer forward; "
             f"ratio = current / baseline (within 2 %: ≤ {WITHIN}).", ""]
    if not payload["comparison"]:
        lines += ["No offload_bench report in the archive (every run failed or was cut short).", ""]
    groups: dict[tuple[str, str | None], list[dict]] = {}
    for row in payload["comparison"]:
        groups.setdefault((row["model"], row["budget"]), []).append(row)
    for (model, budget), rows in groups.items():
        lines += [f"## {model}" + (f" (budget {budget})" if budget else ""), "",
                  "| Variant | Baseline step (s) | Current step (s) | Ratio | Same output as resident |",
                  "|---|---|---|---|---|"]
        for row in rows:
            if "only" in row:
                same = _same(row.get("same_output_as_resident"))
                ratio = f"{row['only']} only"
            else:
                same = (f"{_same(row['baseline_same_output_as_resident'])} / "
                        f"{_same(row['current_same_output_as_resident'])}")
                ratio = f"{row['ratio']:.3f}" + ("" if row["within_2_percent"] else " (> 1.02)")
            lines.append(f"| {row['variant']} | {_step(row.get('baseline_step_s'))} | "
                         f"{_step(row.get('current_step_s'))} | {ratio} | {same} |")
        coded = [row for row in rows if "coded_ratio" in row]
        if coded:
            lines += ["", "compression=\"lossless\":", ""]
            for row in coded:
                floor = row.get("ratio_to_bf16_floor")
                lines.append(
                    f"- {row['variant']}: step {_step(row.get('current_step_s', row.get('baseline_step_s')))} s"
                    + (f" = {floor:.3f} × the bf16 floor" if floor is not None else "")
                    + f"; coded to {row['coded_ratio']:.3f} of the bf16 bytes, {_gib(row.get('moved_bytes'))} moved "
                      f"per step, decoded by {row.get('decode_kernel', '—')}; same output as resident: "
                      f"{_same(row.get('same_output_as_resident'))}")
        lines.append("")
    return "\n".join(lines)


def device_command(payload: dict, specs: list[str]) -> list[str]:
    """The side_by_side.sh command that made the archive: ``specs`` as given, else rebuilt from the reports' args
    (variants in sorted order: offload_bench records them as a set)."""
    if not specs:
        by_tag: dict[str, dict[str, dict]] = {}
        for name, report in payload["runs"].items():
            side, _, tag = name.partition("-")
            by_tag.setdefault(tag, {})[side] = report.get("args", {})
        for tag, sides in sorted(by_tag.items()):
            args = sides.get("current") or sides.get("baseline") or {}

            def variants(side_args: dict | None) -> str:
                raw = (side_args or {}).get("variants", "")
                try:
                    parsed = ast.literal_eval(raw) if isinstance(raw, str) else raw
                except (ValueError, SyntaxError):
                    return str(raw)
                return ",".join(sorted(parsed)) if isinstance(parsed, (set, list, tuple)) else str(parsed)

            model = ",".join(args.get("models", [])) or tag.rpartition("-")[0]
            budget = args.get("budget", tag.rpartition("-")[2])
            specs.append(f"{model}:{variants(sides.get('baseline'))}:{variants(sides.get('current'))}:{budget}")
    return ["bash", SCRIPT, *specs]


def result_meta(payload: dict, date: str | None, specs: list[str], archive: Path) -> dict:
    """The results_io meta block of an archive's run: its commit is the current tree's (commits.txt, written from
    ``$OMNI_COMMIT`` on the device), its versions and GPU the current report's environment, its date when
    commits.txt was written; the command is side_by_side.sh's, and ``collected_by`` says how it was filed."""
    commit = payload["current_commit"]
    if commit == results_io.UNKNOWN:
        raise SystemExit(f"{archive}: commits.txt gives no current commit (OMNI_COMMIT was not set on the device); "
                         "not filed (results_io needs the commit the numbers belong to)")
    env = next((r.get("environment", {}) for n, r in sorted(payload["runs"].items()) if n.startswith("current-")),
               {})
    versions = {"python": env.get("python", results_io.UNKNOWN),
                **{p: results_io.UNKNOWN for p in results_io.PACKAGES}}
    versions.update({k: env[k] for k in ("torch", "diffusers") if k in env})
    gpu = {"name": env["device_name"], "compute_capability": results_io.UNKNOWN} if "device_name" in env else "cpu"
    return {"schema": results_io.SCHEMA_VERSION, "scenario": SCENARIO, "suite": SCENARIO, "label": None,
            "smoke": False, "commit": commit, "commit_source": "OMNI_COMMIT", "dirty": None,
            "date": date or results_io.UNKNOWN, "versions": versions, "gpu": gpu,
            "command": device_command(payload, list(specs)), "exit_status": 0, "artifacts": [],
            "collected_by": ["python", "-m", "benchmarks.side_by_side", "--collect", archive.name, "--file-result"],
            "baseline_commit": payload["baseline_commit"]}


def run_device(specs: list[str], out_dir: Path, baseline_commit: str | None) -> int:
    env = dict(os.environ, OUT=str(out_dir))
    if baseline_commit:
        env["BASELINE_COMMIT"] = baseline_commit
    if "OMNI_COMMIT" not in env:
        commit, _, _ = results_io.git_commit()
        if commit != results_io.UNKNOWN:
            env["OMNI_COMMIT"] = commit
    print(f"[side_by_side] bash {SCRIPT} {' '.join(specs)}", flush=True)
    return subprocess.run(["bash", SCRIPT, *specs], cwd=results_io.ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side", description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", help="MODEL:BASELINE_VARIANTS:CURRENT_VARIANTS[:BUDGET], as "
                                                 "side_by_side.sh takes them")
    parser.add_argument("--out", default=None, help="output prefix: PREFIX.json (the payload) and PREFIX.md")
    parser.add_argument("--collect", type=Path, default=None,
                        help=f"a {ARCHIVE} already made on the device: read it instead of running {SCRIPT}")
    parser.add_argument("--baseline-commit", default=os.environ.get("BASELINE_COMMIT"),
                        help="the baseline tree's commit, for commits.txt (default $BASELINE_COMMIT)")
    parser.add_argument("--file-result", action="store_true",
                        help=f"also file the result as benchmarks/results/{SCENARIO}/latest.json through "
                             "results_io (meta from the archive: commits.txt, the reports' environment)")
    parser.add_argument("--results-root", type=Path, default=results_io.RESULTS,
                        help="where --file-result files it (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.out is None and not args.file_result:
        parser.error("give --out PREFIX, --file-result or both")
    if args.collect is None and not args.specs:
        parser.error("give specs to run, or --collect ARCHIVE")
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        archive = args.collect
        if archive is None:
            status = run_device(args.specs, Path(tmp), args.baseline_commit)
            archive = Path(tmp) / ARCHIVE
            if not archive.is_file():
                print(f"[side_by_side] {SCRIPT} exited {status} and wrote no {ARCHIVE}", file=sys.stderr)
                return status or 1
        elif not archive.is_file():
            parser.error(f"--collect: {archive} is not a file")
        payload, date = collect(archive)
        text = markdown(payload)
        if args.out is not None:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
            out.with_suffix(".md").write_text(text)
            print(f"[side_by_side] wrote {out.with_suffix('.json')}, .md")
        if args.file_result:
            if status != 0:
                print(f"[side_by_side] {SCRIPT} exited {status}: not filed", file=sys.stderr)
            else:
                meta = result_meta(payload, date, args.specs, archive)
                md = Path(tmp) / "latest.md"
                md.write_text(text)
                path = results_io.write_result(SCENARIO, payload, meta, {".md": md}, args.results_root)
                print(f"[side_by_side] filed {path}")
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
