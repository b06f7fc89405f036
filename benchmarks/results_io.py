"""The one result writer (and reader) of the benchmark suite.

Every result is a JSON object ``{"meta": {...}, "payload": {...}}``: ``payload`` is what the scenario's script
measured, in its own shape; ``meta`` says where it came from, in one shape for every scenario::

    schema          SCHEMA_VERSION
    scenario        the registry entry that ran (benchmarks/registry.py)
    suite           the results folder it was filed in
    label           what is special about the run's environment, or null
    smoke           true for a quick self-check run (never filed in the committed results)
    commit          the repository's HEAD when the run started ("unknown" where there was no git and no
                    OMNI_COMMIT); commit_source says which, dirty whether tracked files differed from it
    date            UTC, ISO 8601, when the run started ("unknown" for migrated results that did not record it)
    versions        python, torch, diffusers, diffusers-omni and the kernel packages (null: not installed)
    gpu             {"name", "compute_capability"} of CUDA device 0, or "cpu"
    command         the command line the runner ran
    exit_status     the script's exit status (0)
    artifacts       the suffixes of the files filed beside the JSON (".md", ".png", ".txt", "/" for a folder)

Layout: ``<root>/<suite>/latest.json`` (with ``latest.md`` / ``latest.png`` / ``latest.txt`` / ``latest/`` where the
scenario makes them) is the result the docs render; before a new one is filed, the old one moves to
``<root>/<suite>/archive/<id>.*`` with ``id = <date>-<commit>[-<label>]`` (``archive_id``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 1
META_KEYS = ("schema", "scenario", "suite", "label", "smoke", "commit", "commit_source", "dirty", "date", "versions",
             "gpu", "command", "exit_status", "artifacts")
UNKNOWN = "unknown"
# Packages whose versions every result records (absent ones as null).
PACKAGES = ("torch", "diffusers", "diffusers-omni", "triton", "flash-attn", "flash-attn-4", "fa3-fwd",
            "flashinfer-python", "sageattention", "kernels", "torchao", "bitsandbytes", "gguf", "transformers")
SIDECARS = (".md", ".png", ".txt")
LATEST = "latest"


class ResultError(ValueError):
    """A result file that does not follow the schema, or a result that cannot be filed where it was asked to go."""


# Provenance ---------------------------------------------------------------------------------------------------------

def git_commit(root: Path = ROOT) -> tuple[str, str, bool | None]:
    """(commit, where it came from, dirty): ``$OMNI_COMMIT`` when set (whoever runs on the device machine names the
    tree it sent: that machine's copy may hold no ``.git``, or one that is not this tree's — a run there once answered
    an older commit, dirty); else ``git rev-parse HEAD`` in ``root``; else ``"unknown"``. ``dirty``: tracked files
    differ from the commit (``None`` when git could not tell)."""
    if os.environ.get("OMNI_COMMIT"):
        return os.environ["OMNI_COMMIT"], "OMNI_COMMIT", None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30)
        if head.returncode == 0:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=60)
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
            return head.stdout.strip(), "git rev-parse HEAD", dirty
    except (OSError, subprocess.SubprocessError):
        pass
    return UNKNOWN, UNKNOWN, None


def package_versions() -> dict[str, str | None]:
    """Python's and every tracked package's version, ``None`` for a package that is not installed."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def gpu() -> dict | str:
    """CUDA device 0's name and compute capability, or ``"cpu"`` without one."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}"}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def collect_meta(scenario: str, suite: str, command: list[str], *, smoke: bool, label: str | None,
                 date: str | None = None) -> dict:
    """The ``meta`` block of a run of ``scenario`` that starts now on this machine."""
    commit, source, dirty = git_commit()
    return {"schema": SCHEMA_VERSION, "scenario": scenario, "suite": suite, "label": label, "smoke": smoke,
            "commit": commit, "commit_source": source, "dirty": dirty, "date": date or now(),
            "versions": package_versions(), "gpu": gpu(), "command": list(command), "exit_status": 0,
            "artifacts": []}


# Reading ------------------------------------------------------------------------------------------------------------

def validate(data: object, where: str) -> dict:
    """``data`` if it is a result of this schema; a ``ResultError`` naming ``where`` and what is wrong otherwise."""
    if not isinstance(data, dict) or set(data) != {"meta", "payload"}:
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ResultError(f"{where}: a result is {{'meta', 'payload'}}; found {found}")
    meta = data["meta"]
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ResultError(f"{where}: meta lacks {', '.join(missing)} (schema {SCHEMA_VERSION}: {', '.join(META_KEYS)})")
    if meta["schema"] != SCHEMA_VERSION:
        raise ResultError(f"{where}: meta.schema={meta['schema']!r}; this reader knows {SCHEMA_VERSION}")
    return data


def read(path: Path) -> dict:
    """The whole result (``meta`` and ``payload``) at ``path``, checked against the schema."""
    return validate(json.loads(Path(path).read_text()), str(path))


def suite_dir(suite: str, root: Path = RESULTS) -> Path:
    return Path(root) / suite


def run_path(suite: str, run: str = LATEST, root: Path = RESULTS, suffix: str = ".json") -> Path:
    """Where a run of ``suite`` is: ``run`` is ``"latest"`` or an archive id (``archive/<id>`` is searched)."""
    folder = suite_dir(suite, root)
    return folder / f"{run}{suffix}" if run == LATEST else folder / "archive" / f"{run}{suffix}"


def find(suite: str, run: str = LATEST, root: Path = RESULTS) -> Path:
    """The JSON of a run of ``suite``: ``"latest"``, or a run id (``archive_id``), which names the same run before
    and after it is archived: ``archive/<id>.json``, else the latest when its id is ``run``."""
    latest = run_path(suite, LATEST, root)
    if run == LATEST:
        if not latest.is_file():
            raise FileNotFoundError(f"suite {suite!r} has no result: {latest} does not exist")
        return latest
    archived_path = run_path(suite, run, root)
    if archived_path.is_file():
        return archived_path
    if latest.is_file() and archive_id(read(latest)["meta"]) == run:
        return latest
    raise FileNotFoundError(f"suite {suite!r} has no run {run!r}; its archived runs: "
                            f"{', '.join(archived(suite, root)) or 'none'}")


def load(suite: str, run: str = LATEST, root: Path = RESULTS) -> dict:
    """The payload of a run of ``suite`` (its latest by default; see ``find``)."""
    return read(find(suite, run, root))["payload"]


def archived(suite: str, root: Path = RESULTS) -> list[str]:
    """The archive ids of ``suite``, oldest first (ids start with the date)."""
    folder = suite_dir(suite, root) / "archive"
    return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []


# Writing ------------------------------------------------------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def archive_id(meta: dict) -> str:
    """``<date>-<commit>[-<label>]``: the run's UTC day and time (``2026-12-04T083045``; ``undated`` when unknown),
    the commit's first 7 characters, and the label as a slug."""
    date = meta.get("date") or UNKNOWN
    day = "undated" if date == UNKNOWN else date[:10] + (f"T{date[11:19].replace(':', '')}" if len(date) > 10 else "")
    commit = (meta.get("commit") or UNKNOWN)[:7]
    label = _slug(meta["label"]) if meta.get("label") else ""
    # A result migrated from the flat folder keeps its old file name in its id (the runs had no other name).
    legacy = Path(meta["migrated_from"]["path"]).stem if meta.get("migrated_from") else ""
    return "-".join(part for part in (day, commit, legacy or label) if part)


