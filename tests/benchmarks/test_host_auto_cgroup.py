"""benchmarks/host_auto_cgroup.py: its cgroup handling on fake cgroup trees (v2, v1), its verdict, and its smoke
(children without a cgroup: the path the capped runs take, every image the resident one)."""

import json

import pytest

from benchmarks import host_auto_cgroup as bench
from benchmarks import registry

GiB = 1 << 30


def test_a_v2_cgroup_is_made_under_the_root_with_its_limit_and_read_back(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory")
    (tmp_path / "cgroup.subtree_control").write_text("memory")
    group = bench.Cgroup("run", 3 * GiB, root=tmp_path)
    assert group.version == 2 and (tmp_path / "run" / "memory.max").read_text() == str(3 * GiB)
    (tmp_path / "run" / "memory.peak").write_text(f"{2 * GiB}\n")
    (tmp_path / "run" / "memory.events").write_text("low 0\nmax 4\noom 1\noom_kill 1\n")
    assert group.readings() == {"version": 2, "path": str(tmp_path / "run"), "limit": 3 * GiB, "peak": 2 * GiB,
                                "oom_kills": 1, "limit_hits": None}
    done = bench.subprocess.run(group.wrap(["sh", "-c", "echo started"]), capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "started\n"
    assert int((tmp_path / "run" / "cgroup.procs").read_text()) > 1  # the command's pid, written before it ran
    for name in ("memory.max", "memory.peak", "memory.events", "cgroup.procs"):
        (tmp_path / "run" / name).unlink()
    group.remove()
    assert not (tmp_path / "run").exists()


def test_without_a_memory_controller_it_says_why():
    with pytest.raises(PermissionError, match="could not create a memory cgroup: no memory controller under"):
        bench.Cgroup("run", GiB, root=bench.Path("/nonexistent"))


def test_the_verdict_needs_the_same_image_and_no_kill():
    resident = {"run": "resident", "exit": 0, "digests": ["a", "a"]}
    held = {"run": "auto", "exit": 0, "digests": ["a", "a"], "cgroup": {"oom_kills": 0}}
    killed = {"run": "no-budget", "exit": -9, "signal": "SIGKILL", "stage": "enable"}
    report = {"cap": 4 * GiB, "runs": [resident, held, killed]}
    assert bench.verdict(report) == ("auto under the cap: held, same image; no host budget under the same cap: "
                                     "killed (SIGKILL, at enable)")
    report["runs"][1] = {**held, "digests": ["a", "b"]}
    assert bench.verdict(report).startswith("auto under the cap: FAILED")
    assert bench.verdict({"cap": None, "runs": [resident]}) == "not capped: smoke run (no cgroup)"


def test_the_smoke_runs_each_child_and_every_image_is_the_resident_one(tmp_path):
    scenario = registry.get("host-auto-cgroup")
    assert scenario.device == "cpu" and scenario.smoke == ("--smoke",)
    assert bench.main(["--smoke", "--out", str(tmp_path / "run")]) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    runs = {r["run"]: r for r in report["runs"]}
    assert list(runs) == list(bench.RUNS) and all(r["exit"] == 0 and r["stage"] == "done" for r in runs.values())
    assert runs["auto"]["digests"] == runs["resident"]["digests"] == runs["no-budget"]["digests"]
    assert runs["auto"]["offload"]["auto"][0].startswith("max_host_memory=auto: ")
    assert runs["no-budget"]["offload"]["auto"] == []
    assert "| auto | none | 0 |" in (tmp_path / "run.md").read_text()
    assert runs["auto"]["rss_peaks"]["RssAnon"] > 0


def test_the_gpu_scenario_smokes_on_the_cpu_at_tiny_sizes():
    scenario = registry.get("host-auto-cgroup-gpu")
    assert scenario.device == "gpu"
    args = bench.parse_args([*scenario.args, "--out", "unused"])
    assert (args.device, args.double_blocks, args.single_blocks, args.heads) == ("cuda", 19, 38, 24)
    smoke = bench.parse_args([*scenario.args, *scenario.smoke, "--out", "unused"])
    assert (smoke.device, smoke.size, smoke.steps) == ("cpu", 32, 2)
    assert bench.transformer_config(smoke)["num_layers"] == 2  # the tiny transformer
