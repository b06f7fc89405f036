"""benchmarks/lossless_pool_probe.py's smoke on the CPU: the tiny transformer through every run of the probe (the
device buffers themselves need CUDA: on the CPU each upload is the code's), each output bitwise the resident one."""

import json

import pytest

from benchmarks import lossless_pool_probe as probe
from benchmarks import registry


def test_the_smoke_runs_plain_and_both_lossless_uploads_bitwise(tmp_path):
    assert registry.get("lossless-pool-probe").smoke == ("--smoke",)
    assert probe.main(["--smoke", "--repeats", "2", "--out", str(tmp_path / "run")]) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert [r["run"] for r in report["runs"]][:2] == ["resident", "layerwise"] and len(report["runs"]) == 6
    assert all(r["run"].startswith("lossless (") for r in report["runs"][2:5])
    assert all(r["bitwise"] and r["step_s"] > 0 and r["reserved"] is None for r in report["runs"])
    assert probe.lossless.upload_and_decode is probe.NOW  # put back after the comparison
    assert probe.lossless.ring_buffers(2) == 2  # the ring's count too
    assert "| lossless (the code: a ring of one code buffer per window block, made once) |" in (tmp_path / "run.md").read_text()


def test_without_cuda_and_without_smoke_it_says_what_it_needs(tmp_path):
    if probe.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        probe.main(["--out", str(tmp_path / "run")])


def test_the_last_run_holds_every_block_resident(tmp_path):
    assert probe.main(["--smoke", "--repeats", "1", "--out", str(tmp_path / "run")]) == 0
    last = json.loads((tmp_path / "run.json").read_text())["runs"][-1]
    assert last["run"].startswith("lossless, every block resident") and last["bitwise"]
    assert last["streamed_blocks"] == 0  # nothing streams under that budget
    assert last["of_resident"] > 0 and "÷ resident" in (tmp_path / "run.md").read_text()
