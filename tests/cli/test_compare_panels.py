"""``compare`` at the pipeline's own defaults, with labelled panels (#39 item 13): reference, candidate and the
difference amplified by a stated gain (by default the one that shows the largest difference white), PSNR and SSIM
under them; and ``tune`` says when there was nothing to choose between."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from diffusers_omni import testing
from diffusers_omni.alignment.quality import QualityReport
from diffusers_omni.cli.main import build_parser, main


def _report(reference: np.ndarray, candidate: np.ndarray, gain: float | None = None) -> QualityReport:
    return QualityReport(kind="image", reference={}, candidate={}, psnr_db=31.25, ssim=0.98765, layers=[],
                         wall_s={}, first_call_inputs_equal=True, reference_output=reference,
                         candidate_output=candidate, diff_gain=gain)


def test_panels_are_labelled_with_the_gain_and_the_metrics():
    reference = np.full((1, 64, 64, 3), 0.5)
    candidate = reference.copy()
    candidate[0, 10:20, 10:20] += 0.002  # a difference far below what ×10 would show
    image, info = _report(reference, candidate).annotated()
    assert info["diff_gain"] == pytest.approx(500.0)  # auto: the largest difference is shown white
    assert info["labels"] == ["reference", "candidate", "|difference| x500"]
    assert info["footer"] == "PSNR 31.25 dB, SSIM 0.9877, max |diff| 0.002"
    scale, top, panel = info["panel_scale"], info["header_px"], info["panel_px"]
    assert scale * 64 == panel >= 192  # small outputs are enlarged (nearest neighbour) so labels fit
    pixels = np.asarray(image)
    assert image.height > panel and image.width >= 3 * panel
    for index in range(3):  # each label drew dark text on the white band above its panel
        left = index * (panel + info["gap_px"])
        assert (pixels[:top, left:left + panel] < 128).any()
    difference = pixels[top:top + panel, 2 * (panel + info["gap_px"]):][: panel, : panel]
    assert difference.max() == 255  # not an all-black panel
    assert (pixels[top + panel:] < 128).any()  # the footer's text


def test_identical_outputs_say_so():
    reference = np.full((1, 32, 32, 3), 0.25)
    _, info = _report(reference, reference.copy()).annotated()
    assert info["labels"][2] == "difference: identical"


def test_a_given_gain_is_kept():
    reference = np.zeros((1, 32, 32, 3))
    _, info = _report(reference, reference + 0.01, gain=10.0).annotated()
    assert info["labels"][2] == "|difference| x10"


def test_compare_defaults_are_the_pipelines(tmp_path, capsys):
    args = build_parser().parse_args(["compare", "--candidate", "stock"])
    assert (args.steps, args.height, args.width, args.diff_gain) == (None, None, None, None)
    root = tmp_path / "flux"
    testing.tiny_flux_pipeline().save_pretrained(root)
    output = tmp_path / "cmp.png"
    assert main(["compare", "--model", str(root), "--candidate", "stock", "--steps", "1", "--output", str(output),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["call"]["height"], summary["call"]["width"]) == (256, 256)  # FLUX: default_sample_size × VAE
    assert summary["image"]["labels"][:2] == ["reference", "candidate"]
    assert Image.open(output).width >= 3 * 256


def test_tune_with_one_candidate_says_there_was_nothing_to_choose(capsys):
    assert main(["tune", "--height", "32", "--width", "32", "--warmup", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "now routes" not in out
    assert "nothing to choose between" in out and "TORCH_SDPA" in out
