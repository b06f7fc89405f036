"""The benchmark runner: list the scenarios, run one, file results written on another machine.

    python -m benchmarks --list                          # every scenario: script, device, docs it feeds
    python -m benchmarks run NAME [--smoke] [--label TEXT] [--results-root DIR] [[--] SCRIPT OPTIONS...]
    python -m benchmarks adopt DIR                       # file DIR/<suite>/latest.* (the device's $OUT) here

``run`` runs the scenario's script (``benchmarks/registry.py``) in a child process with its registered options and
an output location the runner chooses (``<root>/<suite>/.running/``), then files what it wrote through
``benchmarks.results_io``: ``<root>/<suite>/latest.json`` = ``{"meta", "payload"}``, the previous latest moved to
``archive/<date>-<commit>[-<label>]``. A failed run files nothing (``latest`` stays) and leaves its output in
``.running/``. ``--smoke`` runs the script's quick self-check; its results go to a scratch root
(``$TMPDIR/diffusers-omni-benchmarks``) unless ``--results-root`` is given, never to ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import registry, results_io

SMOKE_ROOT = Path(tempfile.gettempdir()) / "diffusers-omni-benchmarks"


def list_scenarios() -> str:
    rows = [("scenario", "script", "device", "smoke", "measures", "docs it feeds")]
    for s in registry.SCENARIOS:
        docs = ", ".join(d.removeprefix("docs/user_guide/").removeprefix("docs/") for d in s.docs) or "—"
        suites = "" if len(s.suites) == 1 else f" (also writes {', '.join(s.suites[1:])})"
        rows.append((s.name, f"benchmarks/{s.script}.py", s.device, "yes" if s.smoke is not None else "no",
                     s.measures + suites, docs))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def _command(scenario: registry.Scenario, staging: Path, smoke: bool, label: str | None,
             extra: list[str]) -> list[str]:
    if scenario.launcher == "torchrun":
        import torch

        nproc = 2 if smoke else max(torch.cuda.device_count(), 1)
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    else:
        head = [sys.executable]
    out = {"prefix": staging / "run", "file": staging / "run.json", "folder": staging / "run"}[scenario.out]
    command = [*head, "-m", f"benchmarks.{scenario.script}", *scenario.args]
    if smoke:
        command += scenario.smoke
    if label is not None and scenario.label_arg:
        command += [scenario.label_arg, label]
    for suite, option in scenario.extra_outputs:
        command += [option, str(staging / f"{suite}.json")]
    return [*command, *extra, "--out", str(out)]


def _outputs(scenario: registry.Scenario, staging: Path) -> dict[str, tuple[Path, dict[str, Path]]]:
    """suite → (payload file, sidecars) of what the script wrote in ``staging``."""
    if scenario.out == "folder":
        folder = staging / "run"
        payload = folder / scenario.payload
        outputs = {scenario.name: (payload, {"/": folder})}
    else:
        payload = staging / "run.json"
        sidecars = {s: staging / f"run{s}" for s in results_io.SIDECARS if (staging / f"run{s}").exists()}
        outputs = {scenario.name: (payload, sidecars)}
    for suite, _ in scenario.extra_outputs:
        outputs[suite] = (staging / f"{suite}.json", {})
    return outputs


def run(name: str, *, smoke: bool = False, label: str | None = None, root: Path | None = None,
        extra: list[str] | None = None) -> int:
    """Run scenario ``name`` and file its results under ``root``; the script's exit status."""
    scenario = registry.get(name)
    if smoke and scenario.smoke is None:
        have = ", ".join(s.name for s in registry.SCENARIOS if s.smoke is not None)
        raise SystemExit(f"scenario {name!r} has no smoke mode (its script has no quick self-check); scenarios "
                         f"with one: {have}")
    root = Path(root) if root is not None else (SMOKE_ROOT if smoke else results_io.RESULTS)
    label = label if label is not None else scenario.label
    staging = results_io.suite_dir(scenario.name, root) / ".running"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if scenario.out == "folder":
        (staging / "run").mkdir()
    if scenario.merges_previous and results_io.run_path(scenario.name, root=root).is_file():
        previous = results_io.read(results_io.run_path(scenario.name, root=root))["payload"]
        (staging / "run.json").write_text(json.dumps(previous, indent=1) + "\n")
    command = _command(scenario, staging, smoke, label, list(extra or []))
    printable = ["python" if part == sys.executable else part for part in command]
    metas = {suite: results_io.collect_meta(scenario.name, suite, printable, smoke=smoke, label=label)
             for suite in scenario.suites}
    print(f"[benchmarks] {scenario.name}: {' '.join(printable)}", flush=True)
    status = subprocess.run(command, cwd=results_io.ROOT).returncode
    if status != 0:
        print(f"[benchmarks] {scenario.name} failed (exit {status}); nothing filed, latest unchanged; its output is "
              f"in {staging}", file=sys.stderr)
        return status
    outputs = _outputs(scenario, staging)
    main_payload = outputs[scenario.name][0]
    if not main_payload.is_file():
        print(f"[benchmarks] {scenario.name} exited 0 but wrote no {main_payload}; nothing filed", file=sys.stderr)
        return 1
    for suite, (payload_path, _) in list(outputs.items()):
        if not payload_path.is_file():  # an extra report the script did not write (its section failed or was skipped)
            print(f"[benchmarks] {scenario.name} wrote no {suite} report; {suite}'s latest stays", file=sys.stderr)
            del outputs[suite]
    for suite, (payload_path, sidecars) in outputs.items():
        payload = json.loads(payload_path.read_text())
        payload_path.unlink()
        path = results_io.write_result(suite, payload, metas[suite], sidecars, root)
        print(f"[benchmarks] wrote {path}", flush=True)
    shutil.rmtree(staging, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list every scenario")
    commands = parser.add_subparsers(dest="command")
    run_parser = commands.add_parser("run", help="run one scenario and file its results")
    run_parser.add_argument("name", help="a scenario (python -m benchmarks --list)")
    run_parser.add_argument("--smoke", action="store_true", help="the script's quick self-check (scratch results)")
    run_parser.add_argument("--label", default=None, help="what is special about this run (default: the scenario's)")
    run_parser.add_argument("--results-root", type=Path, default=None,
                            help=f"where suites live (default {results_io.RESULTS.relative_to(results_io.ROOT)}; "
                                 f"{SMOKE_ROOT} with --smoke)")
    adopt_parser = commands.add_parser("adopt", help="file results written under another root (the device's $OUT)")
    adopt_parser.add_argument("source", type=Path, help="a folder holding <suite>/latest.json")
    adopt_parser.add_argument("--results-root", type=Path, default=results_io.RESULTS)
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # after --: the script's own options
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args, unknown = parser.parse_known_args(argv)  # options the runner does not know go to the script too
    extra = unknown + extra
    if extra and args.command != "run":
        parser.error(f"unknown options {' '.join(extra)}: only `run` passes options on to a scenario's script")
    if args.list:
        print(list_scenarios())
        return 0
    if args.command == "run":
        try:
            return run(args.name, smoke=args.smoke, label=args.label, root=args.results_root, extra=extra)
        except KeyError as error:
            parser.error(error.args[0])
    if args.command == "adopt":
        if not args.source.is_dir():
            parser.error(f"adopt: {args.source} is not a folder (give the folder holding <suite>/latest.json)")
        filed = results_io.adopt(args.source, args.results_root)
        print(f"filed: {', '.join(filed)}" if filed else f"no <suite>/latest.json under {args.source}")
        return 0 if filed else 1
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
