"""Quality of a lossy configuration against a reference one: per-layer relative error and the final output's PSNR
of one transformer call (issue 15, ``diffusers-omni align``), and a whole generation under each (issue 30,
``compare_pipelines``: PSNR, SSIM, side-by-side image or frame grid, per-module attention error)."""

import json
import math

import torch

from diffusers_omni.alignment import capture_layers, check_alignment, compare_layer_outputs
from diffusers_omni.alignment.compare import LayerOutputs
from diffusers_omni.cli.main import main

from .helpers import pipeline_and_inputs


def test_rel_err_and_psnr_are_the_textbook_formulas():
    pipe, inputs = pipeline_and_inputs("flux")
    fp = capture_layers(pipe.transformer, inputs, "TORCH_SDPA").fingerprint
    a = torch.linspace(-2.0, 2.0, 1000).reshape(10, 100)
    b = a + 0.01 * torch.sin(torch.arange(1000.0)).reshape(10, 100)
    report = compare_layer_outputs(LayerOutputs({"output": (a,)}, fp), LayerOutputs({"output": (b,)}, fp))
    row = report.output
    want_rel = ((b - a).double().norm() / a.double().norm()).item()
    want_psnr = 10 * math.log10(4.0**2 / (b - a).double().square().mean().item())
    assert math.isclose(row.rel_err, want_rel, rel_tol=1e-9) and math.isclose(row.psnr_db, want_psnr, rel_tol=1e-9)
    same = compare_layer_outputs(LayerOutputs({"output": (a,)}, fp), LayerOutputs({"output": (a.clone(),)}, fp))
    assert same.output.rel_err == 0 and same.output.psnr_db == math.inf
    assert report.to_dict()["output_psnr_db"] == row.psnr_db


