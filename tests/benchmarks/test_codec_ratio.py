"""benchmarks/codec_ratio.py: the committed run's parts that need no downloaded wheel."""

from __future__ import annotations

import json
import zipfile

import pytest

from benchmarks import codec_ratio


def test_a_smoke_run_codes_random_references_bit_for_bit(tmp_path):
    assert codec_ratio.main(["--random-weights", "4096", "--out", str(tmp_path / "run")]) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert [r["kind"] for r in report["rows"]] == ["random", "random"]
    assert all(r["bitwise"] and 0.5 < r["ratio"] < 1 for r in report["rows"]) and report["dfloat11"] is None
    assert "DFloat11" not in (tmp_path / "run.md").read_text()


def test_a_wheel_without_dfloat11s_encoder_is_refused_naming_it(tmp_path):
    wheel = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("other/__init__.py", "")
    with pytest.raises(SystemExit, match=r"--dfloat11-wheel: .*other-1.0-py3-none-any.whl holds no "
                                         r"dfloat11/dfloat11_utils.py; allowed: the dfloat11 wheel from PyPI"):
        codec_ratio.load_dfloat11_encoder(wheel, tmp_path / "scratch")
