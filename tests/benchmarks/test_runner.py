"""The benchmark suite: the runner lists every scenario and runs one through the one result writer (a meta block,
``<suite>/latest.json``, the previous run archived), the committed results all follow that schema, and each
scenario's registered docs are exactly the pages whose tables read its results."""

import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from benchmarks import __main__ as runner
from benchmarks import docs_tables, registry, results_io

ROOT = Path(__file__).resolve().parents[2]
HEAD = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _meta(suite: str, **changes) -> dict:
    meta = results_io.collect_meta(registry.owner(suite).name, suite, ["python", "-m", "benchmarks.test"],
                                   smoke=True, label=None)
    return {**meta, **changes}


def test_list_shows_every_scenario_with_its_script_device_and_docs(capsys):
    assert runner.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["scenario", "script", "device"]
    for scenario in registry.SCENARIOS:
        (line,) = [row for row in lines if row.split()[0] == scenario.name]
        assert f"benchmarks/{scenario.script}.py" in line and f" {scenario.device} " in line
        for page in scenario.docs:
            assert page.removeprefix("docs/user_guide/").removeprefix("docs/") in line
    names = [s.name for s in registry.SCENARIOS]
    assert len(lines) == len(names) + 1 and len(set(names)) == len(names)
    assert len(set(registry.SUITES)) == len(registry.SUITES)


def test_every_scenario_runs_a_script_that_takes_its_options():
    for scenario in registry.SCENARIOS:
        text = (ROOT / "benchmarks" / f"{scenario.script}.py").read_text()
        options = [*scenario.args, *(scenario.smoke or ()), "--out", *(o for _, o in scenario.extra_outputs)]
        options += [scenario.label_arg] if scenario.label_arg else []
        for option in (o for o in options if o.startswith("--")):
            assert f'"{option}"' in text, (scenario.name, option)
        assert scenario.label_arg is None or scenario.label is not None, scenario.name


