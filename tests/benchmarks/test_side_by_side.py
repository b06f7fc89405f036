"""side_by_side collects the archive benchmarks/h200/side_by_side.sh brings back (offload_bench of a baseline tree and
of this one) into one payload: step times of the variants both ran compared, the current-only ones (lossless) listed,
and filed through results_io with the archive's commits."""

import json
import tarfile

from benchmarks import registry, results_io, side_by_side

BASE, CUR = "a" * 40, "b" * 40


def _report(asked: set[str], variants: list[dict]) -> dict:
    return {"environment": {"torch": "2.11.0+cu130", "diffusers": "0.42.1", "python": "3.12.3", "device": "cuda:0",
                            "device_name": "NVIDIA H200", "cpu_count": 16},
            "args": {"models": ["flux"], "variants": str(asked),  # a set, as json.dumps(default=str) writes it
                     "budget": "12GiB"},
            "bandwidth_bytes_per_s": 5.5e10,
            "models": [{"model": "flux", "param_bytes": 23802816640, "variants": variants}]}


def _variant(label: str, step: float, **more) -> dict:
    return {"variant": label, "step_s": step, "setup_s": 8.0, "peak_device_bytes": 2 * 2**30, **more}


def _archive(tmp_path, commits: str = f"baseline {BASE}\ncurrent {CUR}\n"):
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "commits.txt").write_text(commits)
    baseline = _report({"layerwise"}, [_variant("omni layerwise", 0.4366, same_output_as_resident=True),
                        _variant("resident", 0.1719)])
    current = _report({"layerwise", "lossless"}, [
        _variant("omni layerwise", 0.4335, same_output_as_resident=True),
        _variant("omni layerwise lossless", 0.338, same_output_as_resident=True, coded_ratio=0.676,
                 ratio_to_bf16_floor=0.79, moved_bytes=16 * 2**30, decode_kernel="triton"),
        _variant("resident", 0.1790)])
    (staged / "baseline-flux-12GiB.json").write_text(json.dumps(baseline))
    (staged / "current-flux-12GiB.json").write_text(json.dumps(current))
    (staged / "current-flux-12GiB.png").write_bytes(b"png")
    archive = tmp_path / "side_by_side.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(staged, arcname=".")
    return archive


def test_collect_compares_the_step_times_and_lists_the_current_only_variants(tmp_path):
    archive, prefix = _archive(tmp_path), tmp_path / "out" / "run"
    assert side_by_side.main(["--collect", str(archive), "--out", str(prefix)]) == 0
    payload = json.loads(prefix.with_suffix(".json").read_text())
    assert (payload["baseline_commit"], payload["current_commit"]) == (BASE, CUR)
    assert sorted(payload["runs"]) == ["baseline-flux-12GiB", "current-flux-12GiB"]
    rows = {row["variant"]: row for row in payload["comparison"]}
    assert set(rows) == {"omni layerwise", "omni layerwise lossless", "resident"}
    layerwise = rows["omni layerwise"]
    assert (layerwise["model"], layerwise["budget"]) == ("flux", "12GiB")
    assert (layerwise["baseline_step_s"], layerwise["current_step_s"]) == (0.4366, 0.4335)
    assert abs(layerwise["ratio"] - 0.4335 / 0.4366) < 1e-12 and layerwise["within_2_percent"] is True
    assert layerwise["current_same_output_as_resident"] is True
    resident = rows["resident"]
    assert resident["ratio"] > 1.02 and resident["within_2_percent"] is False
    lossless = rows["omni layerwise lossless"]
    assert lossless["only"] == "current" and "ratio" not in lossless and "baseline_step_s" not in lossless
    assert (lossless["current_step_s"], lossless["coded_ratio"], lossless["ratio_to_bf16_floor"]) == (0.338, 0.676,
                                                                                                       0.79)
    assert lossless["decode_kernel"] == "triton" and lossless["same_output_as_resident"] is True
    # Only the payload and the table come out; the PNGs stay in the archive.
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["run.json", "run.md"]
    table = prefix.with_suffix(".md").read_text()
    assert "| Variant | Baseline step (s) | Current step (s) | Ratio | Same output as resident |" in table
    assert "| omni layerwise | 0.4366 | 0.4335 | 0.993 | yes / yes |" in table
    assert "| resident | 0.1719 | 0.1790 | 1.041 (> 1.02) |" in table
    assert "| omni layerwise lossless | — | 0.3380 | current only | yes |" in table
    assert "- omni layerwise lossless: step 0.3380 s = 0.790 × the bf16 floor; coded to 0.676" in table
    assert f"baseline `{BASE[:12]}`, current `{CUR[:12]}`" in table


def test_file_result_writes_latest_with_the_archives_commit(tmp_path):
    archive, root = _archive(tmp_path), tmp_path / "results"
    assert side_by_side.main(["--collect", str(archive), "--file-result", "--results-root", str(root)]) == 0
    result = results_io.read(root / side_by_side.SCENARIO / "latest.json")
    meta = result["meta"]
    assert registry.owner(meta["suite"]).name == meta["scenario"] == "offload-side-by-side"
    assert (meta["commit"], meta["commit_source"], meta["baseline_commit"]) == (CUR, "OMNI_COMMIT", BASE)
    assert meta["gpu"]["name"] == "NVIDIA H200" and meta["versions"]["torch"] == "2.11.0+cu130"
    assert meta["command"][:2] == ["bash", side_by_side.SCRIPT] and meta["artifacts"] == [".md"]
    assert meta["command"][2] == "flux:layerwise:layerwise,lossless:12GiB"
    assert meta["date"] != results_io.UNKNOWN and meta["smoke"] is False
    assert result["payload"]["current_commit"] == CUR
    assert (root / side_by_side.SCENARIO / "latest.md").read_text().startswith("# Offload benchmark: this tree")


def test_the_scenario_runs_side_by_side_sh_with_its_specs():
    scenario = registry.get("offload-side-by-side")
    assert scenario.script == "side_by_side" and scenario.out == "prefix" and scenario.smoke is None
    assert "wan:layerwise:layerwise:12GiB" in scenario.args
    assert all(len(spec.split(":")) in (3, 4) for spec in scenario.args)


def test_without_collect_it_runs_the_script_with_out_set_and_collects_its_archive(tmp_path, monkeypatch):
    archive = _archive(tmp_path)
    fake = tmp_path / "fake_side_by_side.sh"
    fake.write_text(f'echo "$@" > {tmp_path}/specs.txt\ncp {archive} "$OUT/side_by_side.tgz"\nexit "$FAKE_STATUS"\n')
    monkeypatch.setattr(side_by_side, "SCRIPT", str(fake))
    monkeypatch.setenv("FAKE_STATUS", "0")
    prefix = tmp_path / "run"
    assert side_by_side.main(["flux:layerwise:layerwise,lossless:12GiB", "--out", str(prefix)]) == 0
    assert (tmp_path / "specs.txt").read_text().split() == ["flux:layerwise:layerwise,lossless:12GiB"]
    assert json.loads(prefix.with_suffix(".json").read_text())["current_commit"] == CUR
    # A run that failed part-way still writes what finished and passes the script's status on (the runner files
    # nothing then).
    monkeypatch.setenv("FAKE_STATUS", "1")
    prefix.with_suffix(".json").unlink()
    assert side_by_side.main(["flux:layerwise:layerwise,lossless:12GiB", "--out", str(prefix)]) == 1
    assert prefix.with_suffix(".json").is_file()
