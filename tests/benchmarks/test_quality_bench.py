"""quality_bench on the CPU (--smoke: tiny sizes, exact configs): both sections run, the JSON carries provenance and
zero errors for an exact candidate, the side-by-side PNGs are written, and the report renders."""

import json
import sys

from PIL import Image

from benchmarks import quality_bench


def test_smoke_run_writes_json_pngs_and_tables(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quality_bench", "--smoke", "--out", str(tmp_path)])
    quality_bench.main()
    results = json.loads((tmp_path / "quality.json").read_text())
    assert results["errors"] == {} and results["unavailable"] == {} and results["smoke"] is True
    assert {"date", "commit", "device", "versions"} <= set(results) and results["versions"]["torch"]
    assert set(results["tiny"]) == {"tiny-flux", "tiny-wan"}
    for entry in results["tiny"].values():
        (candidate,) = entry["candidates"].values()
        assert candidate["ssim"] == 1.0 and candidate["psnr_db"] == float("inf")
        assert candidate["attention"]["rel_err_max"] == 0 and candidate["attention"]["modules"] > 0
        with Image.open(tmp_path / candidate["image"]) as image:
            height, width = candidate["output_shape"][-3:-1]
            # The labelled panels (reference, candidate, amplified difference; PSNR/SSIM written under them; small
            # outputs enlarged so the labels fit) hold at least the plain side-by-side layout.
            if candidate["kind"] == "video":  # frame grid: 4 of its 5 frames, 3 rows
                plain = (4 * width + 3 * 2, 3 * height + 2 * 2)
            else:
                plain = (3 * width + 2 * 2, height)
            assert image.size[0] >= plain[0] and image.size[1] > plain[1]
    assert len(results["full_size"]) == 2
    for entry in results["full_size"].values():
        assert entry["random_weights"] is True and entry["step_s"]["native"] > 0
        (candidate,) = entry["candidates"].values()
        assert candidate["output_rel_err"] == 0 and candidate["attention"]["rel_err_max"] == 0
    printed = capsys.readouterr().out
    assert "| tiny-wan | stock (Diffusers' processors) | ∞ | 1.0000 |" in printed
    assert "Random weights throughout" in printed


def test_report_puts_the_error_beside_every_speed_up():
    results = {"device": "GPU", "versions": {"torch": "2"}, "date": "d", "commit": "abc", "tiny": {}, "unavailable": {},
               "full_size": {"FLUX": {"reference": "native", "step_s": {"native": 0.2, "FP8": 0.1}, "candidates": {
                   "FP8": {"output_rel_err": 0.05, "attention": {"rel_err_max": 0.07, "rel_err_mean": 0.05,
                                                                 "local_rel_err_max": 0.06}}}}}}
    line = next(row for row in quality_bench.to_markdown(results).splitlines() if row.startswith("| FLUX | FP8"))
    assert line == "| FLUX | FP8 | 0.1000 | 2.00× | 5.00e-02 | 7.00e-02 (5.00e-02) | 6.00e-02 |"
