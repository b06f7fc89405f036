"""``diffusers-omni compare``: side-by-side image or frame grid, PSNR/SSIM, per-layer attention error; bad input
exits 2 with one line naming the flag and the value."""

import json
import math

import pytest
from PIL import Image

from benchmarks.tiny_latents import FP8, ReferenceFP8
from diffusers_omni.attention.registry import register_backend, reset_backend
from diffusers_omni.cli.main import main

SMALL = ["--steps", "2", "--height", "32", "--width", "32"]
# The labelled image of 32-pixel outputs: panels enlarged ×6 (to 192 pixels, for the labels), 2-pixel gaps ×6, a
# 22-pixel label band above and the PSNR/SSIM line under them (tests/cli/test_compare_panels.py).
LABELLED_32 = (3 * 32 * 6 + 2 * 2 * 6, 32 * 6 + 2 * 22)


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_exact_candidate_json(tmp_path, capsys):
    out = tmp_path / "sub" / "cmp.png"
    argv = ["compare", "--model", "tiny-flux", "--candidate", "stock", "--output", str(out), "--json", *SMALL]
    assert main(argv) == 0
    summary = _json(capsys)
    assert summary["psnr_db"] == math.inf and summary["ssim"] == 1.0 and summary["output"] == str(out)
    assert summary["attention"]["rel_err_max"] == 0 and summary["attention"]["modules"] == 2
    assert set(summary["wall_s"]) >= {"reference", "candidate"} and summary["candidate"]["attention"] == "stock"
    assert summary["reference"]["attention"]["default"]["backend"] == "TORCH_SDPA"  # "native"
    assert Image.open(out).size == LABELLED_32


def test_lossy_candidate_tables(tmp_path, capsys):
    register_backend("FLASH_ATTN", ReferenceFP8)  # FP8 through the kernel's reference arithmetic, on the CPU
    try:
        out = tmp_path / "cmp.png"
        assert main(["compare", "--candidate", json.dumps(FP8), "--dtype", "bfloat16", "--output", str(out),
                     "--seed", "5", *SMALL]) == 0
    finally:
        reset_backend("FLASH_ATTN")
    printed = capsys.readouterr().out
    assert "flux.joint" in printed and "FLASH_ATTN" in printed and "PSNR" in printed and "SSIM" in printed
    line = next(line for line in printed.splitlines() if line.startswith("image: PSNR"))
    psnr_db = float(line.split("PSNR ")[1].split(" dB")[0])
    ssim = float(line.split("SSIM ")[1].split(",")[0])
    assert 20 < psnr_db < 200 and 0 < ssim < 1
    assert Image.open(out).size == LABELLED_32


def test_video_frame_grid(tmp_path, capsys):
    out = tmp_path / "grid.png"
    assert main(["compare", "--model", "tiny-wan", "--candidate", "stock", "--frames", "9", "--output", str(out),
                 "--json", *SMALL]) == 0
    summary = _json(capsys)
    assert summary["kind"] == "video" and summary["shown_frames"] == [0, 3, 5, 8]
    assert len(summary["per_frame"]["ssim"]) == 9 and summary["ssim"] == 1.0
    with Image.open(out) as image:  # a label column left of the rows, enlarged ×6 like the images
        assert image.width > 6 * (4 * 32 + 3 * 2) and image.height == 6 * (3 * 32 + 2 * 2) + 22


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--candidate", "NOPE"], "--candidate='NOPE': backend='NOPE' is not a known attention backend"),
        (["--candidate", "stock", "--reference", "{bad json"], "--reference='{bad json'"),
        (["--candidate", "stock", "--output", "x.mp4"], "--output='x.mp4': compare writes a still image"),
        (["--candidate", "stock", "--diff-gain", "0"], "--diff-gain=0.0: must be a finite number > 0"),
        (["--candidate", '{"per_role": {"flux.jiont": "TORCH_SDPA"}}'], "--candidate="),
        (["--candidate", "stock", "--height", "30"], "--height=30"),
        (["--candidate", "stock", "--frames", "5"], "--frames=5"),
    ],
)
def test_bad_input_exits_2(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--steps", "0"], [], ["--candidate", "stock", "--warmup-runs", "-1"]])
def test_argument_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *argv])
    assert exit_info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["--height", "30"], "--height=30"), (["--frames", "5"], "--frames=5"),
                                        (["--model", "tiny-wan", "--frames", "6"], "--frames=6")])
def test_refused_before_any_weights_load(argv, flag, capsys, monkeypatch, tmp_path):
    import diffusers_omni.cli.common as common

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the arguments were checked")

    monkeypatch.setattr(common, "load_pipeline", no_load)
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--candidate", "stock", *argv]) == 2
    assert flag in capsys.readouterr().err