def test_lossy_config_quality_per_layer_and_cli(test_backends, tmp_path, capsys):
    pipe, inputs = pipeline_and_inputs("flux")
    report = check_alignment(pipe.transformer, inputs, "TORCH_SDPA", {"default": "PERTURBED_TEST"})
    rows = {row.layer: row for row in report.layers}
    assert all(row.rel_err > 0 for row in report.layers)
    assert 0 < rows["output"].rel_err < 1 and 10 < rows["output"].psnr_db < 200
    assert "final output vs side a: rel err" in report.table() and "psnr_db" in report.table()
    out = tmp_path / "quality.json"
    assert main(["align", "--a", "TORCH_SDPA", "--b", '{"default": "PERTURBED_TEST"}', "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "PSNR" in printed and "rel_err" in printed
    payload = json.loads(out.read_text())
    assert payload["output_rel_err"] > 0 and payload["layers"][-1]["layer"] == "output"


# compare_pipelines (issue 30): the same generation under a reference and a candidate attention config ---------------

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from skimage.metrics import structural_similarity  # noqa: E402

from benchmarks.tiny_latents import FP8, ReferenceFP8  # noqa: E402
from diffusers_omni.alignment import compare_pipelines, psnr, ssim  # noqa: E402
from diffusers_omni.alignment.quality import ssim_per_image  # noqa: E402
from diffusers_omni.attention.registry import register_backend, reset_backend  # noqa: E402
from diffusers_omni.installer import applied_attention_config  # noqa: E402
from diffusers_omni.testing import tiny_flux_pipeline, tiny_wan_pipeline  # noqa: E402

TINY_CALL = {"prompt": "a red fox", "num_inference_steps": 2, "height": 32, "width": 32}


def test_psnr_and_ssim_known_values():
    rng = np.random.default_rng(0)
    a = rng.random((24, 20, 3))
    assert psnr(a, a.copy()) == math.inf and ssim(a, a.copy()) == 1.0
    assert math.isclose(psnr(a, a + 0.1), 20.0, rel_tol=1e-9)  # MSE 0.01 → 10·log10(1 / 0.01)
    # Constant images: no variance, no covariance: SSIM = (2·μx·μy + C1) / (μx² + μy² + C1).
    c1 = 0.01**2
    want = (2 * 0.5 * 0.6 + c1) / (0.5**2 + 0.6**2 + c1)
    assert math.isclose(ssim(np.full((16, 16, 3), 0.5), np.full((16, 16, 3), 0.6)), want, rel_tol=1e-12)


def test_ssim_matches_scikit_image():
    rng = np.random.default_rng(1)
    a = rng.random((40, 36, 3))
    b = np.clip(a + 0.05 * rng.standard_normal(a.shape), 0, 1)
    want = structural_similarity(a, b, gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1.0,
                                 channel_axis=-1)
    assert 0.5 < want < 0.99
    assert math.isclose(ssim(a, b), want, rel_tol=1e-9)
    gray = structural_similarity(a[..., 0], b[..., 0], gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
                                 data_range=1.0)
    assert math.isclose(ssim(a[..., 0], b[..., 0]), gray, rel_tol=1e-9)
    frames = np.stack([a, b, a]), np.stack([b, b, a])  # per image of a [F, H, W, C] stack
    assert ssim_per_image(*frames) == pytest.approx([want, 1.0, 1.0], rel=1e-9)


def test_metrics_refuse_bad_input():
    with pytest.raises(ValueError, match="at least 11×11"):
        ssim(np.zeros((8, 8, 3)), np.zeros((8, 8, 3)))
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(np.zeros((8, 8)), np.zeros((8, 9)))
    with pytest.raises(ValueError, match="data_range"):
        psnr(np.zeros((8, 8)), np.ones((8, 8)), data_range=0)


@pytest.fixture
def reference_fp8():
    """FP8 FLASH_ATTN through the reference arithmetic the kernel is tested against (quantisation + FA3's e4m3
    rounding of P, ``fa3_fp8_emulation``), on every call: a real lossy candidate on the CPU."""
    register_backend("FLASH_ATTN", ReferenceFP8)
    yield FP8
    reset_backend("FLASH_ATTN")


def test_two_exact_configs_compare_equal():
    pipe = tiny_flux_pipeline()
    pipe.set_progress_bar_config(disable=True)
    report = compare_pipelines(pipe, "native", "stock", **TINY_CALL)
    assert report.kind == "image" and report.psnr_db == math.inf and report.ssim == 1.0
    assert report.first_call_inputs_equal
    modules = {row.module for row in report.layers}
    assert modules == {"transformer.transformer_blocks.0.attn", "transformer.single_transformer_blocks.0.attn"}
    assert all(row.rel_err == 0 and row.max_abs == 0 and row.local_rel_err == 0 for row in report.layers)
    assert report.side_by_side().size == (3 * 32 + 2 * 2, 32)
    assert applied_attention_config(pipe.transformer) is None  # left as found
    payload = report.to_dict()
    assert payload["attention"]["rel_err_max"] == 0
    assert payload["reference"]["attention"]["default"]["backend"] == "TORCH_SDPA"
    assert payload["candidate"]["attention"] == "stock"


def test_lossy_candidate_differs_and_layers_show_it(reference_fp8, tmp_path):
    pipe = tiny_flux_pipeline().to(torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    from diffusers_omni.installer import apply_attention

    apply_attention(pipe.transformer, "TORCH_SDPA")
    report = compare_pipelines(pipe, "native", reference_fp8, seed=3, **TINY_CALL)
    assert math.isfinite(report.psnr_db) and report.psnr_db > 20 and 0 < report.ssim < 1
    assert report.first_call_inputs_equal
    assert all(0 < row.rel_err < 0.5 and row.local_rel_err > 0 for row in report.layers)
    first = next(row for row in report.layers if row.module.endswith("transformer_blocks.0.attn"))
    # The first attention module sees the same inputs in both runs, so its propagated error is its local one.
    assert first.rel_err == first.local_rel_err
    assert [row["backend"] for row in report.candidate["backends"]] == ["FLASH_ATTN", "FLASH_ATTN"]
    assert all(row["lossy"] for row in report.candidate["backends"])
    assert applied_attention_config(pipe.transformer).default.backend == "TORCH_SDPA"  # put back
    image = report.side_by_side()
    diff = np.asarray(image)[:, 2 * 32 + 4:]
    assert diff.max() > 0  # the amplified difference panel shows it
    path = report.to_json(tmp_path / "q.json")
    assert json.loads(path.read_text())["psnr_db"] == report.psnr_db


def test_video_frame_grid(reference_fp8):
    pipe = tiny_wan_pipeline().to(torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    report = compare_pipelines(pipe, "native", reference_fp8, num_frames=5, **TINY_CALL)
    assert report.kind == "video" and report.reference_output.shape == (1, 5, 32, 32, 3)
    assert report.frame_indices() == [0, 1, 3, 4]
    assert report.side_by_side().size == (4 * 32 + 3 * 2, 3 * 32 + 2 * 2)
    assert len(report.per_frame["psnr_db"]) == 5 and len(report.per_frame["ssim"]) == 5
    assert 0 < report.ssim < 1 and math.isfinite(report.psnr_db)
    roles = {role for row in report.layers for role in row.roles}
    assert "wan.self" in roles and all(row.rel_err > 0 for row in report.layers)


def test_compare_pipelines_refuses_bad_arguments():
    pipe = tiny_flux_pipeline()
    with pytest.raises(ValueError, match="generator"):
        compare_pipelines(pipe, "native", "stock", generator=torch.Generator(), **TINY_CALL)
    with pytest.raises(ValueError, match="candidate=None"):
        compare_pipelines(pipe, "native", None, **TINY_CALL)
    with pytest.raises(ValueError, match="NOPE"):
        compare_pipelines(pipe, "native", "NOPE", **TINY_CALL)
    with pytest.raises(ValueError, match="diff_gain"):
        compare_pipelines(pipe, "native", "stock", diff_gain=0, **TINY_CALL)