def _artifacts(folder: Path, stem: str) -> list[Path]:
    paths = [folder / f"{stem}{suffix}" for suffix in SIDECARS] + [folder / stem]
    return [p for p in paths if p.exists()]


def archive_latest(suite: str, root: Path = RESULTS) -> str | None:
    """Move ``suite``'s latest result (JSON and its sidecars) to ``archive/<id>``; the id, or ``None`` when the suite
    has no latest. A name already taken gets ``-2``, ``-3``, ... ."""
    folder = suite_dir(suite, root)
    latest = folder / f"{LATEST}.json"
    if not latest.is_file():
        return None
    base = archive_id(read(latest)["meta"])
    archive = folder / "archive"
    archive.mkdir(parents=True, exist_ok=True)
    run, n = base, 1
    while any((archive / f"{run}{s}").exists() for s in (".json", *SIDECARS, "")):
        n += 1
        run = f"{base}-{n}"
    for path in [latest, *_artifacts(folder, LATEST)]:
        shutil.move(str(path), str(archive / (run + path.name[len(LATEST):])))
    return run


def write_result(suite: str, payload: object, meta: dict, sidecars: dict[str, Path] | None = None,
                 root: Path = RESULTS) -> Path:
    """File a run of ``suite``: archive the current latest, then write ``latest.json`` (``meta`` + ``payload``) and
    move ``sidecars`` (suffix → file or folder: ``".md"``, ``".png"``, ``".txt"``, ``"/"``) beside it as
    ``latest.md``, ..., ``latest/``. A smoke run is refused in the committed results folder."""
    if meta.get("smoke") and Path(root).resolve() == RESULTS.resolve():
        raise ResultError(f"suite {suite!r}: a smoke run is not filed in {RESULTS} (the committed results); give "
                          "another results root")
    sidecars = dict(sidecars or {})
    unknown = sorted(set(sidecars) - {*SIDECARS, "/"})
    if unknown:
        raise ResultError(f"suite {suite!r}: sidecar suffixes {unknown} not in {[*SIDECARS, '/']}")
    meta = {**meta, "suite": suite, "artifacts": sorted(sidecars)}
    result = validate({"meta": meta, "payload": payload}, f"suite {suite!r}")
    archive_latest(suite, root)
    folder = suite_dir(suite, root)
    folder.mkdir(parents=True, exist_ok=True)
    for suffix, source in sidecars.items():
        target = folder / (LATEST if suffix == "/" else f"{LATEST}{suffix}")
        shutil.move(str(source), str(target))
    path = folder / f"{LATEST}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def adopt(source_root: Path, root: Path = RESULTS) -> list[str]:
    """File every ``<suite>/latest.*`` under ``source_root`` (results written elsewhere: the device machine's
    ``$OUT``) into ``root``, archiving the runs they replace. Returns the suites filed."""
    filed = []
    for latest in sorted(Path(source_root).glob(f"*/{LATEST}.json")):
        result = read(latest)
        suite = latest.parent.name
        if result["meta"]["suite"] != suite:
            raise ResultError(f"{latest}: meta.suite={result['meta']['suite']!r} but it lies in folder {suite!r}")
        sidecars = {p.name[len(LATEST):] or "/": p for p in _artifacts(latest.parent, LATEST)}
        write_result(suite, result["payload"], result["meta"], sidecars, root)
        latest.unlink()
        filed.append(suite)
    return filed


def command_line() -> list[str]:
    return [Path(sys.executable).name, *sys.argv]
