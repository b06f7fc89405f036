"""benchmarks/headroom_check.py on the CPU: the path runs end to end, bitwise; nothing is measured there (no
allocator statistics), so nothing moves and ``exercised`` says so."""

from __future__ import annotations

import json

import pytest

from benchmarks import headroom_check


def test_the_smoke_runs_every_variant_bitwise_and_says_nothing_was_exercised(tmp_path):
    assert headroom_check.main(["--smoke", "--out", str(tmp_path / "run"), "--large-tokens", "64"]) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["all_bitwise"] and [v["variant"] for v in report["variants"]] == ["plain", "lossless",
                                                                                 "plain-device-first"]
    assert [v["start"] for v in report["variants"]] == ["host", "host", "device"]
    for variant in report["variants"]:
        assert [c["tokens"] for c in variant["calls"]] == [16, 16, 64, 64, 16]
        assert all(c["bitwise"] and c["streamed_blocks"] == 8 for c in variant["calls"])
        assert variant["exercised"] == {"kept": False, "streamed_first": False}
        assert variant["state_dict_exact"] and variant["bitwise_after_disable"]
        assert variant["auto"][0].startswith("max_device_memory=auto")
    text = (tmp_path / "run.md").read_text()
    assert "## lossless" in text and "**All bitwise: True**" in text


def test_an_unknown_variant_is_refused_naming_the_allowed_ones(tmp_path, capsys):
    with pytest.raises(SystemExit):
        headroom_check.main(["--smoke", "--out", str(tmp_path / "run"), "--variants", "plain,zip"])
    assert "--variants='plain,zip': unknown ['zip']; allowed: plain, lossless, plain-device-first" in capsys.readouterr().err