def test_run_smoke_files_latest_with_the_meta_block_and_archives_the_previous(tmp_path):
    meta = _meta("fp8-numerics", date="2026-01-02T03:04:05+00:00")
    previous = results_io.write_result("fp8-numerics", {"shapes": []}, meta, root=tmp_path)
    (tmp_path / "fp8-numerics" / "latest.md").write_text("previous report\n")
    before = json.loads(previous.read_text())

    assert runner.main(["run", "fp8-numerics", "--smoke", "--results-root", str(tmp_path)]) == 0

    folder = tmp_path / "fp8-numerics"
    result = results_io.read(folder / "latest.json")
    meta = result["meta"]
    assert set(results_io.META_KEYS) <= set(meta) and meta["schema"] == results_io.SCHEMA_VERSION
    assert (meta["scenario"], meta["suite"], meta["smoke"], meta["exit_status"]) == ("fp8-numerics", "fp8-numerics",
                                                                                      True, 0)
    assert meta["commit"] == HEAD and meta["commit_source"] == "git rev-parse HEAD" and isinstance(meta["dirty"], bool)
    assert meta["versions"]["torch"] == torch.__version__ and meta["versions"]["python"]
    assert meta["gpu"] == results_io.gpu()
    assert meta["command"][:3] == ["python", "-m", "benchmarks.fp8_numerics"] and "--smoke" in meta["command"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", meta["date"])
    assert meta["artifacts"] == [".md"] and (folder / "latest.md").read_text().startswith("# FP8 attention error")
    assert [row["shape"] for row in result["payload"]["shapes"]] == ["SDXL 1024² cross (77 text)"]
    # The run it replaced is in the archive under its id, JSON and report, unchanged; nothing is left staged.
    run_id = f"2026-01-02T030405-{HEAD[:7]}"
    assert results_io.archived("fp8-numerics", tmp_path) == [run_id]
    assert json.loads((folder / "archive" / f"{run_id}.json").read_text()) == before
    assert (folder / "archive" / f"{run_id}.md").read_text() == "previous report\n"
    assert results_io.find("fp8-numerics", run_id, tmp_path) == folder / "archive" / f"{run_id}.json"
    assert not (folder / ".running").exists()


def test_a_failed_run_files_nothing_and_keeps_its_output(tmp_path):
    results_io.write_result("fp8-numerics", {"shapes": []}, _meta("fp8-numerics"), root=tmp_path)
    latest = (tmp_path / "fp8-numerics" / "latest.json").read_text()
    assert runner.run("fp8-numerics", smoke=True, root=tmp_path, extra=["--no-such-option"]) == 2
    assert (tmp_path / "fp8-numerics" / "latest.json").read_text() == latest
    assert results_io.archived("fp8-numerics", tmp_path) == [] and (tmp_path / "fp8-numerics" / ".running").is_dir()


def test_smoke_results_are_never_filed_with_the_committed_ones(tmp_path):
    with pytest.raises(results_io.ResultError, match="smoke run is not filed"):
        results_io.write_result("fp8-numerics", {}, _meta("fp8-numerics"), root=results_io.RESULTS)
    with pytest.raises(SystemExit, match="'attention' has no smoke mode.*fp8-numerics"):
        runner.run("attention", smoke=True, root=tmp_path)
    with pytest.raises(SystemExit):
        runner.main(["run", "no-such-scenario"])
    with pytest.raises(results_io.ResultError, match="meta lacks"):
        results_io.validate({"meta": {"schema": 1}, "payload": {}}, "x.json")


def test_adopt_files_results_written_on_another_machine(tmp_path):
    device, repo = tmp_path / "out", tmp_path / "results"
    results_io.write_result("sage", {"run": "old"}, _meta("sage", date="2026-01-01T00:00:00+00:00", smoke=False),
                            root=repo)
    png = tmp_path / "chart.png"
    png.write_bytes(b"png")
    results_io.write_result("sage", {"run": "new"}, _meta("sage", smoke=False), {".png": png}, root=device)
    assert runner.main(["adopt", str(device), "--results-root", str(repo)]) == 0
    assert results_io.load("sage", root=repo) == {"run": "new"}
    assert (repo / "sage" / "latest.png").read_bytes() == b"png"
    (old,) = results_io.archived("sage", repo)
    assert old.startswith("2026-01-01T000000-") and results_io.load("sage", old, repo) == {"run": "old"}
    assert not (device / "sage" / "latest.json").exists()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_committed_results_all_follow_the_schema():
    results = results_io.RESULTS
    from benchmarks import docs_tables

    # Besides the suites' folders, only the plots docs_tables draws.
    assert sorted(p.name for p in results.iterdir() if p.is_file()) == sorted(docs_tables.PLOTS)
    assert {p.name for p in results.iterdir() if p.is_dir()} <= set(registry.SUITES)
    files = sorted(results.glob("*/latest.json")) + sorted(results.glob("*/archive/*.json"))
    assert len(files) >= 50
    for path in files:
        meta = results_io.read(path)["meta"]
        suite = path.relative_to(results).parts[0]
        assert meta["suite"] == suite and meta["scenario"] == registry.owner(suite).name, path
        for suffix in meta["artifacts"]:
            assert path.with_suffix("" if suffix == "/" else suffix).exists(), (path, suffix)
        if path.parent.name == "archive":
            assert path.stem == results_io.archive_id(meta), path
        if "migrated_from" in meta:  # the commit that added the file, never invented
            old = meta["migrated_from"]["path"]
            assert meta["commit"] == _git("log", "--diff-filter=A", "--format=%H", "-1", "--", old), path
            assert meta["command"] == meta["exit_status"] == "unknown"
        else:
            assert meta["commit_source"] in ("git rev-parse HEAD", "OMNI_COMMIT"), path
    assert all(results_io.find(suite).is_file() for suite in registry.SUITES
               if (results / suite).is_dir())


def test_each_scenarios_docs_are_the_pages_whose_tables_read_it(monkeypatch):
    read: dict[str, set[str]] = defaultdict(set)
    page_now = [""]
    find, run_path = results_io.find, results_io.run_path

    def spy_find(suite, run=results_io.LATEST, root=results_io.RESULTS):
        read[suite].add(page_now[0])
        return find(suite, run, root)

    def spy_run_path(suite, run=results_io.LATEST, root=results_io.RESULTS, suffix=".json"):
        read[suite].add(page_now[0])
        return run_path(suite, run, root, suffix)

    monkeypatch.setattr(results_io, "find", spy_find)
    monkeypatch.setattr(results_io, "run_path", spy_run_path)
    docs_tables.result.cache_clear()
    try:
        for page in docs_tables.pages():
            page_now[0] = page.relative_to(ROOT).as_posix()
            docs_tables.render_page(page.read_text())
            docs_tables.result.cache_clear()
    finally:
        docs_tables.result.cache_clear()
    for scenario in registry.SCENARIOS:
        pages = set().union(*(read.get(suite, set()) for suite in scenario.suites))
        assert pages == set(scenario.docs), scenario.name


def test_omni_commit_names_the_tree_even_where_git_answers(monkeypatch):
    """On the device machine a copy's ``.git`` once answered an older commit than the tree sent: ``$OMNI_COMMIT``,
    set by whoever sent it, wins; without it git answers here."""
    from benchmarks import results_io

    monkeypatch.setenv("OMNI_COMMIT", "abc1234")
    assert results_io.git_commit() == ("abc1234", "OMNI_COMMIT", None)
    monkeypatch.delenv("OMNI_COMMIT")
    commit, source, _ = results_io.git_commit()
    assert source == "git rev-parse HEAD" and len(commit) == 40
